"""The in-process torch engine: a Hugging Face causal LM sampling token ids with exact log-probs.

Concurrent `generate` calls are batched: a worker takes the oldest queued request and up to
`max_batch - 1` more of similar prompt length (`_take_batch`), left-pads them, and decodes them
together with a KV cache on a worker thread (the event loop stays free for keep-alives). Requests that
arrive while a batch runs wait for the next batch (static batching, not continuous batching: simple,
and enough for the embedded CPU setup).

Prompt prefixes are computed once (`_prefix_kv`): a batch's rows share the longest common prefix of
their prompts (a harness's system prompt and tool schemas), so that prefix is run once at batch size
one and its KV cache expanded to the batch; the engine also keeps the KV of recent prefixes
(``prefix_cache_tokens`` tokens in all, least recently used dropped first), so the next batch with
the same system prompt, or the next call of a rollout that extends its previous prompt, runs only
its new tokens. A weight update empties it.

Sampling, per request with its own seeded `torch.Generator` (so a request samples the same tokens
alone or in a batch, up to float rounding of padded batched matmuls):
- temperature 0: greedy; the log-prob is that of the argmax under the untempered distribution;
- otherwise logits / temperature, then top-k, then top-p (nucleus, the top token always kept), then
  renormalise: the token is drawn from that distribution and its log-prob *under that distribution* is
  returned — exactly the sampler's own probability, which is what truncated importance sampling needs.

`update_weights(state_dict, version)` swaps weights in process (`load_state_dict`, a copy into the
served tensors). No new batch starts while an update waits, and the running batch either finishes
on the old weights (``on_update="finish"``) or stops at its next token, its calls re-queued to run
again from their prompts on the new weights (``on_update="abort"``: counted in `aborted_calls`;
each call's seed makes the retry the call the new weights would have sampled). Either way every
`Generation` carries the one version that produced all of its tokens.

A cancelled request (its rollout closed) leaves the queue unrun; inside a running batch it stops
sampling at the next step, and a batch whose rows are all cancelled ends there, so neither the next
batch nor a weight update waits for tokens nobody will read.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from clawfast.engines.base import Engine, Generation, SamplingParams


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution the sampler draws from, for logits of shape [..., V].
    Temperature 0 returns the untempered log-softmax (the greedy caller takes its argmax)."""
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


# Padding tokens a batch may carry beyond half its real prompt tokens: short prompts batch freely.
PAD_SLACK = 512
# A shared prefix shorter than this is run with the rest of the prompt (not worth a separate forward).
MIN_PREFIX = 16


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class _Pending:
    prompt: np.ndarray
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


ON_UPDATE = ("finish", "abort")


class _Aborted(Exception):
    """The running batch stopped for a weight update; its calls run again."""


class TorchEngine(Engine):
    def __init__(self, model: torch.nn.Module, *, max_batch: int = 8, seed: int | None = None,
                 on_update: str = "finish", prefix_cache_tokens: int = 16384) -> None:
        if on_update not in ON_UPDATE:
            raise ValueError(f"on_update must be one of {ON_UPDATE}, got {on_update!r}")
        self.model = model.eval()
        self.on_update = on_update
        self.aborted_calls = 0
        # Set while no update waits: a batch starts only then, so a busy engine cannot starve an update.
        self._no_update = threading.Event()
        self._no_update.set()
        self._abort = threading.Event()
        # transformers 5.x renamed past_key_values to cache; accept both generations of the API.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.max_batch = max_batch
        self.prefix_cache_tokens = prefix_cache_tokens
        self._prefixes: list[tuple[np.ndarray, Any]] = []  # (tokens, their KV cache), most recent last
        self.prefill_tokens = 0  # prompt tokens run through the model (the rest came from the prefix cache)
        self.prompt_tokens = 0
        self.weight_version = 0
        self._weights_lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._worker: asyncio.Task | None = None
        self._seeds = random.Random(seed)
        self._closed = False
        self.batches_run = 0
        self.max_batch_seen = 0
        self.decode_steps = 0  # forward passes of every batch's decode loop
        # Seconds with a batch on the worker thread, aborted ones and a waiting update's pause included
        # (the rest of its life the engine waited for calls).
        self.busy_s = 0.0

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: Any) -> "TorchEngine":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), **kwargs)

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        if self._closed:
            raise RuntimeError("engine is closed")
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("prompt_ids must be a non-empty 1-D sequence")
        loop = asyncio.get_running_loop()
        pending = _Pending(prompt, params, loop.create_future(), loop)
        self._queue.append(pending)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work())
        return await pending.future

    def _take_batch(self) -> list[_Pending]:
        """Remove and return the oldest request plus, in queue order, those that keep the batch's padding
        within half its real tokens plus `PAD_SLACK`. Every row is padded to the longest prompt: two
        12.2K-token Codex prompts batched with two 374-token mini-swe-agent prompts took 78.9 s, the
        same four in two length groups 46.2 s (trainer issue notes)."""
        batch, rest = [self._queue[0]], []
        width = real = len(self._queue[0].prompt)
        for p in self._queue[1:]:
            n = len(p.prompt)
            wider = max(width, n)
            if len(batch) < self.max_batch and wider * (len(batch) + 1) <= 1.5 * (real + n) + PAD_SLACK:
                batch.append(p)
                width, real = wider, real + n
            else:
                rest.append(p)
        self._queue = rest
        return batch

    async def _work(self) -> None:
        while self._queue:
            live = [p for p in self._take_batch() if not p.future.cancelled()]
            if not live:
                continue
            started = time.monotonic()
            try:
                results = await asyncio.to_thread(self._generate_batch, [(p.prompt, p.params) for p in live],
                                                  [p.future.cancelled for p in live])
            except _Aborted:
                self.aborted_calls += len(live)
                self._queue[:0] = live  # first in line, on the new weights
                continue
            except Exception as exc:  # fail this batch's callers, keep serving others
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            finally:
                self.busy_s += time.monotonic() - started
            for p, result in zip(live, results):
                if not p.future.done():
                    p.future.set_result(result)

    def _seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)

    @torch.inference_mode()
    def _generate_batch(self, requests: list[tuple[np.ndarray, SamplingParams]],
                        cancelled: list[Callable[[], bool]] | None = None) -> list[Generation]:
        """`cancelled[i]()` says row i's caller is gone (read from this worker thread each step).
        Raises `_Aborted` when an update asks the running batch to stop (``on_update="abort"``)."""
        self._no_update.wait()
        with self._weights_lock:
            t0 = time.time()
            version = self.weight_version
            self.batches_run += 1
            self.max_batch_seen = max(self.max_batch_seen, len(requests))
            n = len(requests)
            device = self.model.get_output_embeddings().weight.device
            prompts = [p for p, _ in requests]
            # The longest prefix every row shares, leaving each row at least one token to run.
            shared = min(len(p) for p in prompts) - 1
            for p in prompts[1:]:
                shared = min(shared, common_prefix_len(prompts[0], p))
            cache = self._prefix_kv(prompts[0][:shared], device) if shared >= MIN_PREFIX else None
            if cache is None:
                shared = 0
            elif n > 1:
                cache.batch_repeat_interleave(n)
            width = max(len(p) for p in prompts) - shared
            input_ids = torch.zeros((n, width), dtype=torch.long)
            suffix_mask = torch.zeros((n, width), dtype=torch.long)
            for i, prompt in enumerate(prompts):  # left padding keeps every row's last token at -1
                input_ids[i, width - len(prompt) + shared :] = torch.from_numpy(prompt[shared:])
                suffix_mask[i, width - len(prompt) + shared :] = 1
            self.prompt_tokens += sum(len(p) for p in prompts)
            self.prefill_tokens += int(suffix_mask.sum())
            mask = torch.cat([torch.ones((n, shared), dtype=torch.long), suffix_mask], dim=1).to(device)
            input_ids = input_ids.to(device)
            positions = (shared + suffix_mask.cumsum(-1) - 1).clamp(min=0).to(device)
            generators = [torch.Generator().manual_seed(self._seed(params)) for _, params in requests]
            budgets = [max(0, params.max_tokens) for _, params in requests]
            outputs: list[list[int]] = [[] for _ in requests]
            logprobs: list[list[float]] = [[] for _ in requests]
            finish = ["length"] * n
            done = [b == 0 for b in budgets]
            extra = {self._cache_arg: cache} if cache is not None else {}
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **extra)
            cache = self._cache_of(out)
            next_positions = positions[:, -1:] + 1
            while not all(done):
                if self._abort.is_set():
                    raise _Aborted
                # Sampled in float32 on the CPU with each request's CPU generator: the same seed samples
                # the same tokens wherever the model runs.
                last = out.logits[:, -1, :].float().cpu()
                step_tokens = torch.zeros((n, 1), dtype=torch.long)
                for i, (_, params) in enumerate(requests):
                    if not done[i] and cancelled is not None and cancelled[i]():
                        done[i] = True  # nobody reads this row: its result is dropped by `_work`
                    if done[i]:
                        continue
                    logp = sampling_logprobs(last[i], params.temperature, params.top_k, params.top_p)
                    if params.temperature <= 0:
                        token = int(torch.argmax(logp))
                    else:
                        token = int(torch.multinomial(logp.exp(), 1, generator=generators[i]))
                    outputs[i].append(token)
                    logprobs[i].append(float(logp[token]))
                    step_tokens[i, 0] = token
                    if token in params.stop_token_ids:
                        done[i], finish[i] = True, "stop"
                    elif len(outputs[i]) >= budgets[i]:
                        done[i] = True
                if all(done):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=device)], dim=1)
                out = self.model(
                    input_ids=step_tokens.to(device), attention_mask=mask, position_ids=next_positions, use_cache=True,
                    **{self._cache_arg: cache},
                )
                cache = self._cache_of(out)
                next_positions = next_positions + 1
                self.decode_steps += 1
            elapsed = time.time() - t0
            return [
                Generation(
                    np.asarray(outputs[i], dtype=np.int32),
                    np.asarray(logprobs[i], dtype=np.float32),
                    finish[i],
                    version,
                    {"batch_seconds": elapsed, "batch_size": float(n)},
                )
                for i in range(n)
            ]

    def _cache_of(self, out: Any) -> Any:
        return out["cache"] if "cache" in out else out["past_key_values"]

    def _prefix_kv(self, prefix: np.ndarray, device: torch.device) -> Any:
        """A fresh KV cache (batch 1) of `prefix`: the longest cached prefix it starts with, cropped
        and extended by the tokens it lacks; `prefix` is then cached itself. Called under the weights
        lock."""
        best, best_len = None, 0
        for i, entry in enumerate(self._prefixes):
            n = common_prefix_len(entry[0], prefix)
            if n > best_len:
                best, best_len = i, n
        if best is not None and best_len >= MIN_PREFIX:
            best = self._prefixes.pop(best)  # by position: entries hold arrays, which == cannot compare
            self._prefixes.append(best)  # most recently used
            kv = copy.deepcopy(best[1])
            if best_len < len(best[0]):
                kv.crop(best_len - len(best[0]))  # a negative count removes tokens in every transformers version
        else:
            kv, best_len = None, 0
        if best_len < len(prefix):
            rest = torch.from_numpy(prefix[best_len:]).long()[None].to(device)
            positions = torch.arange(best_len, len(prefix), device=device)[None]
            extra = {self._cache_arg: kv} if kv is not None else {}
            kv = self._cache_of(self.model(input_ids=rest, position_ids=positions, use_cache=True, logits_to_keep=1,
                                           **extra))
            self.prefill_tokens += len(prefix) - best_len
            if len(prefix) <= self.prefix_cache_tokens:
                self._prefixes.append((prefix.copy(), copy.deepcopy(kv)))
                while sum(len(t) for t, _ in self._prefixes) > self.prefix_cache_tokens:
                    self._prefixes.pop(0)
        return kv

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load `state_dict` (strict: every parameter, matching shapes) and set the version, once the
        running batch has finished (or stopped: ``on_update="abort"``); no batch starts meanwhile."""
        state_dict = dict(state_dict)  # a stream (a sharded trainer's gathers) is read before generation pauses
        self._no_update.clear()
        if self.on_update == "abort":
            self._abort.set()
        try:
            with self._weights_lock:
                self.model.load_state_dict(state_dict, strict=True)
                self.weight_version = int(version)
                self._prefixes.clear()  # computed by the old weights
        finally:
            self._abort.clear()
            self._no_update.set()

    async def close(self) -> None:
        self._closed = True
        if self._worker is not None:
            await asyncio.gather(self._worker, return_exceptions=True)

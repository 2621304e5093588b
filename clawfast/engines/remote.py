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

Guaranteed: the returned ids are the ids the server sampled (never re-tokenised text), each with the
log-prob the server reported for it, and the two agree in length (else RuntimeError). A 4xx answer
(prompt too long, bad parameter) is a ValueError carrying the server's message; a 5xx or an
unreachable server is a RuntimeError / httpx error. Not guaranteed: which distribution the server's
log-probs are from (vLLM: its ``--logprobs-mode``, raw by default, i.e. before temperature/top-p;
start it with ``--logprobs-mode processed_logprobs`` to match what it sampled), or weight updates:
push weights to the server by its own means and set `weight_version` here.

The HTTP client is created on first use and belongs to that event loop (the proxy's).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np

from clawfast.engines.base import Engine, Generation, SamplingParams

APIS = ("vllm", "sglang")
_TOKEN_PREFIX = "token_id:"


class RemoteEngine(Engine):
    """base_url: the server root (``http://host:port``; a trailing ``/v1`` is accepted for vLLM).
    model: the served model name for vLLM (default: the first one ``GET /v1/models`` lists).
    api_key: sent as ``Authorization: Bearer`` if given."""

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
    ) -> None:
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        base = base_url.rstrip("/")
        if api == "vllm" and base.endswith("/v1"):
            base = base[: -len("/v1")]
        self.base_url = base
        self.api = api
        self.model = model
        self.weight_version = int(weight_version)
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self._timeout, limits=self._limits
            )
            self._loop = loop
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
            models = response.json().get("data") or []
            if not models:
                raise RuntimeError(f"{self.base_url}/v1/models lists no model")
            self.model = str(models[0]["id"])
        return self.model

    async def generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
        if ids.min() < 0:
            raise ValueError(f"prompt_ids holds a negative id {ids.min()}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        prompt = [int(i) for i in ids]
        version = self.weight_version
        t0 = time.perf_counter()
        if self.api == "vllm":
            output_ids, logprobs, finish = await self._generate_vllm(prompt, params)
        else:
            output_ids, logprobs, finish = await self._generate_sglang(prompt, params)
        if len(output_ids) != len(logprobs):
            raise RuntimeError(f"{self.api} server returned {len(output_ids)} tokens but {len(logprobs)} logprobs")
        return Generation(
            output_ids=np.asarray(output_ids, dtype=np.int32),
            infer_logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=finish,
            weight_version=version,
            timings={"generate": time.perf_counter() - t0},
        )

    async def _generate_vllm(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], str]:
        body = {
            "model": await self._model_name(),
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
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
        return output_ids, logprobs, _finish(finish)

    async def _generate_sglang(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], str]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
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
        return output_ids, logprobs, _finish(finish)

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

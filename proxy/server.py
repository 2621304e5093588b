"""HTTP server (uvicorn): the three model-call routes, keep-alives, disconnects; Starlette for the rest.

Routes: POST /v1/messages (Anthropic; ``?beta=true`` accepted), POST /v1/chat/completions, POST
/v1/responses, POST /v1/messages/count_tokens, GET /v1/models, GET /health.

Pseudo-streaming: the whole turn is generated, parsed once, and then the complete event sequence is
written in one send. If the engine is not done after one turn of the event loop, a stream first gets
its head events (message_start + ping, response.created + in_progress, the role chunk) and then a
keep-alive every `ProxyConfig.keepalive_s`, so client idle watchdogs stay quiet.

Guaranteed: every error is in the caller's protocol shape (Anthropic ``{"type": "error", ...}`` on
/v1/messages*, OpenAI ``{"error": {...}}`` elsewhere); an unknown or closed key is a 401 and writes
nothing; a bad body is a 4xx naming the field. A disconnect while the engine works is noticed at once
(the server listens for ``http.disconnect``), and the call is recorded, marked, when generation ends.
Closing a rollout cancels its generations in the engine; a client still waiting gets a 401.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from clawfast.proxy.anthropic import AnthropicFront
from clawfast.proxy.chat import ChatFront, openai_error
from clawfast.proxy.core import PreparedCall, ProxyCore
from clawfast.proxy.front import ProtocolError
from clawfast.proxy.incremental import UnitMemory
from clawfast.proxy.responses import ResponsesFront
from clawfast.proxy.rollouts import Rollout, RolloutRegistry

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
ANTHROPIC, CHAT, RESPONSES = AnthropicFront(), ChatFront(), ResponsesFront()
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def api_key(headers) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None


def _memory(rollout, protocol: str) -> UnitMemory:
    memory = rollout.state.get(protocol)
    if memory is None:
        memory = rollout.state[protocol] = UnitMemory()
    return memory


class JSONBytes(Response):
    media_type = "application/json"


async def _send_json(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ProtocolError(400, "invalid_request", "client disconnected while sending the body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _watch_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _failure(task: asyncio.Task) -> ProtocolError | None:
    """Why a finished generation has no answer, or None if it has one."""
    if task.cancelled():  # its rollout closed meanwhile (Rollout.track)
        return ProtocolError(401, "authentication", "the rollout was closed while this call was generating")
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, ValueError):  # the engine refused this request (e.g. prompt too long)
        return ProtocolError(400, "invalid_request", f"engine refused the request: {exc}")
    log.error("engine failed", exc_info=exc)
    return ProtocolError(500, "api_error", f"engine error: {type(exc).__name__}: {exc}")


class CallResponse:
    """ASGI response for one model call: starts generation, sends keep-alives, answers."""

    def __init__(self, core: ProxyCore, call: PreparedCall) -> None:
        self.core, self.call = core, call

    async def __call__(self, scope, receive, send) -> None:
        core, call, front = self.core, self.call, self.call.front
        stream = call.request.stream
        task = core.start(call)
        watcher = None
        head_sent = False
        try:
            # A zero-latency engine is done after one turn of the loop: then the whole answer goes out
            # in one write, with no disconnect listener. Otherwise the stream head goes out at once,
            # then a keep-alive every keepalive_s while a listener watches for the client leaving.
            await asyncio.sleep(0)
            if not task.done():
                if stream:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                    await send({"type": "http.response.body", "body": front.stream_head(call.answer), "more_body": True})
                    head_sent = True
                watcher = asyncio.ensure_future(_watch_disconnect(receive))
            while not task.done():
                done, _ = await asyncio.wait((task, watcher), timeout=core.config.keepalive_s, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    break
                if watcher in done:
                    core.complete_later(call, task)
                    return
                if stream:
                    await send({"type": "http.response.body", "body": front.keepalive(), "more_body": True})
            err = _failure(task)
            if err is not None:  # record nothing; say why in the protocol's shape
                if head_sent:
                    await send({"type": "http.response.body", "body": front.stream_error(err)})
                else:
                    await _send_json(send, err.status, front.error(err))
                return
            gen = task.result()
            core.complete(call, gen, disconnected=watcher is not None and watcher.done())
            if head_sent:
                await send({"type": "http.response.body", "body": front.stream_body(call.answer)})
            elif stream:
                body = front.stream_head(call.answer) + front.stream_body(call.answer)
                headers = _SSE + [(b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            else:
                await _send_json(send, 200, front.response(call.answer))
        finally:
            if watcher is not None:
                watcher.cancel()


class ProxyApp:
    """The ASGI application around one core and one registry.

    The three model-call routes are dispatched straight from the ASGI scope (one dict lookup): they
    are the hot path, and Starlette's middleware stack and `Request` object cost about a tenth of a
    call there. Everything else (count_tokens, models, health, unknown paths) goes through Starlette.
    """

    CALL_ROUTES = {"/v1/messages": ANTHROPIC, "/v1/chat/completions": CHAT, "/v1/responses": RESPONSES}

    def __init__(self, core: ProxyCore, registry: RolloutRegistry, model_name: str = "policy") -> None:
        self.core, self.registry, self.model_name = core, registry, model_name
        routes = [
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

    async def __call__(self, scope, receive, send) -> None:
        front = self.CALL_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if front is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if scope["method"] != "POST":
                raise ProtocolError(405, "invalid_request", f"{scope['method']} {scope['path']}: method not allowed")
            rollout = self._authorize(headers)
            body = await _read_body(receive)
            query = dict(parse_qsl(scope["query_string"].decode("latin-1"))) if scope["query_string"] else {}
            parsed = front.parse(body, query, _memory(rollout, front.name))
            call = self.core.prepare(front, rollout, parsed, headers)
        except ProtocolError as exc:
            await _send_json(send, exc.status, front.error(exc))
            return
        await CallResponse(self.core, call)(scope, receive, send)

    def _authorize(self, headers) -> Rollout:
        rollout = self.registry.lookup(api_key(headers))
        if rollout is None:
            raise ProtocolError(401, "authentication", "invalid x-api-key: unknown or closed rollout key")
        length = headers.get("content-length") or "0"
        if not length.isdigit():
            raise ProtocolError(400, "invalid_request", f"bad content-length {length!r}")
        if int(length) > MAX_BODY_BYTES:
            raise ProtocolError(413, "too_large", f"request body over {MAX_BODY_BYTES} bytes")
        return rollout

    async def count_tokens(self, request: HTTPRequest):
        try:
            rollout = self._authorize(request.headers)
            conv = ANTHROPIC.parse_count_tokens(await request.body(), _memory(rollout, "count_tokens"))
            n = self.core.count_tokens(rollout, conv)
        except ProtocolError as exc:
            return JSONBytes(ANTHROPIC.error(exc), status_code=exc.status)
        return JSONBytes(orjson.dumps({"input_tokens": n}))

    async def models(self, request: HTTPRequest):
        front = ANTHROPIC if "anthropic-version" in request.headers else CHAT
        if self.registry.lookup(api_key(request.headers)) is None:
            exc = ProtocolError(401, "authentication", "invalid api key: unknown or closed rollout key")
            return JSONBytes(front.error(exc), status_code=401)
        # One shape both SDKs accept: OpenAI's list plus Anthropic's paging and model fields.
        model = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "clawfast",
            "type": "model",
            "display_name": self.model_name,
            "created_at": "1970-01-01T00:00:00Z",
        }
        body = {"object": "list", "data": [model], "has_more": False, "first_id": self.model_name, "last_id": self.model_name}
        return JSONBytes(orjson.dumps(body))

    async def health(self, request: HTTPRequest):
        return JSONBytes(b'{"status":"ok"}')

    async def _http_error(self, request: HTTPRequest, exc: HTTPException):
        kind = {404: "not_found", 405: "invalid_request", 401: "authentication"}.get(exc.status_code, "invalid_request")
        err = ProtocolError(exc.status_code, kind, f"{request.method} {request.url.path}: {exc.detail}")
        body = ANTHROPIC.error(err) if request.url.path.startswith("/v1/messages") else openai_error(err)
        return JSONBytes(body, status_code=exc.status_code)


class ProxyServer:
    """Runs a `ProxyApp` under uvicorn on a background thread (its own event loop): for tests and
    `clawfast.rollout.RolloutService`. Use as a context manager; `base_url` is ``http://host:port``."""

    def __init__(self, app: ProxyApp, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning") -> None:
        import uvicorn

        self.app = app
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="off",
            loop=_loop_name(), http=_http_name(), access_log=False, proxy_headers=False,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.host = host
        self.port = port

    def _run(self) -> None:
        import asyncio as aio

        runner = aio.Runner(loop_factory=_loop_factory())
        with runner:
            self.loop = runner.get_loop()
            runner.run(self._serve())

    async def _serve(self) -> None:
        await self._server.serve()
        await self.app.core.drain()

    def start(self) -> "ProxyServer":
        self._thread = threading.Thread(target=self._run, name="clawfast-proxy", daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("proxy server failed to start")
            time.sleep(0.01)
        sock = self._server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.app.registry.base_url = self.base_url
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def tune_for_serving() -> None:
    """Process settings for serving the proxy; call once after start-up (the CLI and the benchmark do).

    Moves every object alive now (torch, transformers, the tokenizer: hundreds of thousands) out of
    the garbage collector's reach, so its periodic full collections scan only what requests create.
    (Also tried: keeping large buffers in the malloc heap with mallopt; it sped up framing a 64K-token
    record in isolation, 0.31 -> 0.06 ms, but made no difference end to end, so it is not done.)
    """
    gc.collect()
    gc.freeze()


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


def _http_name() -> str:
    try:
        import httptools  # noqa: F401

        return "httptools"
    except ImportError:
        return "h11"

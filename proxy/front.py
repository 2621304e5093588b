"""What every protocol front implements, and the answered-call context it formats.

A front translates its wire format to a canonical `Request` and a parsed `Turn` back to its wire
format, streamed (server-sent events) or not, plus its own error shape. It does no I/O: the server
(`clawfast.proxy.server`) owns sockets, keep-alives and disconnects; the core (`clawfast.proxy.core`)
owns rendering, generation and records.
"""

from __future__ import annotations

import abc
import secrets
import time
from dataclasses import dataclass, field
from typing import Sequence

import orjson
from pydantic import BaseModel, ValidationError

from clawfast.proxy.canonical import Request, ToolChoice, ToolSpec, Turn
from clawfast.proxy.incremental import UnitMemory

def random_id(prefix: str) -> str:
    """prefix + 24 random hex digits (valid in every protocol's id alphabet)."""
    return prefix + secrets.token_hex(12)


class ProtocolError(Exception):
    """A request the proxy refuses: `status` (4xx/5xx), a `kind` in the generic vocabulary
    (invalid_request, context_length, authentication, permission, not_found, too_large, overloaded,
    api_error) and a message."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


def validation_error(exc: ValidationError, prefix: str = "") -> "ProtocolError":
    err = exc.errors()[0]
    parts = ([prefix] if prefix else []) + [str(p) for p in err.get("loc", ())]
    where = ".".join(parts) or "body"
    return ProtocolError(400, "invalid_request", f"{where}: {err.get('msg', 'invalid')}", param=where)


def load_body(body: bytes, model: type[BaseModel], memory: UnitMemory | None = None, key: str = "messages") -> BaseModel:
    """Parse and validate a request body's envelope; 400 naming the problem otherwise. With a
    rollout's `memory`, the `key` array's elements shared byte for byte with an earlier body are not
    parsed again (the same objects come back, see `clawfast.proxy.rawprefix`)."""
    try:
        obj = orjson.loads(body) if memory is None else memory.loads(body, key)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(400, "invalid_request", f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(400, "invalid_request", "body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc) from None


def require_list(value: object, where: str) -> list:
    """Raw JSON that must be an array (envelopes skip validating their big lists)."""
    if not isinstance(value, list):
        raise ProtocolError(400, "invalid_request", f"{where}: must be an array", param=where)
    return value


def validate_unit(model: type[BaseModel], raw: object, where: str) -> BaseModel:
    """Validate one lazily checked part of a request (a message, a tool); 400 naming it otherwise."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, where) from None


def stop_sequences(value: str | Sequence[str] | None, param: str) -> tuple[str, ...]:
    """A request's stop sequences as a tuple; ProtocolError (400) naming `param` if one is empty (it
    would end every answer before its first character)."""
    stops = (value,) if isinstance(value, str) else tuple(value or ())
    if any(s == "" for s in stops):
        raise ProtocolError(400, "invalid_request", "a stop sequence must not be empty", param)
    return stops


def checked_tool_choice(mode: str, name: str | None, tools: Sequence[ToolSpec], param: str,
                        parallel: bool = True) -> ToolChoice:
    """A request's tool choice; ProtocolError (400) naming `param` where it cannot be honoured, as the
    real APIs answer it: a forced call with no tools, or of a tool the request does not offer."""
    if mode in ("required", "tool") and not tools:
        raise ProtocolError(400, "invalid_request", f"tool_choice {mode!r} needs tools, and the request has none", param)
    if mode == "tool" and name not in {t.name for t in tools}:
        raise ProtocolError(400, "invalid_request",
                            f"tool_choice names the tool {name!r}, which is not among the request's tools", param)
    return ToolChoice(mode, name if mode == "tool" else None, parallel)


@dataclass
class Answer:
    """One answered call as a front formats it."""

    request: Request
    response_id: str
    created: int
    prompt_tokens: int
    turn: Turn | None = None  # None while generating (stream head, keep-alives)
    output_tokens: int = 0
    # Each sampled token's text and log-prob, where the request asks for them (`Request.logprobs`).
    sampled: list[tuple[str, float]] | None = None
    extra: dict = field(default_factory=dict)


def sse(event: str | None, data: dict) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


class Front(abc.ABC):
    name: str  # "anthropic" | "chat" | "responses"
    id_prefix: str
    conversation_field = "messages"  # the request field holding the conversation (an error's `param`)

    @abc.abstractmethod
    def parse(self, body: bytes, memory: UnitMemory | None = None) -> Request:
        """Validate a request body; raise ProtocolError (400) naming the bad field. `memory` is the
        rollout's translation memory for this protocol (None: translate everything)."""

    @abc.abstractmethod
    def new_tool_call_id(self) -> str: ...

    @abc.abstractmethod
    def response(self, answer: Answer) -> bytes:
        """The non-streaming JSON body."""

    @abc.abstractmethod
    def stream_head(self, answer: Answer) -> bytes:
        """Events sent before generation finishes (e.g. message_start)."""

    @abc.abstractmethod
    def stream_body(self, answer: Answer) -> bytes:
        """Every remaining event of a complete, well-formed stream."""

    def keepalive(self, answer: Answer) -> bytes:
        """Sent while the engine works so client idle watchdogs do not fire: an SSE comment here;
        a protocol whose clients time out on events (a comment is no event to an SSE parser) sends
        one its clients pass over."""
        return b": keep-alive\n\n"

    @abc.abstractmethod
    def error(self, exc: ProtocolError) -> bytes:
        """The JSON error body of this protocol."""

    @abc.abstractmethod
    def stream_error(self, answer: Answer, exc: ProtocolError) -> bytes:
        """The events that end a stream whose 200 headers are already sent in error."""

    def new_answer(self, request: Request, prompt_tokens: int) -> Answer:
        return Answer(request, random_id(self.id_prefix), int(time.time()), prompt_tokens)

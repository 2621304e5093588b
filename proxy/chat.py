"""OpenAI Chat Completions front: request -> canonical conversation, turn -> completion / chunks.

Mapping: leading ``system`` / ``developer`` messages are the system text; later ones stay system
messages; ``tool`` messages answer a ``tool_call_id``; assistant ``tool_calls`` arguments (a JSON
string) are canonicalised. Stream: a role chunk first (sent before generation finishes, then SSE
comments as keep-alives), then reasoning / content / one chunk per tool call (whole arguments, with
index, id, type, name), a finish chunk, a usage chunk (``choices: []``) if
``stream_options.include_usage``, then ``data: [DONE]``. ``logprobs: true``: each sampled token with
its log-prob (the policy's, as recorded), in the message's choice or the stream's finish chunk;
``top_logprobs`` above 0 is a 400 (engines report the sampled token's log-prob, no alternatives).
"""

from __future__ import annotations

import orjson

from clawfast.proxy.canonical import Conversation, Message, Request, ToolCall, ToolSpec, canonical_arguments
from clawfast.proxy.chat_models import ChatMessage, ChatRequest, ChatTool, NamedToolChoice
from clawfast.proxy.front import (
    Answer, Front, ProtocolError, checked_tool_choice, load_body, random_id, require_list, stop_sequences,
    validate_unit,
)
from clawfast.proxy.incremental import UnitMemory

_ERROR_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("permission_error", None),
    "not_found": ("invalid_request_error", "not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "context_length": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("server_error", "overloaded"),
    "api_error": ("server_error", None),
}


def openai_error(exc: ProtocolError) -> bytes:
    kind, code = _ERROR_TYPES.get(exc.kind, ("server_error", None))
    return orjson.dumps({"error": {"message": exc.message, "type": kind, "param": exc.param, "code": code}})


def openai_error_code(exc: ProtocolError) -> str:
    """The error's OpenAI code, else its type (a Responses ``response.failed`` error always has a code)."""
    kind, code = _ERROR_TYPES.get(exc.kind, ("server_error", None))
    return code or kind


def part_text(part, text_types: tuple[str, ...], image_types: tuple[str, ...]) -> str:
    """What the model reads for one content part: a text part's text, a refusal's refusal, ``[image]``
    for an image, else a placeholder naming the part's type (``[input_audio]``, ``[file]``)."""
    if part.type in text_types:
        return part.text or ""
    if part.type == "refusal":
        return part.refusal or ""
    if part.type in image_types:
        return "[image]"
    return f"[{part.type}]"


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part_text(p, ("text", "input_text", "output_text"), ("image_url",)) for p in content)


def _message(m: ChatMessage, i: int) -> Message:
    if m.role in ("system", "developer"):  # leading ones are the system text (see _conversation)
        return Message("system", _text(m.content))
    if m.role == "user":
        return Message("user", _text(m.content))
    if m.role == "assistant":
        calls = tuple(ToolCall(c.id, c.function.name, canonical_arguments(c.function.arguments or {})) for c in m.tool_calls or ())
        return Message("assistant", _text(m.content), calls, reasoning=m.reasoning_content or "")
    if m.role in ("tool", "function"):
        return Message("tool", _text(m.content), tool_call_id=m.tool_call_id or m.name or "")
    raise ProtocolError(400, "invalid_request", f"messages.{i}.role: unexpected role {m.role!r}", f"messages.{i}.role")


def _tools(raw: list | None) -> tuple[ToolSpec, ...]:
    specs = []
    for i, item in enumerate(raw or ()):
        if isinstance(item, dict) and item.get("type", "function") != "function":
            continue  # custom and other tool types are not offered (docs/HARNESSES.md), as on the other fronts
        t = validate_unit(ChatTool, item, f"tools.{i}")
        params = t.function.parameters or {"type": "object", "properties": {}}
        specs.append(ToolSpec(t.function.name, t.function.description or "", canonical_arguments(params)))
    return tuple(specs)


def _conversation(messages: list, tools: list | None, memory: UnitMemory | None) -> Conversation:
    if not require_list(messages, "messages"):
        raise ProtocolError(400, "invalid_request", "messages: at least one message is required", "messages")
    memory = memory or UnitMemory()
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], dict) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    system = [_text(validate_unit(ChatMessage, messages[i], f"messages.{i}").content) for i in range(lead)]
    rest = memory.translate(messages[lead:], lambda raw, i: [_message(validate_unit(ChatMessage, raw, f"messages.{i + lead}"), i + lead)])
    return Conversation("\n\n".join(system), memory.memo("tools", tools, _tools), tuple(rest))


class ChatFront(Front):
    name = "chat"
    id_prefix = "chatcmpl-"

    def parse(self, body: bytes, memory: UnitMemory | None = None) -> Request:
        req = load_body(body, ChatRequest, memory)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        conv = _conversation(req.messages, req.tools, memory)
        if req.top_logprobs and not req.logprobs:
            raise ProtocolError(400, "invalid_request", "top_logprobs requires logprobs to be true", "top_logprobs")
        if req.top_logprobs:
            raise ProtocolError(400, "invalid_request", "top_logprobs is not supported: this server reports the log-prob "
                                "of each sampled token only (logprobs: true), no alternatives", "top_logprobs")
        choice = req.tool_choice
        if isinstance(choice, NamedToolChoice):
            mode, name = "tool", choice.function.name
        else:
            mode, name = choice or "auto", None
        return Request(
            protocol=self.name,
            conversation=conv,
            model=req.model,
            stream=bool(req.stream),
            max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k and req.top_k > 0 else None,
            stop=stop_sequences(req.stop, "stop"),
            tool_choice=checked_tool_choice(mode, name, conv.tools, "tool_choice",
                                            parallel=req.parallel_tool_calls is not False),
            logprobs=bool(req.logprobs),
            facts={"include_usage": True} if include_usage else {},
        )

    def new_tool_call_id(self) -> str:
        return random_id("call_")

    def _usage(self, answer: Answer) -> dict:
        return {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.output_tokens,
            "total_tokens": answer.prompt_tokens + answer.output_tokens,
        }

    def _finish(self, answer: Answer) -> str:
        return answer.turn.finish_reason  # "stop" | "length" | "tool_calls": the OpenAI vocabulary

    @staticmethod
    def _logprobs(answer: Answer) -> dict | None:
        if answer.sampled is None:
            return None
        content = [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                   for token, logprob in answer.sampled]
        return {"content": content, "refusal": None}

    def response(self, answer: Answer) -> bytes:
        turn = answer.turn
        message: dict = {"role": "assistant", "content": turn.content if (turn.content or not turn.tool_calls) else None}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in turn.tool_calls
            ]
        return orjson.dumps(
            {
                "id": answer.response_id,
                "object": "chat.completion",
                "created": answer.created,
                "model": answer.request.model,
                "choices": [{"index": 0, "message": message, "finish_reason": self._finish(answer),
                             "logprobs": self._logprobs(answer)}],
                "usage": self._usage(answer),
            }
        )

    def _chunk(self, answer: Answer, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        chunk = {
            "id": answer.response_id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.request.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def stream_head(self, answer: Answer) -> bytes:
        return self._chunk(answer, {"role": "assistant", "content": ""})

    def stream_body(self, answer: Answer) -> bytes:
        turn = answer.turn
        out = []
        if turn.reasoning:
            out.append(self._chunk(answer, {"reasoning_content": turn.reasoning}))
        if turn.content:
            out.append(self._chunk(answer, {"content": turn.content}))
        for index, c in enumerate(turn.tool_calls):
            call = {"index": index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            out.append(self._chunk(answer, {"tool_calls": [call]}))
        out.append(self._chunk(answer, {}, self._finish(answer), self._logprobs(answer)))
        if answer.request.facts.get("include_usage"):
            usage = {
                "id": answer.response_id,
                "object": "chat.completion.chunk",
                "created": answer.created,
                "model": answer.request.model,
                "choices": [],
                "usage": self._usage(answer),
            }
            out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, exc: ProtocolError) -> bytes:
        return openai_error(exc)

    def stream_error(self, answer: Answer, exc: ProtocolError) -> bytes:
        return b"data: " + openai_error(exc) + b"\n\n"

"""Anthropic Messages front: request -> canonical conversation, parsed turn -> message / SSE events.

Mapping: `system` (string or text blocks, minus Claude Code's per-request
``x-anthropic-billing-header`` block, whose nonce would break every prefix) is the leading system text;
``role: "system"`` entries inside `messages` stay system messages; a user turn's ``tool_result`` blocks
become tool messages and its text blocks a user message, in block order; an assistant turn's text,
``thinking`` and ``tool_use`` blocks become one assistant message. Tools the API defines (a versioned
``type`` such as ``web_search_20250305`` or ``bash_20250124``) are not offered to the model, as
Responses' hosted tools are not: a server tool would need the server to run it, and the request does
not carry the schema of a client one (a forced choice of one is then a 400). Stream order (HARNESSES.md):
message_start, ping, per block content_block_start / _delta / _stop, message_delta, message_stop.
"""

from __future__ import annotations

import dataclasses

import orjson

from clawfast.proxy.anthropic_models import (
    Block, CountTokensRequest, MessageParam, MessagesRequest, Tool, ToolChoiceParam,
)
from clawfast.proxy.canonical import (
    Conversation,
    Message,
    Request,
    ToolCall,
    ToolChoice,
    ToolSpec,
    arguments_object,
    canonical_arguments,
)
from clawfast.proxy.front import (
    Answer, Front, ProtocolError, checked_tool_choice, load_body, random_id, require_list, stop_sequences, sse,
    validate_unit,
)
from clawfast.proxy.incremental import UnitMemory

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
THINKING_SIGNATURE = "clawfast"  # harnesses replay it; nothing verifies it
_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "context_length": "invalid_request_error",  # "prompt is too long: N tokens > M maximum", as Anthropic's API
    "overloaded": "overloaded_error",
    "api_error": "api_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def _block_text(block: Block) -> str:
    """What the model reads for a user-side block: its text, or a placeholder naming its type
    (``[image]``, ``[document]``, ``[search_result]``), as the OpenAI fronts do (`chat.part_text`)."""
    if block.type == "text":
        return block.text or ""
    return f"[{block.type}]"


def _tool_result_text(content: str | list[Block] | dict | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return f"[{content.get('type', 'object')}]"
    return "\n".join(_block_text(b) for b in content)


def system_text(system: str | list[Block] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    texts = [b.text or "" for b in system if b.type == "text"]
    return "\n".join(t for t in texts if not t.startswith(BILLING_HEADER_PREFIX))


def _message(param: MessageParam, i: int) -> list[Message]:
    blocks = [Block(type="text", text=param.content)] if isinstance(param.content, str) else param.content
    if param.role == "assistant":
        text = "".join(b.text or "" for b in blocks if b.type == "text")
        reasoning = "".join(b.thinking or "" for b in blocks if b.type == "thinking")
        calls = tuple(
            ToolCall(b.id or "", b.name or "", canonical_arguments(b.input if b.input is not None else {}))
            for b in blocks
            if b.type in ("tool_use", "server_tool_use")
        )
        return [Message("assistant", text, calls, reasoning=reasoning)]
    if param.role not in ("user", "system"):
        raise ProtocolError(400, "invalid_request", f"messages.{i}.role: unexpected role {param.role!r}", f"messages.{i}.role")
    out: list[Message] = []
    pending: list[str] = []
    for block in blocks:
        if block.type == "tool_result" and param.role == "user":
            if pending:
                out.append(Message("user", "\n".join(pending)))
                pending = []
            out.append(Message("tool", _tool_result_text(block.content), tool_call_id=block.tool_use_id or ""))
        else:
            text = _block_text(block)
            if text or block.type == "text":
                pending.append(text)
    if pending or not blocks:
        out.append(Message(param.role, "\n".join(pending)))
    return out


def split_prefill(conv: Conversation) -> tuple[Conversation, str]:
    """A conversation that ends with an assistant message ends with the start of the answer (a
    prefill), which the model is to continue: the conversation before it, and its text ("" for none).
    As the API answers them, a prefill with trailing whitespace, or holding more than text, is a 400."""
    if not conv.messages or conv.messages[-1].role != "assistant":
        return conv, ""
    last, where = conv.messages[-1], f"messages.{len(conv.messages) - 1}"
    if last.tool_calls or last.reasoning:
        raise ProtocolError(400, "invalid_request", "a final assistant message (a prefill) may hold text only", where)
    if last.content != last.content.rstrip():
        raise ProtocolError(400, "invalid_request", "final assistant content cannot end with trailing whitespace", where)
    return dataclasses.replace(conv, messages=conv.messages[:-1]), last.content


def _tool_choice(choice: ToolChoiceParam | None, conv: Conversation) -> ToolChoice:
    if choice is None:
        return checked_tool_choice("auto", None, conv.tools, "tool_choice")
    return checked_tool_choice({"any": "required"}.get(choice.type, choice.type), choice.name, conv.tools,
                               "tool_choice", parallel=not choice.disable_parallel_tool_use)


def _convert_message(raw: object, i: int) -> list[Message]:
    return _message(validate_unit(MessageParam, raw, f"messages.{i}"), i)


def _tools(raw: list | None) -> tuple[ToolSpec, ...]:
    specs = []
    for i, item in enumerate(raw or ()):
        if isinstance(item, dict) and item.get("type") not in (None, "custom"):
            continue  # defined by the API (module docstring): not offered, whatever fields it has
        t = validate_unit(Tool, item, f"tools.{i}")
        specs.append(ToolSpec(t.name, t.description or "", canonical_arguments(t.input_schema or {"type": "object", "properties": {}})))
    return tuple(specs)


def conversation(system, messages: list, tools: list | None, memory: UnitMemory | None) -> Conversation:
    if not require_list(messages, "messages"):
        raise ProtocolError(400, "invalid_request", "messages: at least one message is required", "messages")
    memory = memory or UnitMemory()
    msgs = memory.translate(messages, _convert_message)
    return Conversation(system_text(system), memory.memo("tools", tools, _tools), tuple(msgs))


class AnthropicFront(Front):
    name = "anthropic"
    id_prefix = "msg_"

    def parse(self, body: bytes, memory: UnitMemory | None = None) -> Request:
        req = load_body(body, MessagesRequest, memory)
        conv, prefill = split_prefill(conversation(req.system, req.messages, req.tools, memory))
        return Request(
            protocol=self.name,
            conversation=conv,
            model=req.model,
            stream=req.stream,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k or None,
            stop=stop_sequences(req.stop_sequences, "stop_sequences"),
            tool_choice=_tool_choice(req.tool_choice, conv),
            prefill=prefill,
        )

    def parse_count_tokens(self, body: bytes, memory: UnitMemory | None = None) -> Request:
        """A count_tokens body as the request it counts: what `parse` reads of a messages body."""
        req = load_body(body, CountTokensRequest, memory)
        conv, prefill = split_prefill(conversation(req.system, req.messages, req.tools, memory))
        return Request(protocol=self.name, conversation=conv, model=req.model, stream=False, max_tokens=None,
                       tool_choice=_tool_choice(req.tool_choice, conv), prefill=prefill)

    def new_tool_call_id(self) -> str:
        return random_id("toolu_")

    # -- replies ---------------------------------------------------------------------------------

    def _blocks(self, answer: Answer) -> list[dict]:
        turn = answer.turn
        blocks: list[dict] = []
        if turn.reasoning:
            blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": THINKING_SIGNATURE})
        if turn.content or not turn.tool_calls:
            blocks.append({"type": "text", "text": turn.content})
        for call in turn.tool_calls:
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call.arguments)})
        return blocks

    def _usage(self, answer: Answer) -> dict:
        return {
            "input_tokens": answer.prompt_tokens,
            "output_tokens": answer.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }

    def _stop(self, answer: Answer) -> tuple[str, str | None]:
        """stop_reason and stop_sequence: a stop sequence is the reason only where no tool call is."""
        turn = answer.turn
        if turn.stop_sequence is not None and turn.finish_reason == "stop":
            return "stop_sequence", turn.stop_sequence
        return _STOP_REASONS[turn.finish_reason], None

    def _message(self, answer: Answer, content: list[dict], stop: tuple[str | None, str | None]) -> dict:
        return {
            "id": answer.response_id,
            "type": "message",
            "role": "assistant",
            "model": answer.request.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage(answer),
        }

    def response(self, answer: Answer) -> bytes:
        return orjson.dumps(self._message(answer, self._blocks(answer), self._stop(answer)))

    def stream_head(self, answer: Answer) -> bytes:
        start = {"type": "message_start", "message": self._message(answer, [], (None, None))}
        return sse("message_start", start) + self.keepalive(answer)

    def keepalive(self, answer: Answer) -> bytes:
        return b'event: ping\ndata: {"type":"ping"}\n\n'

    def stream_body(self, answer: Answer) -> bytes:
        out = []
        for index, block in enumerate(self._blocks(answer)):
            kind = block["type"]
            if kind == "text":
                start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
            elif kind == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            else:
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
            out.append(sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            if kind == "thinking":
                sig = {"type": "signature_delta", "signature": THINKING_SIGNATURE}
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": sig}))
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        stop_reason, stop_sequence = self._stop(answer)
        out.append(
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": answer.output_tokens},
                },
            )
        )
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, exc: ProtocolError) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": _ERROR_TYPES.get(exc.kind, "api_error"), "message": exc.message}})

    def stream_error(self, answer: Answer, exc: ProtocolError) -> bytes:
        return b"event: error\ndata: " + self.error(exc) + b"\n\n"

"""OpenAI Responses front (Codex CLI): request -> canonical conversation, turn -> response / events.

Mapping: `instructions` (and leading system/developer messages) are the system text; consecutive
assistant-side items (reasoning, assistant message, function_call, custom_tool_call) form one
assistant message; ``function_call_output`` / ``custom_tool_call_output`` items are tool messages.
Function tools and custom (free-form) tools are offered to the model; a custom tool is presented as a
function with one string parameter ``input`` and answered as a ``custom_tool_call``. Other tool types
(web search, ...) are not offered. Log-probs (``top_logprobs``, ``include`` of
``message.output_text.logprobs``) are a 400: which sampled tokens make an output text is not kept
apart from reasoning and calls (Chat Completions lists every sampled token).

Stream (HARNESSES.md): response.created, response.in_progress (again every keep-alive while generating);
per output item: output_item.added, its deltas and .done events, output_item.done; finally
response.completed carrying id, output and usage. Every event has a sequence_number.
"""

from __future__ import annotations

import orjson

from clawfast.proxy.canonical import Conversation, Message, Request, ToolCall, ToolSpec, arguments_object, canonical_arguments
from clawfast.proxy.chat import openai_error, openai_error_code, part_text
from clawfast.proxy.front import (
    Answer, Front, ProtocolError, checked_tool_choice, load_body, random_id, require_list, sse, validate_unit,
)
from clawfast.proxy.incremental import UnitMemory
from clawfast.proxy.responses_models import Item, Part, ResponsesRequest, ToolChoiceParam, ToolDef

_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ASSISTANT_ITEMS = ("reasoning", "function_call", "custom_tool_call")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text(content: str | list[Part] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part_text(p, _TEXT_PARTS, ("input_image",)) for p in content)


def _is_assistant_side(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return kind in _ASSISTANT_ITEMS or (kind in (None, "message") and item.get("role") == "assistant")


def _runs(items: list) -> tuple[list[list], list[int]]:
    """Items grouped into translation units: each run of consecutive assistant-side items (one
    assistant message), and every other item alone; with each unit's first item index."""
    runs: list[list] = []
    starts: list[int] = []
    for i, item in enumerate(items):
        if _is_assistant_side(item) and runs and _is_assistant_side(runs[-1][0]):
            runs[-1].append(item)
        else:
            runs.append([item])
            starts.append(i)
    return runs, starts


def _assistant(items: list[Item]) -> Message:
    text, calls, reasoning = [], [], []
    for item in items:
        kind = item.type or "message"
        if kind == "message":
            text.append(_text(item.content))
        elif kind == "reasoning":
            reasoning.append(_text(item.summary) or _text(item.content))
        elif kind == "function_call":
            args = canonical_arguments(item.arguments if item.arguments is not None else {})
            calls.append(ToolCall(item.call_id or "", item.name or "", args))
        else:
            calls.append(ToolCall(item.call_id or "", item.name or "", canonical_arguments({"input": item.input or ""})))
    return Message("assistant", "".join(text), tuple(calls), reasoning="".join(reasoning))


def _convert_run(run: list, start: int) -> list[Message]:
    items = [validate_unit(Item, raw, f"input.{start + j}") for j, raw in enumerate(run)]
    if _is_assistant_side(run[0]):
        return [_assistant(items)]
    (item,) = items
    kind = item.type or ("message" if item.role else None)
    if kind == "message":
        if item.role in ("system", "developer"):  # leading ones are the system text (see _conversation)
            return [Message("system", _text(item.content))]
        if item.role == "user":
            return [Message("user", _text(item.content))]
        raise ProtocolError(400, "invalid_request", f"input.{start}.role: unexpected role {item.role!r}", f"input.{start}.role")
    if kind in ("function_call_output", "custom_tool_call_output"):
        return [Message("tool", _text(item.output), tool_call_id=item.call_id or "")]
    if kind == "item_reference":  # like previous_response_id: it names an item only a store could hold
        raise ProtocolError(400, "invalid_request", f"input.{start}: item_reference {item.id!r} not found: this server "
                            f"stores no items; send the item itself", f"input.{start}")
    return []  # other item types (web_search_call, local_shell_call, ...) carry nothing the model reads


def _tools(raw: list | None) -> tuple[tuple[ToolSpec, ...], tuple[str, ...]]:
    tools, custom = [], []
    for i, item in enumerate(raw or ()):
        t = validate_unit(ToolDef, item, f"tools.{i}")
        if t.type in ("function", "custom") and not t.name:  # such as Chat's nested {"function": {...}}
            raise ProtocolError(400, "invalid_request", f"tools.{i}.name: Field required", f"tools.{i}.name")
        if t.type == "function":
            params = t.parameters or {"type": "object", "properties": {}}
            tools.append(ToolSpec(t.name, t.description or "", canonical_arguments(params)))
        elif t.type == "custom":
            tools.append(ToolSpec(t.name, t.description or "", canonical_arguments(_CUSTOM_PARAMETERS)))
            custom.append(t.name)
    return tuple(tools), tuple(custom)


def _conversation(req: ResponsesRequest, memory: UnitMemory | None) -> tuple[Conversation, tuple[str, ...]]:
    memory = memory or UnitMemory()
    system = [req.instructions] if req.instructions else []
    if isinstance(req.input, str):
        messages = [Message("user", req.input)]
    else:
        runs, starts = _runs(require_list(req.input, "input"))
        lead = 0
        while lead < len(runs) and isinstance(runs[lead][0], dict) and runs[lead][0].get("role") in ("system", "developer"):
            lead += 1
        system += [m.content for r in range(lead) for m in _convert_run(runs[r], starts[r])]
        messages = memory.translate(runs[lead:], lambda run, i: _convert_run(run, starts[i + lead]))
    if not messages:
        raise ProtocolError(400, "invalid_request", "input: at least one message is required", "input")
    tools, custom = memory.memo("tools", req.tools, _tools)
    return Conversation("\n\n".join(system), tools, tuple(messages)), custom


def _tool_choice_echo(request: Request) -> str | dict:
    """The request's tool choice as the response object states it."""
    choice = request.tool_choice
    if choice.mode != "tool":
        return choice.mode
    return {"type": "custom" if choice.name in request.facts.get("custom_tools", ()) else "function", "name": choice.name}


def _custom_input(arguments: str) -> str:
    """A custom tool's free-form input from the call the model wrote (one string parameter ``input``):
    that string; any other value as its JSON (never Python's repr); "" where it wrote none."""
    value = arguments_object(arguments).get("input", "")
    return value if isinstance(value, str) else orjson.dumps(value).decode()


class ResponsesFront(Front):
    name = "responses"
    id_prefix = "resp_"
    conversation_field = "input"

    def parse(self, body: bytes, memory: UnitMemory | None = None) -> Request:
        req = load_body(body, ResponsesRequest, memory, "input")
        if req.previous_response_id is not None:
            # As the real API answers an id it does not know: without its stored turns, the input alone
            # would be rendered as the whole conversation.
            raise ProtocolError(400, "invalid_request", f"previous response {req.previous_response_id!r} not found: "
                                "this server stores no responses; send the whole conversation in input",
                                "previous_response_id")
        if req.top_logprobs or _LOGPROBS_INCLUDE in (req.include or ()):
            # An answer without them would read as if the model's text had none; Chat Completions has them.
            raise ProtocolError(400, "invalid_request", "log-probs are not supported on this endpoint (Chat Completions "
                                "answers logprobs: true)", "top_logprobs" if req.top_logprobs else "include")
        conv, custom = _conversation(req, memory)
        choice = req.tool_choice
        if isinstance(choice, ToolChoiceParam):
            if choice.type not in ("function", "custom") or choice.name is None:
                raise ProtocolError(400, "invalid_request", f"tool_choice of type {choice.type!r} is not supported (this "
                                    "server runs no hosted tools): give none, auto, required, or a function or custom "
                                    "tool by name", "tool_choice")
            mode, name = "tool", choice.name
        else:
            mode, name = choice or "auto", None
        return Request(
            protocol=self.name,
            conversation=conv,
            model=req.model,
            stream=bool(req.stream),
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=checked_tool_choice(mode, name, conv.tools, "tool_choice",
                                            parallel=req.parallel_tool_calls is not False),
            facts={"custom_tools": list(custom)} if custom else {},
        )

    def new_tool_call_id(self) -> str:
        return random_id("call_")

    # -- replies ---------------------------------------------------------------------------------

    def _items(self, answer: Answer) -> list[dict]:
        """Output items, built once per answer so streamed and final ids agree."""
        if "items" in answer.extra:
            return answer.extra["items"]
        turn = answer.turn
        custom = set(answer.request.facts.get("custom_tools", ()))
        items: list[dict] = []
        if turn.reasoning:
            items.append({"type": "reasoning", "id": random_id("rs_"), "summary": [{"type": "summary_text", "text": turn.reasoning}]})
        if turn.content or not turn.tool_calls:
            items.append(
                {
                    "type": "message",
                    "id": random_id("msg_"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": turn.content, "annotations": []}],
                }
            )
        for call in turn.tool_calls:
            if call.name in custom:
                item = {"type": "custom_tool_call", "id": random_id("ctc_"), "call_id": call.id, "name": call.name,
                        "input": _custom_input(call.arguments), "status": "completed"}
            else:
                item = {"type": "function_call", "id": random_id("fc_"), "call_id": call.id, "name": call.name,
                        "arguments": call.arguments, "status": "completed"}
            items.append(item)
        answer.extra["items"] = items
        return items

    def _response(self, answer: Answer, status: str, output: list[dict], with_usage: bool) -> dict:
        resp = {
            "id": answer.response_id,
            "object": "response",
            "created_at": answer.created,
            "status": status,
            "model": answer.request.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "parallel_tool_calls": answer.request.tool_choice.parallel,
            "temperature": answer.request.temperature,
            "top_p": answer.request.top_p,
            "tool_choice": _tool_choice_echo(answer.request),
            "tools": [],
            "usage": None,
        }
        if with_usage:
            if answer.turn.finish_reason == "length":
                resp["status"] = "incomplete"
                resp["incomplete_details"] = {"reason": "max_output_tokens"}
            resp["usage"] = {
                "input_tokens": answer.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": answer.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.prompt_tokens + answer.output_tokens,
            }
        return resp

    def response(self, answer: Answer) -> bytes:
        return orjson.dumps(self._response(answer, "completed", self._items(answer), True))

    def _event(self, answer: Answer, kind: str, **fields) -> bytes:
        seq = answer.extra.get("seq", 0)
        answer.extra["seq"] = seq + 1
        return sse(kind, {"type": kind, "sequence_number": seq, **fields})

    def stream_head(self, answer: Answer) -> bytes:
        pending = self._response(answer, "in_progress", [], False)
        return self._event(answer, "response.created", response=pending) + self._event(
            answer, "response.in_progress", response=pending
        )

    def keepalive(self, answer: Answer) -> bytes:
        # response.in_progress again, not an SSE comment: Codex's idle timer (stream_idle_timeout_ms,
        # 5 minutes by default) waits for an event, and a comment is none; it and the SDKs pass over
        # in_progress events.
        return self._event(answer, "response.in_progress", response=self._response(answer, "in_progress", [], False))

    def stream_body(self, answer: Answer) -> bytes:
        ev = self._event
        out = []
        for index, item in enumerate(self._items(answer)):
            kind, item_id = item["type"], item["id"]
            if kind == "message":
                text = item["content"][0]["text"]
                empty_part = {"type": "output_text", "text": "", "annotations": []}
                out.append(ev(answer, "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}))
                out.append(ev(answer, "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=empty_part))
                out.append(ev(answer, "response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text, logprobs=[]))
                out.append(ev(answer, "response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text, logprobs=[]))
                out.append(ev(answer, "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=item["content"][0]))
            elif kind == "function_call":
                out.append(ev(answer, "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""}))
                out.append(ev(answer, "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=item["arguments"]))
                out.append(ev(answer, "response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=item["arguments"]))
            elif kind == "custom_tool_call":
                out.append(ev(answer, "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "input": ""}))
                out.append(ev(answer, "response.custom_tool_call_input.delta", item_id=item_id, output_index=index, delta=item["input"]))
                out.append(ev(answer, "response.custom_tool_call_input.done", item_id=item_id, output_index=index, input=item["input"]))
            else:  # reasoning
                text = item["summary"][0]["text"]
                out.append(ev(answer, "response.output_item.added", output_index=index, item={**item, "summary": []}))
                part = {"type": "summary_text", "text": text}
                out.append(ev(answer, "response.reasoning_summary_part.added", item_id=item_id, output_index=index, summary_index=0, part={**part, "text": ""}))
                out.append(ev(answer, "response.reasoning_summary_text.delta", item_id=item_id, output_index=index, summary_index=0, delta=text))
                out.append(ev(answer, "response.reasoning_summary_text.done", item_id=item_id, output_index=index, summary_index=0, text=text))
                out.append(ev(answer, "response.reasoning_summary_part.done", item_id=item_id, output_index=index, summary_index=0, part=part))
            out.append(ev(answer, "response.output_item.done", output_index=index, item=item))
        final = self._response(answer, "completed", self._items(answer), True)
        # Always response.completed (status "incomplete" inside when cut by max_output_tokens): Codex
        # treats a stream without it as broken.
        out.append(ev(answer, "response.completed", response=final))
        return b"".join(out)

    def error(self, exc: ProtocolError) -> bytes:
        return openai_error(exc)

    def stream_error(self, answer: Answer, exc: ProtocolError) -> bytes:
        # As the Responses API ends a failed stream: response.failed, the response with status "failed"
        # and its error. Codex reads error.code: context_length_exceeded is a context overflow, any
        # other code a stream it retries; a stream that just stops is broken to it and to the SDK.
        failed = self._response(answer, "failed", [], False)
        failed["error"] = {"code": openai_error_code(exc), "message": exc.message}
        return self._event(answer, "response.failed", response=failed)

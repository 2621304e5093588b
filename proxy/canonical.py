"""The canonical conversation every protocol front translates into, and the parsed model turn it
translates back from.

Values are frozen and hashable: a `Message` is its own cache key (the renderer maps a message to its
tokens, and a produced assistant turn to the exact tokens the engine sampled). Tool-call arguments
are kept as canonical JSON text (``json.dumps`` of the parsed object, key order preserved), so the
same call replayed through any protocol gives the same key; arguments that are not valid JSON are
kept verbatim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON text. A JSON string is parsed and re-dumped; text that is
    not JSON is returned unchanged; any other value is dumped."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, ensure_ascii=False)


def arguments_object(arguments: str) -> Any:
    """The parsed arguments, or ``{}`` if the text is not a JSON object (Anthropic ``input`` must be
    an object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # canonical JSON text, see canonical_arguments


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent, by value: a whole one as the integer (a harness
    that re-serialises arguments in JavaScript sends ``1.0`` back as ``1``, ``1e5`` as ``100000``)."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def _call_key(call: ToolCall) -> tuple[str, str, str]:
    try:
        arguments = json.dumps(json.loads(call.arguments, parse_float=_number), sort_keys=True, ensure_ascii=False)
    except ValueError:
        arguments = call.arguments
    return ("".join(ch for ch in call.id if ch.isalnum()), call.name, arguments)


@dataclass(frozen=True)
class Message:
    """role: system | user | assistant | tool. For tool messages `tool_call_id` names the call
    answered. `reasoning` is the assistant's thinking text, which is not part of the replay key
    (harnesses often drop it) — see `replay_key`."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str = ""

    def replay_key(self) -> tuple:
        """What identifies an assistant turn when the harness sends it back: visible text (stripped)
        and tool calls (ids included, so two identical calls in different turns stay apart).

        Harnesses replay calls with cosmetic changes that must not break the token splice: Claude
        Code re-orders argument keys into its tool schema's order, OpenClaw strips the underscore
        from call ids (`call_0aG` comes back as `call0aG`), a JavaScript client writes ``1.0`` as
        ``1``. The key therefore compares ids by their alphanumeric characters and arguments as
        key-sorted JSON with numbers by value (`_number`)."""
        return (self.content.strip(), tuple(_call_key(c) for c in self.tool_calls))

    def template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates expect it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'  # canonical JSON text

    def template_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": json.loads(self.parameters)},
        }


@dataclass(frozen=True)
class Conversation:
    """system: the leading system text ("" if none); later system messages stay in `messages`."""

    system: str
    tools: tuple[ToolSpec, ...]
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class ToolChoice:
    """What a request allows of tool calls, in every protocol's terms: ``auto`` (the model decides),
    ``none`` (the answer is text: tool-call markup the model writes comes back as text, as vLLM answers
    it), ``required`` (a tool call, of a tool the model picks: Anthropic's ``any``) or ``tool`` (a call of
    the tool `name`). The proxy forces a call by writing its opening, in the model's own tool-call
    markup as its chat template writes it, after the generation prompt
    (`clawfast.proxy.render.ChatRenderer.tool_call_opening`): prompt tokens, never sampled, so the
    call's tokens stay the policy's own samples. `parallel` False (Anthropic's
    ``disable_parallel_tool_use``, OpenAI's ``parallel_tool_calls: false``): an answer holds at most one
    call (`clawfast.proxy.parsers.parse_answer`)."""

    mode: str = "auto"  # "auto" | "none" | "required" | "tool"
    name: str | None = None  # the tool, for mode "tool"
    parallel: bool = True


@dataclass
class Request:
    """One model call as a protocol front understood it."""

    protocol: str  # "anthropic" | "chat" | "responses"
    conversation: Conversation
    model: str
    stream: bool
    max_tokens: int | None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()  # stop sequences (`clawfast.proxy.stops`)
    tool_choice: ToolChoice = ToolChoice()
    # The start of the answer, written by the caller (Anthropic's prefill: a final assistant message):
    # the model continues it, and the reply holds what follows it.
    prefill: str = ""
    # The reply lists each sampled token with its log-prob (Chat Completions ``logprobs``).
    logprobs: bool = False
    facts: dict[str, Any] = field(default_factory=dict)  # what the front's reply needs of the request


@dataclass
class Turn:
    """The parsed model output: visible text, reasoning, tool calls (with fresh ids)."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    parse_error: str | None = None
    stop_sequence: str | None = None  # the request's stop sequence the answer ended at, if it did
    # Calls the model wrote past the first where the request allows one, in markup that holds every
    # call in one JSON value (which cannot be cut after the first): dropped from the answer.
    dropped_tool_calls: int = 0

    def as_message(self) -> Message:
        return Message("assistant", self.content, tuple(self.tool_calls), reasoning=self.reasoning)

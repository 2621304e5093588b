"""Tool-call and reasoning parsers: model output text -> `Turn`, parsed once per call.

Families:
- ``qwen3`` (also Hermes / Qwen2.5): ``<think>...</think>`` reasoning, then text and
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+ tokenizers).
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (or a list of them);
  anything else is text.

Guaranteed: a parser never raises on model output. Markup that is malformed (bad JSON, a missing
name, an unterminated block) yields the whole output (minus reasoning) as plain text and a
`parse_error` saying what was wrong; the proxy records it and answers normally. So does a call that
parses but that no reply could carry: every front writes its replies with orjson, which refuses some
JSON that `json.loads` accepts (integers beyond 64 bits, lone surrogates such as ``"\\ud83d"``, nesting
past 254 levels); every tool call a parser returns can be written back. Tool-call ids are minted by
the caller's `new_id` so each protocol gets its own id style.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import orjson

from clawfast.proxy.canonical import ToolCall, ToolChoice, Turn, canonical_arguments

NewId = Callable[[], str]
Parser = Callable[[str, str, NewId], Turn]

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# Containers a reply wraps a call's arguments in (an Anthropic message holds them 3 deep), with room to
# spare: orjson refuses nesting past 254 levels in the whole reply, not in the arguments alone.
_REPLY_LEVELS = 8


class _Malformed(ValueError):
    pass


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest). Handles a template that opened ``<think>`` in the prompt (output holds only
    the closing tag)."""
    stripped = text.lstrip()
    if stripped.startswith(_THINK_OPEN):
        body = stripped[len(_THINK_OPEN) :]
        end = body.find(_THINK_CLOSE)
        if end < 0:  # unterminated: all of it was thinking (typically finish_reason length)
            return body.strip(), ""
        return body[:end].strip(), body[end + len(_THINK_CLOSE) :]
    end = text.find(_THINK_CLOSE)
    if end >= 0 and _THINK_OPEN not in text[:end]:
        return text[:end].strip(), text[end + len(_THINK_CLOSE) :]
    return "", text


# Where a call object holds its arguments: each family's templates show one key, and models trained
# on several write either.
_ARGUMENT_KEYS = ("arguments", "parameters")


def _call_from_obj(obj: object, new_id: NewId) -> ToolCall:
    if not isinstance(obj, dict):
        raise _Malformed(f"tool call is a JSON {type(obj).__name__}, not an object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _Malformed("tool call without a string name")
    keys = [key for key in _ARGUMENT_KEYS if key in obj]
    if len(keys) > 1:
        raise _Malformed(f"call of {name!r} has both 'arguments' and 'parameters'")
    if not keys and set(obj) != {"name"}:  # its arguments under some other key: never run it without them
        raise _Malformed(f"call of {name!r} has no 'arguments' (keys: {sorted(obj)[:8]})")
    args = obj[keys[0]] if keys else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise _Malformed(f"arguments of {name!r} are a string that is not JSON") from None
    if not isinstance(args, dict):
        raise _Malformed(f"arguments of {name!r} are not a JSON object")
    _check_writable(name, args)
    return ToolCall(new_id(), name, canonical_arguments(args))


def _check_writable(name: str, args: dict) -> None:
    """Raise _Malformed unless orjson, which writes every reply, can write this call's name and
    arguments where a reply puts them."""
    value: object = [name, args]
    for _ in range(_REPLY_LEVELS):
        value = [value]
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise _Malformed(f"tool call {name!r} cannot be written back as JSON: {exc}") from None


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _Malformed(f"tool call JSON does not parse: {exc}") from None


def _finish(content: str, reasoning: str, calls: list[ToolCall], finish_reason: str) -> Turn:
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return Turn(content.strip(), reasoning, calls, finish_reason)


def parse_qwen3(text: str, finish_reason: str, new_id: NewId) -> Turn:
    reasoning, rest = _split_reasoning(text)
    try:
        calls = [_call_from_obj(_loads(m.group(1).strip()), new_id) for m in _TOOL_BLOCK.finditer(rest)]
        leftover = _TOOL_BLOCK.sub("", rest)
        if "<tool_call>" in leftover or "</tool_call>" in leftover:
            raise _Malformed("unterminated <tool_call> block")
    except _Malformed as exc:
        return Turn(rest.strip(), reasoning, [], finish_reason, parse_error=str(exc))
    return _finish(leftover, reasoning, calls, finish_reason)


def parse_mistral(text: str, finish_reason: str, new_id: NewId) -> Turn:
    reasoning, rest = _split_reasoning(text)
    marker = rest.find("[TOOL_CALLS]")
    if marker < 0:
        return _finish(rest, reasoning, [], finish_reason)
    content, tail = rest[:marker], rest[marker + len("[TOOL_CALLS]") :]
    try:
        if "[ARGS]" in tail:  # v11+: name[ARGS]{json} repeated, each after [TOOL_CALLS]
            calls = []
            for piece in tail.split("[TOOL_CALLS]"):
                name, sep, args = piece.partition("[ARGS]")
                if not sep:
                    raise _Malformed("[TOOL_CALLS] without [ARGS]")
                calls.append(_call_from_obj({"name": name.strip(), "arguments": _loads(args.strip())}, new_id))
        else:
            value = _loads(tail.strip())
            calls = [_call_from_obj(obj, new_id) for obj in (value if isinstance(value, list) else [value])]
    except _Malformed as exc:
        return Turn(rest.strip(), reasoning, [], finish_reason, parse_error=str(exc))
    return _finish(content, reasoning, calls, finish_reason)


def parse_llama3_json(text: str, finish_reason: str, new_id: NewId) -> Turn:
    reasoning, rest = _split_reasoning(text)
    body = rest.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith(("{", "[")):
        return _finish(rest, reasoning, [], finish_reason)
    try:
        value = _loads(body)
        objs = value if isinstance(value, list) else [value]
        if not all(isinstance(o, dict) and ("parameters" in o or "arguments" in o) for o in objs):
            return _finish(rest, reasoning, [], finish_reason)  # JSON the model answered with, not calls (as vLLM)
        calls = [_call_from_obj(obj, new_id) for obj in objs]
    except _Malformed as exc:
        return Turn(body, reasoning, [], finish_reason, parse_error=str(exc))
    return _finish("", reasoning, calls, finish_reason)


def parse_text(text: str, finish_reason: str, new_id: NewId) -> Turn:
    """An answer to a request that allows no tool call (tool_choice ``none``): reasoning apart, all of
    it is text, tool-call markup included."""
    reasoning, rest = _split_reasoning(text)
    return _finish(rest, reasoning, [], finish_reason)


def opens_reasoning(generation_prompt: str) -> bool:
    """Whether a template's generation prompt leaves a think block open (Qwen3's thinking-only
    models, DeepSeek-R1's distills): every answer then starts inside its reasoning."""
    return generation_prompt.rfind(_THINK_OPEN) > generation_prompt.rfind(_THINK_CLOSE)


def _reading(text: str, reasoning_open: bool) -> str:
    # An answer that starts inside a think block the prompt opened reads as one that opens it itself:
    # without its closing tag (cut by length or a stop sequence), all of it is reasoning.
    return _THINK_OPEN + text if reasoning_open else text


def parse_answer(parse: Parser, text: str, finish_reason: str, new_id: NewId, choice: ToolChoice,
                 reasoning_open: bool = False) -> Turn:
    """`text` parsed as the answer to a request that allows `choice`: all of it text where no call is
    allowed (``none``); at most one call where one at a time is (`ToolChoice.parallel` False). The proxy
    cuts such an answer after its first call before it is parsed (`first_call_end`); what is left past
    one call here is markup holding every call in one JSON value, and those calls are dropped, as vLLM
    drops them (`Turn.dropped_tool_calls`). `reasoning_open`: the generation prompt opened a think
    block (`opens_reasoning`)."""
    text = _reading(text, reasoning_open)
    if choice.mode == "none":
        return parse_text(text, finish_reason, new_id)
    turn = parse(text, finish_reason, new_id)
    if not choice.parallel and len(turn.tool_calls) > 1:
        turn.dropped_tool_calls = len(turn.tool_calls) - 1
        del turn.tool_calls[1:]
    return turn


def _answer_start(text: str) -> int:
    """Where the answer past the reasoning begins in `text` (`_split_reasoning`'s rest is a suffix)."""
    return len(text) - len(_split_reasoning(text)[1])


def _first_block_end(text: str) -> int | None:
    block = _TOOL_BLOCK.search(text, _answer_start(text))
    if block is None or "<tool_call>" not in text[block.end():]:
        return None
    return block.end()


def _first_mistral_call_end(text: str) -> int | None:
    first = text.find("[TOOL_CALLS]", _answer_start(text))
    if first < 0:
        return None
    second = text.find("[TOOL_CALLS]", first + len("[TOOL_CALLS]"))
    if second < 0 or "[ARGS]" not in text[first:second]:  # v3 markup: the calls are one JSON array
        return None
    return second


_FIRST_CALL_ENDS: dict[str, Callable[[str], int | None]] = {
    "qwen3": _first_block_end,
    "hermes": _first_block_end,
    "mistral": _first_mistral_call_end,
}


def first_call_end(family: str, text: str, reasoning_open: bool = False) -> int | None:
    """Where the first tool call's markup ends in model output `text`, if another call starts after it
    and the family's markup lets calls be cut apart (each in its own block: Hermes/Qwen
    ``<tool_call>`` blocks, Mistral v11 ``[TOOL_CALLS]name[ARGS]``); None otherwise (one call, or every
    call in one JSON value: Mistral v3, Llama 3). `reasoning_open` as for `parse_answer`."""
    find = _FIRST_CALL_ENDS.get(family)
    end = None if find is None else find(_reading(text, reasoning_open))
    return None if end is None else end - (len(_THINK_OPEN) if reasoning_open else 0)


PARSERS: dict[str, Parser] = {
    "qwen3": parse_qwen3,
    "hermes": parse_qwen3,
    "mistral": parse_mistral,
    "llama3_json": parse_llama3_json,
}


def get_parser(name: str) -> Parser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {sorted(PARSERS)}") from None


def detect_parser(vocab: dict[str, int]) -> str:
    """Pick the family from the tokenizer's special tokens."""
    if "<tool_call>" in vocab:
        return "qwen3"
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<|python_tag|>" in vocab:
        return "llama3_json"
    return "qwen3"

"""A rollout's transcript, rebuilt from its recorded calls, in the event format PinchBench graders read
(``def grade(transcript: list, workspace_path: str) -> dict``):

    [{"type": "message", "message": {"role": "user" | "assistant" | "toolResult", "content": [...]}}, ...]

Assistant content items are ``{"type": "text", "text": ...}`` and ``{"type": "toolCall", "id": ...,
"name": ..., "arguments": {...}}``; a toolResult message holds one ``{"type": "text", "text": ...}``
item (and ``toolCallId`` / ``toolName`` when which call it answers is known, below).

The rule, derived from the token structure alone (no per-harness or per-template cases):

- Calls: the rollout's *main* thread (`clawfast.threads.reconstruct`), in call-index order; side
  calls (titles, summaries, compactions, subagents, probes) are left out.
- Each main call's answer is decoded, cut before the stop sequence it ended at (its record's
  ``metadata["stop_sequence"]``: what the harness was sent), and parsed with the parser the proxy
  answered the harness with:
  one assistant event, a text item when the visible text is non-empty, then one toolCall item per tool
  call in order. Ids are deterministic, ``call_<call_index>_<k>``; arguments are the parsed JSON object,
  ``{}`` when the model's arguments are not one (`clawfast.proxy.canonical.arguments_object`).
  Reasoning is left out. A turn with neither text nor tool calls is still an event (empty content),
  so there is one assistant event per main call.
- What the harness added between two consecutive main calls (the tokens of the later prompt past
  what it shares with the earlier call's prompt + answer) is read message by message where the chat
  template frames each message of a role alike (`ChatRenderer.added_messages`: the answer's closing
  text, then each tool or user message in its role's frame, then the generation prompt): one
  ``toolResult`` event per tool message and one ``user`` event per user message, holding exactly the
  harness's text, and each result gets the id and name of its call when there are as many results as
  calls (harnesses answer calls in the order made). Otherwise (a template that frames a message by its
  neighbours, such as one that groups consecutive tool results in one turn; an edited history) the
  added tokens are decoded skipping special tokens, stripped, and become ONE event: ``toolResult``
  if the previous assistant event made tool calls (with its call's id when it made one), else
  ``user``; empty text makes no event.
- The first main call's prompt (system prompt, tool specs, the task) is not decoded: the caller
  prepends the task instruction as the first user event itself.
- No main calls: ``[]``.

Limits: on the one-event path, several tool results (or a tool result and a user message) become
one event, and the text keeps what the chat template wrote around them as plain text (e.g. a role
name such as ``user``, the generation prompt's ``assistant``) and loses special-token markup; after a
history edit, a compaction restart or a
re-rendered turn, the added event holds all of the later prompt past the token where it departs,
which repeats earlier messages.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence

import numpy as np

from clawfast.proxy.canonical import ToolChoice, arguments_object
from clawfast.proxy.parsers import Parser, get_parser, parse_answer
from clawfast.proxy.stops import before_stop
from clawfast.records import CallRecord
from clawfast.threads import reconstruct, shared_with_path

TRANSCRIPT_PATH = "/clawfast/transcript"

Decode = Callable[[Sequence[int]], str]
Continuation = Callable[[Sequence[int], Sequence[int]], str]  # (prefill ids, output ids) -> the answer's text
Added = Callable[[np.ndarray, np.ndarray], "list[tuple[str, str]] | None"]


def _message(role: str, content: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"type": "message", "message": {"role": role, "content": content, **extra}}


def transcript_events(
    calls: Sequence[CallRecord],
    decode: Decode,
    parse: Parser,
    *,
    decode_answer: Continuation | None = None,
    added: Added | None = None,
    reasoning_open: bool = False,
) -> list[dict]:
    """The rollout's transcript events (see the module docstring for the rule).

    decode(ids): text with special tokens skipped (for what the harness added). parse(text,
    finish_reason, new_id): the proxy's parser (`clawfast.proxy.parsers`); the events' call ids are
    their own. decode_answer(prefill_ids, output_ids): the answer's text past its prefill as the
    proxy parsed it (`ChatRenderer.continuation_text`); default `decode` of the output. Pass it when
    the tool-call markup is made of special tokens (Mistral's ``[TOOL_CALLS]``, tokenizers that mark
    ``<tool_call>`` special): skipping them would hide the tool calls from the parser. added(ids, previous_output_ids): the (role, content) messages
    the harness added, when the template's framing shows them (`ChatRenderer.added_messages`), else
    None. reasoning_open: the generation prompt opens a think block (`parsers.opens_reasoning`).
    `core_transcript` passes the proxy's own."""
    decode_answer = decode_answer or (lambda prefill_ids, output_ids: decode(output_ids))
    ordered = sorted(calls, key=lambda c: c.call_index)
    if not ordered:
        return []
    kinds = reconstruct(ordered).kind_of()
    events: list[dict] = []
    prev: CallRecord | None = None
    prev_calls: list[dict] = []  # the toolCall items of the previous assistant event
    for call in ordered:
        if kinds[call.call_index] != "main":
            continue
        # What the harness added ends at the generation prompt: a prefill after it is the answer's.
        end = len(call.prompt_ids) - call.metadata.get("prefill_tokens", 0)
        if prev is not None:
            shared = shared_with_path(call.prompt_ids, prev.prompt_ids, prev.output_ids)
            events += _added_events(call.prompt_ids[shared:end], prev.output_ids, prev_calls, decode, added)
        stop = call.metadata.get("stop_sequence")  # the harness saw the answer up to it
        text, _ = before_stop(decode_answer(call.prompt_ids[end:], call.output_ids), (stop,) if stop else ())
        # The prefill (the request's, or a forced call's opening) starts the answer, read under what the
        # request allowed of tool calls (its mode; a named tool's name does not change what is read).
        text = call.metadata.get("prefill", "") + text
        choice = ToolChoice(call.metadata.get("tool_choice", "auto"),
                            parallel=call.metadata.get("parallel_tool_calls", True))
        turn = parse_answer(parse, text, call.finish_reason, lambda: "", choice, reasoning_open)
        content: list[dict[str, Any]] = [{"type": "text", "text": turn.content}] if turn.content else []
        prev_calls = [
            {"type": "toolCall", "id": f"call_{call.call_index}_{k}", "name": tc.name,
             "arguments": arguments_object(tc.arguments)}
            for k, tc in enumerate(turn.tool_calls)
        ]
        events.append(_message("assistant", content + prev_calls))
        prev = call
    return events


def _added_events(ids: np.ndarray, previous_output: np.ndarray, previous_calls: list[dict], decode: Decode,
                  added: Added | None) -> list[dict]:
    """The events of what the harness added between two main calls (see the module docstring)."""
    messages = added(ids, previous_output) if added is not None else None
    if messages is None:  # not framed message by message: the text whole, as one event
        text = decode(ids).strip()
        messages = [("tool" if previous_calls else "user", text)] if text else []
        # One call: the one result can only be its own; with several, which part answers which is unknown.
        known = len(previous_calls) == 1
    else:
        # One framed result per call: harnesses answer the calls in the order they were made.
        known = sum(role == "tool" for role, _ in messages) == len(previous_calls)
    events, answered = [], iter(previous_calls)
    for role, text in messages:
        item = [{"type": "text", "text": text}]
        if role != "tool":
            events.append(_message("user", item))
        elif known:
            call = next(answered)
            events.append(_message("toolResult", item, toolCallId=call["id"], toolName=call["name"]))
        else:
            events.append(_message("toolResult", item))
    return events


def core_transcript(core: Any, calls: Sequence[CallRecord]) -> list[dict]:
    """`transcript_events` with a `ProxyCore`'s tokenizer and parser, decoding answers as
    `ProxyCore.parse` does (`ChatRenderer.continuation_text`). CPU work that grows with
    the rollout: the server runs it off its event loop."""
    renderer, parser = core.renderer, get_parser(core.parser_name)
    return transcript_events(
        calls,
        lambda ids: renderer.decode(ids, skip_special_tokens=True),
        parser,
        decode_answer=renderer.continuation_text,
        added=renderer.added_messages,
        reasoning_open=core.reasoning_open,
    )


def fetch_transcript(base_url: str, key: str, *, timeout: float = 30.0) -> list[dict]:
    """The events of the open rollout that `key` belongs to, from the proxy at `base_url` (its HTTP
    root, no ``/v1``: `OpenedRollout.base_url`). RuntimeError with the status and body if the proxy
    does not answer 200 (401: an unknown or closed rollout key)."""
    url = base_url.rstrip("/") + TRANSCRIPT_PATH
    request = urllib.request.Request(url, headers={"x-api-key": key}, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}: {body.decode('utf-8', 'replace')}")
    return json.loads(body)["events"]

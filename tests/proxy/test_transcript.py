"""The rollout transcript in PinchBench's event format (`clawfast.proxy.transcript`): through the live
proxy with the openai SDK and the embedded model's tokenizer and template, and `transcript_events` on
token-built records where a side call must be left out."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from clawfast.proxy.canonical import ToolCall, Turn
from clawfast.proxy.transcript import fetch_transcript, transcript_events
from clawfast.records import CallRecord
from clawfast.threads import reconstruct

EXEC_ARGS = {"command": "printf hi > a.txt"}
EXEC_TOOL = {
    "type": "function",
    "function": {"name": "exec", "description": "Run a shell command",
                 "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
}


def test_transcript_of_a_tool_using_rollout(proxy):
    proxy.engine.push({"tool_calls": [{"name": "exec", "arguments": EXEC_ARGS}]}, {"text": "All done."})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Write hi to a.txt."}]
    msg = client.chat.completions.create(model="policy", messages=messages, tools=[EXEC_TOOL]).choices[0].message
    (call,) = msg.tool_calls
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "done: wrote a.txt"})
    final = client.chat.completions.create(model="policy", messages=messages, tools=[EXEC_TOOL]).choices[0].message
    assert final.content == "All done."

    events = fetch_transcript(proxy.url, proxy.key)
    assert all(e["type"] == "message" for e in events)
    assert [e["message"]["role"] for e in events] == ["assistant", "toolResult", "assistant"]
    first, result, last = (e["message"] for e in events)
    assert first["content"] == [{"type": "toolCall", "id": "call_0_0", "name": "exec", "arguments": EXEC_ARGS}]
    (item,) = result["content"]
    # The template frames one tool message alike wherever it stands: the result is the harness's text.
    assert item == {"type": "text", "text": "done: wrote a.txt"}
    assert (result["toolCallId"], result["toolName"]) == ("call_0_0", "exec")
    assert last["content"] == [{"type": "text", "text": "All done."}]


def test_a_rollout_with_no_calls_has_an_empty_transcript(proxy):
    assert fetch_transcript(proxy.url, proxy.key) == []
    other = proxy.registry.open("r1", harness="test")
    assert fetch_transcript(proxy.url.rstrip("/") + "/", other.key) == []


def test_unknown_and_closed_keys_are_401(proxy):
    with pytest.raises(RuntimeError, match=r"/clawfast/transcript: HTTP 401: .*unknown or closed rollout key"):
        fetch_transcript(proxy.url, "nope")
    with pytest.raises(RuntimeError, match="HTTP 401"):
        fetch_transcript(proxy.url, "")
    proxy.registry.close(proxy.rollout_id)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        fetch_transcript(proxy.url, proxy.key)


# -- transcript_events on token-built records ------------------------------------------------------

START, END, SYSTEM, USER, ASSISTANT, TOOL, CALL = 1, 2, 3, 4, 5, 6, 7  # CALL: a tool-call markup token
GEN = [START, ASSISTANT]
SPECIAL = {START, END, SYSTEM, USER, ASSISTANT, TOOL, CALL}


def decode(ids) -> str:
    """Skips special tokens, as the proxy decodes what the harness added."""
    return " ".join(f"w{int(i)}" for i in ids if int(i) not in SPECIAL)


def decode_answer(prefill_ids, ids) -> str:
    """Keeps the tool-call markup, as the proxy decodes an answer for its parser (no prefills here)."""
    return " ".join("<call>" if int(i) == CALL else f"w{int(i)}" for i in ids if int(i) not in SPECIAL - {CALL})


def parse(text: str, finish_reason: str, new_id) -> Turn:
    if text.startswith("<call>"):
        command = text.removeprefix("<call>").strip()
        return Turn("", "", [ToolCall("minted-by-parser", "exec", json.dumps({"command": command}))], "tool_calls")
    return Turn(text, "", [], finish_reason)


class Session:
    """Calls of one rollout in a ChatML-like token shape (as tests/test_threads.py builds them)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.calls: list[CallRecord] = []

    def text(self, n: int) -> list[int]:
        return self.rng.integers(10, 5000, n).tolist()

    @staticmethod
    def msg(role: int, content: list[int]) -> list[int]:
        return [START, role, *content, END]

    def ask(self, history: list[int], answer: list[int]) -> list[int]:
        answer = answer + [END]
        self.calls.append(CallRecord("r", len(self.calls), "h", np.array(history + GEN), np.array(answer),
                                     -np.ones(len(answer))))
        return GEN + answer


def test_side_calls_are_left_out():
    s = Session(3)
    head = s.msg(SYSTEM, s.text(300)) + s.msg(USER, s.text(30))
    command, title_request, title = s.text(20), s.text(12), s.text(8)
    first = s.ask(head, [CALL, *command])
    s.ask(head + s.msg(USER, title_request), title)  # same system prompt and task, then asks for a title
    tool_output = s.text(20)
    history = head + first + s.msg(TOOL, tool_output)
    answer = s.text(20)
    history = history + s.ask(history, answer)
    follow_up = s.text(15)
    last = s.text(25)
    s.ask(history + s.msg(USER, follow_up), last)
    assert [t.kind for t in reconstruct(s.calls).calls] == ["main", "title", "main", "main"]

    events = transcript_events(s.calls[::-1], decode, parse, decode_answer=decode_answer)  # any order in
    messages = [e["message"] for e in events]
    assert [m["role"] for m in messages] == ["assistant", "toolResult", "assistant", "user", "assistant"]
    assert messages[0]["content"] == [{"type": "toolCall", "id": "call_0_0", "name": "exec",
                                       "arguments": {"command": decode(command)}}]
    assert messages[1] == {"role": "toolResult", "content": [{"type": "text", "text": decode(tool_output)}],
                           "toolCallId": "call_0_0", "toolName": "exec"}
    assert messages[2]["content"] == [{"type": "text", "text": decode(answer)}]
    assert messages[3]["content"] == [{"type": "text", "text": decode(follow_up)}]
    assert messages[4]["content"] == [{"type": "text", "text": decode(last)}]
    dumped = json.dumps(events)
    assert decode(title) not in dumped and decode(title_request) not in dumped


def test_an_empty_addition_makes_no_event_and_text_after_a_text_answer_is_a_user_event():
    s = Session(4)
    head = s.msg(SYSTEM, s.text(100)) + s.msg(USER, s.text(20))
    first = s.ask(head, [CALL, *s.text(10)])
    second = s.ask(head + first, s.text(12))  # the harness added only the generation prompt: no event
    note = s.text(8)
    s.ask(head + first + second + s.msg(TOOL, note), s.text(10))
    assert [t.kind for t in reconstruct(s.calls).calls] == ["main"] * 3
    messages = [e["message"] for e in transcript_events(s.calls, decode, parse, decode_answer=decode_answer)]
    # The second answer made no tool call: what follows it is a user event, whatever role it came in.
    assert [m["role"] for m in messages] == ["assistant", "assistant", "user", "assistant"]
    assert messages[2]["content"] == [{"type": "text", "text": decode(note)}]
    assert transcript_events([], decode, parse) == []


def test_several_results_are_one_event_without_a_call_id():
    def two_calls(text: str, finish_reason: str, new_id) -> Turn:
        if not text.startswith("<call>"):
            return parse(text, finish_reason, new_id)
        return Turn("", "", [ToolCall("a", "exec", "{}"), ToolCall("b", "read", "{}")], "tool_calls")

    s = Session(5)
    head = s.msg(SYSTEM, s.text(100)) + s.msg(USER, s.text(20))
    first = s.ask(head, [CALL, *s.text(10)])
    results = s.text(8), s.text(9)
    s.ask(head + first + s.msg(TOOL, results[0]) + s.msg(TOOL, results[1]), s.text(10))
    messages = [e["message"] for e in transcript_events(s.calls, decode, two_calls, decode_answer=decode_answer)]
    assert [m["role"] for m in messages] == ["assistant", "toolResult", "assistant"]
    assert [c["id"] for c in messages[0]["content"]] == ["call_0_0", "call_0_1"]
    # Which text answers which call is not known, so the event names no call.
    assert messages[1] == {"role": "toolResult", "content": [{"type": "text", "text": decode(results[0] + results[1])}]}


def test_arguments_that_are_not_an_object_are_kept_as_empty():
    record = CallRecord("r", 0, "h", np.array([START, USER, 11, END, *GEN]), np.array([CALL, 12, END]), -np.ones(3))

    def bad_arguments(text: str, finish_reason: str, new_id) -> Turn:
        return Turn("", "", [ToolCall("x", "exec", "[1, 2]"), ToolCall("y", "read", "not json")], "tool_calls")

    (event,) = transcript_events([record], decode, bad_arguments)
    assert event["message"]["content"] == [
        {"type": "toolCall", "id": "call_0_0", "name": "exec", "arguments": {}},
        {"type": "toolCall", "id": "call_0_1", "name": "read", "arguments": {}},
    ]


def test_two_tool_results_in_one_turn(proxy):
    """Two calls answered at once, on a template that frames each tool message alike (the embedded
    model's): two result events holding exactly the harness's texts, with their calls' ids in order.
    (Templates that group consecutive results take the one-event path, tested on records below.)"""
    proxy.engine.push({"tool_calls": [{"name": "exec", "arguments": EXEC_ARGS},
                                      {"name": "exec", "arguments": {"command": "ls"}}]}, {"text": "Both ran."})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    messages = [{"role": "user", "content": "Write hi to a.txt and list the folder."}]
    msg = client.chat.completions.create(model="policy", messages=messages, tools=[EXEC_TOOL]).choices[0].message
    first, second = msg.tool_calls
    messages.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]})
    messages += [{"role": "tool", "tool_call_id": first.id, "content": "wrote a.txt"},
                 {"role": "tool", "tool_call_id": second.id, "content": "a.txt\n"}]
    client.chat.completions.create(model="policy", messages=messages, tools=[EXEC_TOOL])

    events = [e["message"] for e in fetch_transcript(proxy.url, proxy.key)]
    assert [e["role"] for e in events] == ["assistant", "toolResult", "toolResult", "assistant"]
    assert [(r["content"], r["toolCallId"], r["toolName"]) for r in events[1:3]] == [
        ([{"type": "text", "text": "wrote a.txt"}], "call_0_0", "exec"),
        ([{"type": "text", "text": "a.txt\n"}], "call_0_1", "exec")]

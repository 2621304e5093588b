"""Call tags from the signals HARNESSES.md lists, end to end through the proxy where it matters."""

from __future__ import annotations

import anthropic

from clawfast.proxy.canonical import Conversation, Message, ToolSpec
from clawfast.proxy.tagging import classify
from clawfast.threads import reconstruct

TOOLS = tuple(ToolSpec(n) for n in ("Bash", "Read", "Write", "Agent"))


def conv(user: str, system: str = "You are Claude Code.", tools=TOOLS) -> Conversation:
    return Conversation(system, tools, (Message("user", user),))


def test_signals():
    main = frozenset(t.name for t in TOOLS)
    assert classify(conv("quota"), {}, 1, None).tag == "quota"
    assert classify(conv("Your task is to create a detailed summary of the conversation so far..."), {}, 4000, main).tag == "compaction"
    assert classify(conv("x", system="You are performing a CONTEXT CHECKPOINT COMPACTION."), {}, 100, main).tag == "compaction"
    sub = classify(conv("find it"), {"x-claude-code-parent-agent-id": "p1", "x-claude-code-agent-id": "a7"}, 100, main)
    assert (sub.tag, sub.thread) == ("subagent", "subagent:a7")
    assert classify(conv("find it", system="You are a search agent.", tools=TOOLS[:2]), {}, 100, main).tag == "subagent"
    assert classify(conv("hi", system="Generate a short title for this conversation.", tools=()), {}, 50, main).tag == "title"
    assert classify(conv("fix the bug"), {}, 100, main).tag == "main"
    assert classify(conv("fix the bug"), {}, 100, None).tag == "main"


def test_tags_and_threads_in_records(proxy):
    client = anthropic.Anthropic(base_url=proxy.url, api_key=proxy.key, max_retries=0)
    tools = [{"name": t.name, "input_schema": {"type": "object"}} for t in TOOLS]
    proxy.engine.push("ok", "x", "Title", "sub")
    client.messages.create(model="p", max_tokens=50, system="main prompt", tools=tools, messages=[{"role": "user", "content": "task"}])
    client.messages.create(model="p", max_tokens=1, system="main prompt", tools=tools, messages=[{"role": "user", "content": "quota"}])
    client.messages.create(model="p", max_tokens=50, system="Write a 3-word title for the topic.", messages=[{"role": "user", "content": "task"}])
    client.messages.create(
        model="p", max_tokens=50, system="sub prompt", tools=tools[:1], messages=[{"role": "user", "content": "look"}],
        extra_headers={"X-Claude-Code-Agent-Id": "a1", "X-Claude-Code-Parent-Agent-Id": "main"},
    )
    calls = proxy.calls()
    assert [c.tags for c in calls] == [("main",), ("quota",), ("title",), ("subagent",)]
    assert calls[3].metadata["headers"]["x-claude-code-agent-id"] == "a1"
    assert reconstruct(calls).drift == 0  # side calls do not count as drift of the main thread

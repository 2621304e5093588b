"""Tag each call main / subagent / compaction / title / quota from what the request shows.

Signals (docs/HARNESSES.md): Claude Code's quota probe (``max_tokens: 1``, user text "quota"); its
compaction prompt ("Your task is to create a detailed summary of the conversation so far") and Codex's
("CONTEXT CHECKPOINT COMPACTION"); title / topic side calls (no tools, a short prompt asking for a
title or topic); subagents (``X-Claude-Code-Parent-Agent-Id`` header, or a different system prompt
with a strict subset of the main thread's tools).

Guaranteed: every call gets exactly one tag from `clawfast.records.TAGS` and a `reason` saying which
signal fired. Not guaranteed: that heuristics never misfire on a harness version we have not seen;
the reason is recorded so a wrong tag can be found and fixed.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from clawfast.proxy.canonical import Conversation

_COMPACTION = (
    "Your task is to create a detailed summary of the conversation so far",
    "CONTEXT CHECKPOINT COMPACTION",
)
_TITLE = re.compile(r"\b(title|topic|recap)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Tagging:
    tag: str
    thread: str  # calls of one thread continue one conversation (used for prefix drift)
    reason: str


def _last_user_text(conv: Conversation) -> str:
    for message in reversed(conv.messages):
        if message.role == "user":
            return message.content
    return ""


def classify(conv: Conversation, headers: dict[str, str], max_tokens: int | None, main_tools: frozenset | None) -> Tagging:
    """`headers` lower-cased; `main_tools` the tool names of the rollout's main thread so far."""
    last_user = _last_user_text(conv)
    if max_tokens == 1 and last_user.strip().lower() == "quota":
        return Tagging("quota", "quota", "max_tokens 1 and user text 'quota'")
    if any(marker in last_user or marker in conv.system for marker in _COMPACTION):
        return Tagging("compaction", "compaction", "compaction prompt")
    parent = headers.get("x-claude-code-parent-agent-id")
    agent = headers.get("x-claude-code-agent-id")
    if parent:
        return Tagging("subagent", f"subagent:{agent or parent}", "x-claude-code-parent-agent-id header")
    # Title/topic side calls are one-shot (a single user turn) with no tools, and say so up front. A
    # tool-less main thread (mini-swe-agent's text-based config) grows past one user turn at once.
    if not conv.tools and len(conv.messages) <= 2 and (_TITLE.search(conv.system[:300]) or _TITLE.search(last_user[:300])):
        return Tagging("title", "title", "one-shot, no tools, a title/topic/recap prompt")
    tools = frozenset(t.name for t in conv.tools)
    if main_tools and tools and tools < main_tools:
        return Tagging("subagent", f"subagent:{zlib.crc32(','.join(sorted(tools)).encode()):08x}", "strict subset of the main thread's tools")
    return Tagging("main", "main", "default")

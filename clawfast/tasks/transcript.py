"""A run's transcript in the event format PinchBench graders read (OpenClaw's session log):

    {"type": "message", "message": {"role": "user" | "assistant" | "toolResult", "content": [...]}}

Assistant content items are ``{"type": "text", "text": ...}`` or ``{"type": "toolCall", "id": ...,
"name": ..., "arguments": {...}}``; user and toolResult content is text items. Events of other
types may appear (OpenClaw's own log has session headers); graders skip them.

Where a rollout's transcript comes from (`clawfast.rollout.worker`): the harness's own session log
when its adapter reads one (`Harness.transcript`: OpenClaw), else the proxy's reconstruction from the
rollout's recorded main thread (`proxy.transcript`), behind the task's instruction as the first user
event. The graders (`GradeFunctionVerifier`), ClawGym's reward payload and the judge's prompt
(`clawfast.tasks.judge`) all read the same list.
"""

from __future__ import annotations

import json
from typing import Any

# Characters of one tool result a judge's summary keeps: enough to see what a command returned.
RESULT_PREVIEW_CHARS = 400


def text_event(role: str, text: str) -> dict[str, Any]:
    """A message event holding one text item."""
    return {"type": "message", "message": {"role": role, "content": [{"type": "text", "text": text}]}}


def with_instruction(instruction: str, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` behind the task's instruction as the first user event, unless they begin with a user
    event already (a harness's own log records the prompt it was given)."""
    messages = [e for e in events if e.get("type") == "message"]
    if messages and messages[0].get("message", {}).get("role") == "user":
        return events
    return [text_event("user", instruction), *events]


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    return [item["text"] for item in content
            if isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str)]


def summarize(transcript: list[dict[str, Any]]) -> str:
    """The transcript as lines a judge reads: what the user asked, the assistant's text and tool
    calls (with their arguments), and the start of each tool result. What is not of the events'
    shape (a harness's log may hold anything: it lives where the agent can write) is left out."""
    lines = []
    for event in transcript:
        if not isinstance(event, dict) or event.get("type") != "message" or not isinstance(event.get("message"), dict):
            continue
        message = event["message"]
        role, content = message.get("role"), message.get("content")
        if role == "user":
            lines += [f"User: {t}" for t in _texts(content)]
        elif role == "assistant":
            for item in content if isinstance(content, list) else []:
                if isinstance(item, dict) and item.get("type") == "toolCall":
                    arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False, default=str)
                    lines.append(f"Tool call: {item.get('name')}({arguments})")
            lines += [f"Assistant: {t}" for t in _texts(content) if t.strip()]
        elif role == "toolResult":
            text = "\n".join(_texts(content))
            more = f" ... ({len(text) - RESULT_PREVIEW_CHARS} more characters)" if len(text) > RESULT_PREVIEW_CHARS else ""
            lines.append(f"Tool result: {text[:RESULT_PREVIEW_CHARS]}{more}")
    return "\n".join(lines)

"""Adapters for real, unmodified agent harnesses (see `clawfast.harness.base` for the contract).

`get_harness(name, **options)` builds the adapter registered under `name`; `HARNESSES` lists them.
"""

from __future__ import annotations

from clawfast.harness.base import (
    Harness,
    HarnessInstall,
    PreparedRun,
    RunLayout,
    ScriptedToolCall,
    ScriptedTurn,
)
from clawfast.harness.claude_code import ClaudeCode
from clawfast.harness.codex import Codex
from clawfast.harness.mini_swe_agent import MiniSweAgent
from clawfast.harness.openclaw import OpenClaw

HARNESSES: dict[str, type[Harness]] = {cls.name: cls for cls in (ClaudeCode, OpenClaw, Codex, MiniSweAgent)}


def get_harness(name: str, **options) -> Harness:
    """The adapter for `name` (one of `HARNESSES`); options go to its constructor."""
    try:
        cls = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}") from None
    return cls(**options)


__all__ = [
    "HARNESSES",
    "Harness",
    "HarnessInstall",
    "PreparedRun",
    "RunLayout",
    "ScriptedToolCall",
    "ScriptedTurn",
    "get_harness",
]

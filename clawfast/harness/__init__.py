"""Adapters for real, unmodified agent harnesses (see `clawfast.harness.base` for the contract).

`get_harness(name, **options)` builds the adapter registered under `name`; `HARNESSES` lists them:
the four built in, and every harness an installed distribution declares under the entry-point
group ``clawfast.harnesses`` (``NAME = "package.module:Class"``, NAME the class's `name`), so a
harness of one's own trains, and `clawfast harness check`s, without a change here.
"""

from __future__ import annotations

from importlib.metadata import entry_points

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

ENTRY_POINT_GROUP = "clawfast.harnesses"


def _registered() -> dict[str, type[Harness]]:
    """The built-in adapters and those of the group's entry points. An entry point that does not load,
    is no `Harness` subclass, names another harness than its class does, or takes a name already
    registered is an error naming its distribution: a harness silently missing would show up only
    as "unknown harness" in the middle of a run's set-up."""
    found: dict[str, type[Harness]] = {cls.name: cls for cls in (ClaudeCode, OpenClaw, Codex, MiniSweAgent)}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} = {point.value!r} (group {ENTRY_POINT_GROUP!r}" + (
            f", distribution {point.dist.name} {point.dist.version})" if point.dist is not None else ")")
        try:
            cls = point.load()
        except Exception as exc:
            raise ImportError(f"{where} does not load: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Harness)):
            raise TypeError(f"{where} is {cls!r}, not a subclass of clawfast.harness.Harness")
        if getattr(cls, "name", None) != point.name:
            raise ValueError(f"{where}: the class's name is {getattr(cls, 'name', None)!r}; the entry point must be that name")
        if point.name in found and found[point.name] is not cls:
            raise ValueError(f"{where}: {point.name!r} is already the harness {found[point.name].__module__}."
                             f"{found[point.name].__qualname__}")
        found[point.name] = cls
    return found


HARNESSES: dict[str, type[Harness]] = _registered()


def get_harness(name: str, **options) -> Harness:
    """The adapter for `name` (one of `HARNESSES`); options go to its constructor."""
    try:
        cls = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}") from None
    return cls(**options)


__all__ = [
    "ENTRY_POINT_GROUP",
    "HARNESSES",
    "Harness",
    "HarnessInstall",
    "PreparedRun",
    "RunLayout",
    "ScriptedToolCall",
    "ScriptedTurn",
    "get_harness",
]

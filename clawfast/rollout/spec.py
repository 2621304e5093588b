"""What to run: one `RolloutSpec` per rollout (a task, a harness, a sample number)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from clawfast.tasks.task import Task

if TYPE_CHECKING:  # the harness layer is imported only when a name or options are checked
    from clawfast.harness import Harness


@dataclass(frozen=True)
class RolloutSpec:
    """One rollout to run: `task` by the harness named `harness`, sample number `sample_index`."""

    task: Task
    harness: str
    sample_index: int = 0

    @property
    def label(self) -> str:
        return f"{self.task.id}/{self.harness}/{self.sample_index}"


def harness_names() -> list[str]:
    """The names a spec's `harness` may take: `clawfast.harness.HARNESSES` (the built-in adapters and
    those installed packages declare), imported on the first call, so that what imports this module
    (the trainer's config) needs nothing of the harness layer until it checks a name."""
    from clawfast.harness import HARNESSES

    return sorted(HARNESSES)


def check_harness_options(name: str, options: Mapping[str, Any], *, timeout_s: float, max_turns: int) -> Harness:
    """The adapter `name` built with `options` (a run's ``rollout.harness_options.NAME``) beside the
    run's `timeout_s` and `max_turns`, or a `ValueError` naming the harness and the option: each
    option must be one of its `Harness.own_options`, and a bad value is refused by the adapter's own
    checks, so a run's config stops when it loads, not in the middle of a rollout."""
    from clawfast.harness import HARNESSES

    cls = HARNESSES[name]
    own = cls.own_options()
    unknown = sorted(set(options) - set(own))
    if unknown:
        raise ValueError(f"harness {name!r} has no option(s) {unknown}; its options: {list(own)} (its time "
                         "and turn limits are rollout.timeout_s and rollout.harness_max_turns)")
    try:
        return cls(timeout_s=timeout_s, max_turns=max_turns, **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"harness {name!r}: {exc}") from exc


def with_context(name: str, options: Mapping[str, Any], context: int | None) -> dict[str, Any]:
    """The options of the adapter `name` with the model's context told: an adapter whose own
    options include ``context_window`` (`clawfast.harness.base.CONTEXT_OPTION`) gets `context` (the
    longest prompt + output the proxy serves) where `options` set none. One set above it is refused:
    the proxy would refuse a prompt past `context` before the harness compacts, and of the pinned
    harnesses only Claude Code and OpenClaw compact on that refusal, Codex stops (bench/RESULTS.md,
    "A harness at the engine's context"). context None (no limit): `options` unchanged."""
    from clawfast.harness import HARNESSES
    from clawfast.harness.base import CONTEXT_OPTION

    told = dict(options)
    cls = HARNESSES.get(name)  # an unknown name is get_harness's to refuse, with the names it knows
    if context is None or cls is None or CONTEXT_OPTION not in cls.own_options():
        return told
    given = told.setdefault(CONTEXT_OPTION, context)
    if isinstance(given, int) and given > context:  # its type is the adapter's to check
        raise ValueError(f"harness {name!r}: {CONTEXT_OPTION} {given} is above the {context} tokens served "
                         f"(max_model_len): the proxy refuses a longer prompt before the harness compacts; leave it "
                         f"unset to tell it {context}")
    return told


def make_specs(tasks: Iterable[Task], harnesses: Iterable[str], k: int = 1) -> list[RolloutSpec]:
    """Every task x harness x sample index in ``range(k)``, task-major (a task's samples are adjacent,
    so a GRPO group completes early)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    harnesses = list(harnesses)
    if not harnesses:
        raise ValueError("at least one harness is needed")
    return [RolloutSpec(task, h, i) for task in tasks for h in harnesses for i in range(k)]

"""What to run: one `RolloutSpec` per rollout (a task, a harness, a sample number)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from clawfast.tasks.task import Task


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


def make_specs(tasks: Iterable[Task], harnesses: Iterable[str], k: int = 1) -> list[RolloutSpec]:
    """Every task x harness x sample index in ``range(k)``, task-major (a task's samples are adjacent,
    so a GRPO group completes early)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    harnesses = list(harnesses)
    if not harnesses:
        raise ValueError("at least one harness is needed")
    return [RolloutSpec(task, h, i) for task in tasks for h in harnesses for i in range(k)]

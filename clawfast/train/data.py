"""Where a step's rollouts come from: the data order over tasks, the tasks of a split, and the
rollout sources the loop reads (`HarnessRollouts` through the rollout service, `RecordedRollouts`
from .cfr files; `clawfast.train.sampled.EngineRollouts` straight from an engine). Every source
is a `clawfast.train.protocols.RolloutSource`: ``run(task_ids, harnesses, k, *, sampling,
on_result, positions)`` returns a `Batch`, one result per task x harness x sample, task-major.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from clawfast.engines.base import Sampling
from clawfast.records import RolloutResult, read_rollouts
from clawfast.rollout import RolloutService, make_specs
from clawfast.train.config import RunConfig
from clawfast.train.protocols import Batch


class TaskSampler:
    """Deterministic task order: position p is item ``p % n`` of epoch ``p // n``, each epoch a
    permutation of the (sorted) task ids drawn from ``numpy.random.default_rng([seed, epoch])``."""

    def __init__(self, task_ids: Sequence[str], seed: int) -> None:
        if not task_ids:
            raise ValueError("no training tasks (check tasks.suite, tasks.split, tasks.difficulties and tasks.categories)")
        self.ids = sorted(task_ids)
        self.seed = int(seed)

    def epoch_order(self, epoch: int) -> list[str]:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.ids))
        return [self.ids[i] for i in perm]

    def take(self, position: int, n: int) -> list[str]:
        """The `n` task ids at data position `position` (an epoch boundary may fall inside)."""
        out = []
        for p in range(position, position + n):
            epoch, index = divmod(p, len(self.ids))
            out.append(self.epoch_order(epoch)[index])
        return out


def load_tasks(config: RunConfig, split: str, difficulties: Sequence[str] = (), categories: Sequence[str] = ()) -> dict:
    """Task id -> Task of the configured suite's `split` (filtered by difficulty and category tags)."""
    from clawfast.tasks import load_suite

    tasks = load_suite(config.tasks.suite, split, seed=config.tasks.suite_seed)
    if difficulties:
        tasks = [t for t in tasks if t.tags.get("difficulty") in difficulties]
    if categories:
        tasks = [t for t in tasks if t.tags.get("category") in categories]
    return {t.id: t for t in tasks}


def check_trainable(tasks: dict) -> None:
    """Refuse tasks that only a judge scores: a training reward is the verifier's score (as ClawGym
    trains; `clawfast.tasks.scoring`), and they have none. Hybrid tasks train on their verifier's part."""
    judged = sorted(task_id for task_id, task in tasks.items() if task.verifier is None)
    if judged:
        shown = ", ".join(judged[:5]) + (f" and {len(judged) - 5} more" if len(judged) > 5 else "")
        raise ValueError(f"{len(judged)} training task(s) are scored by a judge alone, so a rollout of them has no "
                         f"reward: {shown}. Train on tasks with a verifier (tasks.categories, or a suite option "
                         f"such as pinchbench:PATH?exclude=ID,ID), and evaluate them with eval.judge.")


class RecordedRollouts:
    """Rollouts read from a directory of .cfr files; spec (task, harness, i) gets the i-th
    (cyclically) recorded rollout of that task and harness, ordered by (sample index, rollout id).
    Deterministic, no engine: offline training and fast tests of the loop."""

    def __init__(self, directory: str | Path) -> None:
        self.by_key: dict[tuple[str, str], list[RolloutResult]] = defaultdict(list)
        for r in read_rollouts(directory):
            self.by_key[(r.task_id, r.harness)].append(r)
        if not self.by_key:
            raise ValueError(f"{directory}: no recorded rollouts (.cfr files)")
        for rs in self.by_key.values():
            rs.sort(key=lambda r: (r.sample_index, r.rollout_id))

    @property
    def task_ids(self) -> list[str]:
        return sorted({t for t, _ in self.by_key})

    def run(self, task_ids: Sequence[str], harnesses: Sequence[str], k: int, *, sampling: Sampling | None = None,
            on_result: Callable[[RolloutResult], None] | None = None, positions: Sequence[int] = ()) -> Batch:
        """Recorded rollouts were sampled already: `sampling` and `positions` change nothing."""
        t0 = time.monotonic()
        out = []
        for task_id in task_ids:
            for h in harnesses:
                pool = self.by_key.get((task_id, h))
                if not pool:
                    raise ValueError(f"no recorded rollout of task {task_id!r} by harness {h!r}")
                for i in range(k):
                    out.append(copy.deepcopy(pool[i % len(pool)]))
                    if on_result is not None:
                        on_result(out[-1])
        return Batch(out, time.monotonic() - t0)


class HarnessRollouts:
    """The real thing: `service` (a started `RolloutService`) runs each task x harness x sample of
    `tasks` (task id -> Task) through the harness in a fresh sandbox behind the proxy."""

    def __init__(self, service: RolloutService, tasks: dict) -> None:
        self.service = service
        self.tasks = tasks

    def run(self, task_ids: Sequence[str], harnesses: Sequence[str], k: int, *, sampling: Sampling | None = None,
            on_result: Callable[[RolloutResult], None] | None = None, positions: Sequence[int] = ()) -> Batch:
        specs = make_specs([self.tasks[t] for t in task_ids], harnesses, k)
        t0 = time.monotonic()
        results = self.service.run(specs, sampling, on_result=on_result)
        return Batch(results, time.monotonic() - t0)

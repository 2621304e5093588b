"""Rollouts produced ahead of the trainer under a staleness bound: the asynchronous loop's source.

    producer = RolloutProducer(source, sampler, harnesses=("mini-swe-agent",), samples_per_task=4,
                               tasks_per_step=8, max_staleness=1, groups_needed=8 * steps, sampling=s)
    with producer:
        groups, dropped = producer.take(weight_version)   # the step's groups, sorted by position
        ...train, push weights, checkpoint...
        producer.retire(len(groups))                      # frees as many slots

A *group* is one task's rollouts (every harness x ``samples_per_task``), the unit GRPO normalises
over; it runs in a thread of its own as one ``source.run([task], ...)`` call, so groups overlap
each other, the trainer's step and the weight push. Groups start in data order (the task at data
position p is ``sampler.take(p, 1)``), positions requeued from a checkpoint first.

**The bound.** A group is *outstanding* from its start until the trainer retires it (after the step
that trained it has pushed its weights and checkpointed) or drops it. At most
``(max_staleness + 1) * tasks_per_step`` groups are outstanding. `take` hands the trainer the first
``tasks_per_step`` groups to *finish*, skipping (dropping, and counting) any whose oldest call was
sampled more than ``max_staleness`` weight versions before the trainer's: a slow group overtaken by
faster ones is the case the bound cuts. So no trained token is older than ``current - max_staleness``,
and with ``max_staleness = 0`` exactly the step's groups run, all on the current weights, and
nothing starts before the previous step's push: the synchronous loop's schedule, rollout for rollout.

A rollout lost to an infrastructure failure (a node gone, a sandbox dead) runs again inside its
group's ``source.run`` (`clawfast.rollout.retry`), so the group finishes whole, only later; the bound
is checked on what the group holds when it finishes, its retried rollouts included, and a group
says whether it holds one (`Group.retried`; the loop counts them: ``async/retried_groups``).

Guaranteed: every group handed out has its results in spec order and satisfies the bound; dropped
groups are counted (`dropped_groups`); `snapshot` lists every position started or queued
but not handed out (what a checkpoint stores, so a resumed run runs those tasks again). An exception
in a group's thread is raised by the next `take`. Not guaranteed: which groups finish first (real
harness timing), so beyond ``max_staleness = 0`` the batches depend on timing.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from clawfast.engines.base import Sampling
from clawfast.records import RolloutResult
from clawfast.train.algorithms import stale_rollouts
from clawfast.train.protocols import RolloutSource


@dataclass(frozen=True)
class Group:
    """One finished group: its data position, task, results (spec order) and wall seconds."""

    position: int
    task_id: str
    results: list[RolloutResult]
    seconds: float

    @property
    def retried(self) -> bool:
        """Whether a rollout of it ran again after an infrastructure failure (`clawfast.rollout.retry`):
        the group is whole, its retried rollout sampled later than the others."""
        return any(r.info.get("retries") for r in self.results)


class RolloutProducer:
    """source: a `RolloutSource` (`clawfast.train.protocols`); sampler: the run's `TaskSampler`.
    groups_needed: how many groups the trainer will take in all (no group starts beyond that, plus
    replacements of dropped ones). next_position / requeued: where new groups start, and positions
    to run first."""

    def __init__(self, source: RolloutSource, sampler, *, harnesses: Sequence[str], samples_per_task: int,
                 tasks_per_step: int, max_staleness: int, groups_needed: int, sampling: Sampling | None = None,
                 next_position: int = 0, requeued: Sequence[int] = ()) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.source = source
        self.sampler = sampler
        self.harnesses = tuple(harnesses)
        self.samples_per_task = samples_per_task
        self.tasks_per_step = tasks_per_step
        self.max_staleness = max_staleness
        self.limit = (max_staleness + 1) * tasks_per_step
        self.groups_needed = groups_needed
        self.sampling = sampling
        self.next_position = next_position
        self.dropped_groups = 0
        self._requeued = deque(requeued)
        self._cond = threading.Condition()
        self._outstanding = 0
        self._taken = 0           # groups handed to the trainer
        self._running: set[int] = set()
        self._finished: list[Group] = []  # in order of finishing
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RolloutProducer":
        self._thread = threading.Thread(target=self._produce, name="clawfast-producer", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """No group starts after this; groups still running are abandoned (their rollouts end when the
        rollout service closes)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- producing ---------------------------------------------------------------------------------

    def _may_start(self) -> bool:
        wanted = self.groups_needed - self._taken - len(self._running) - len(self._finished)
        return self._outstanding < self.limit and wanted > 0

    def _produce(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._may_start():
                    self._cond.wait()
                if self._stopping:
                    return
                if self._requeued:
                    position = self._requeued.popleft()
                else:
                    position, self.next_position = self.next_position, self.next_position + 1
                self._outstanding += 1
                self._running.add(position)
            threading.Thread(target=self._run_group, args=(position,), name=f"clawfast-group-{position}",
                             daemon=True).start()

    def _run_group(self, position: int) -> None:
        try:
            [task_id] = self.sampler.take(position, 1)
            batch = self.source.run([task_id], self.harnesses, self.samples_per_task, sampling=self.sampling,
                                    positions=[position])
            group = Group(position, task_id, batch.results, batch.seconds)
        except BaseException as exc:  # raised in the trainer's thread by `take`
            with self._cond:
                self._running.discard(position)
                self._error = self._error or exc
                self._cond.notify_all()
            return
        with self._cond:
            self._running.discard(position)
            self._finished.append(group)
            self._cond.notify_all()

    # -- consuming ---------------------------------------------------------------------------------

    def take(self, weight_version: int) -> tuple[list[Group], int]:
        """Block until ``tasks_per_step`` groups within the bound of `weight_version` have finished;
        return them sorted by data position, and how many groups this call dropped as stale."""
        out: list[Group] = []
        dropped = 0
        with self._cond:
            while len(out) < self.tasks_per_step:
                while not self._finished and self._error is None:
                    if not self._running and not self._may_start():
                        raise RuntimeError(f"no group can start: {self._taken} of {self.groups_needed} taken, "
                                           f"{self._outstanding} outstanding (retire the taken groups first)")
                    self._cond.wait()
                if self._error is not None:
                    raise RuntimeError("a rollout group failed") from self._error
                group = self._finished.pop(0)
                if stale_rollouts(group.results, weight_version, self.max_staleness).any():
                    dropped += 1
                    self.dropped_groups += 1
                    self._outstanding -= 1  # retired now: a replacement may start
                    self._cond.notify_all()
                    continue
                out.append(group)
                self._taken += 1
        return sorted(out, key=lambda g: g.position), dropped

    def retire(self, n: int) -> None:
        """The trainer is done with `n` taken groups (trained, weights pushed): as many may start."""
        with self._cond:
            self._outstanding -= n
            self._cond.notify_all()

    def snapshot(self) -> tuple[int, list[int]]:
        """(next new position, positions started or queued but not handed out: running, finished and
        waiting, requeued), read together: what a checkpoint stores so that a resumed run starts
        exactly the groups this one had not handed out."""
        with self._cond:
            return self.next_position, sorted([*self._running, *(g.position for g in self._finished),
                                               *self._requeued])

"""Run tasks x harnesses x k samples with a concurrency cap, in one process on one asyncio loop.

`RolloutScheduler(worker, concurrency).run(specs, sampling)` starts at most `concurrency` rollouts at once (each
a `RolloutWorker.run`: proxy rollout, fresh sandbox, harness, verifier) and returns one
`RolloutResult` per spec, in spec order. Blocking work (sandbox starts and runs, verifiers, proxy
calls) runs on a thread pool sized to the cap, so a slow sandbox never stalls the loop.

Guaranteed: every spec gets a result with a truthful status (see `clawfast.rollout.worker`); if the
caller cancels `run` (Ctrl-C), every rollout in flight is closed and its sandbox destroyed before the
cancellation propagates. Not guaranteed: result order of completion (use `on_result` for streaming).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from clawfast.records import RolloutResult
from clawfast.rollout.progress import ProgressDisplay
from clawfast.engines.base import Sampling
from clawfast.rollout.spec import RolloutSpec
from clawfast.rollout.worker import RolloutWorker


@dataclass
class RunStats:
    """Counts of one `RolloutScheduler.run`; `failed` counts every status other than ``ok``."""

    total: int = 0
    done: int = 0
    running: int = 0
    failed: int = 0
    by_status: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def record(self, result: RolloutResult) -> None:
        # The one place counters change.
        self.done += 1
        self.by_status[result.status] += 1
        if result.status != "ok":
            self.failed += 1

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def per_minute(self) -> float:
        return 60.0 * self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


class RolloutScheduler:
    """concurrency: rollouts in flight at once. progress: show a live rich display (done / running /
    failed, rollouts per minute). on_result: called on the loop with each result as it completes."""

    def __init__(
        self,
        worker: RolloutWorker,
        *,
        concurrency: int = 8,
        progress: bool = False,
        on_result: Callable[[RolloutResult], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.worker = worker
        self.concurrency = concurrency
        self.progress = progress
        self.on_result = on_result
        self.stats = RunStats()

    async def run(self, specs: Sequence[RolloutSpec], sampling: Sampling | None = None) -> list[RolloutResult]:
        """One result per spec, in spec order; every call of every rollout samples with `sampling`."""
        specs = list(specs)
        unknown = sorted({s.harness for s in specs} - set(self.worker.harnesses))
        if unknown:
            raise ValueError(f"no adapter for harness(es) {unknown}; have {sorted(self.worker.harnesses)}")
        # Install (or find) every harness first, off the loop: an npm install takes minutes and must
        # not count against the first rollouts' clocks.
        loop = asyncio.get_running_loop()
        for name in sorted({s.harness for s in specs}):
            await loop.run_in_executor(None, lambda h=self.worker.harnesses[name]: h.installation)
        self.stats = stats = RunStats(total=len(specs))
        semaphore = asyncio.Semaphore(self.concurrency)
        results: list[RolloutResult | None] = [None] * len(specs)
        # Each rollout holds at most two threads at once (its harness run, and the forwarder work of
        # sandbox close); a private pool keeps the loop's small default executor free.
        own_executor = self.worker.executor is None
        if own_executor:
            self.worker.executor = ThreadPoolExecutor(self.concurrency * 2 + 2, thread_name_prefix="clawfast-rollout")
        display = ProgressDisplay(stats) if self.progress else None

        async def one(i: int, spec: RolloutSpec) -> None:
            async with semaphore:
                stats.running += 1
                if display:
                    display.update()
                try:
                    result = await self.worker.run(spec, sampling)
                finally:
                    stats.running -= 1
                stats.record(result)
                results[i] = result
                if display:
                    display.update()
                if self.on_result is not None:
                    self.on_result(result)

        try:
            if display:
                display.start()
            tasks = [asyncio.create_task(one(i, spec)) for i, spec in enumerate(specs)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                # One rollout raised (a bug, not a rollout failure) or we were cancelled: cancel the
                # rest and wait, so each closes its proxy rollout and sandbox before we propagate.
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            if display:
                display.stop()
            if own_executor:
                self.worker.executor.shutdown(wait=True)
                self.worker.executor = None
        return [r for r in results if r is not None]

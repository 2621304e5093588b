"""Run rollouts with one concurrency cap, in this process, on one asyncio loop of its own.

    with RolloutScheduler(worker, concurrency=8) as scheduler:
        results = scheduler.run(specs, sampling)           # from any thread, concurrently

The scheduler owns a loop in a background thread; every `run` (or `submit`) from any thread puts
its rollouts on that loop, where at most `concurrency` run at once across all callers (each a
`RolloutWorker.run`: proxy rollout, fresh sandbox, harness, verifier). So an asynchronous trainer
can ask for the next groups while earlier ones still run, and an evaluation can run beside them,
all under the one cap. Blocking work (sandbox starts and runs, verifiers, proxy calls) runs on a
thread pool sized to the cap, so a slow sandbox never stalls the loop.

Guaranteed: every spec of a `run` gets a result with a truthful status (see
`clawfast.rollout.worker`), in spec order, after at most `infra_retries` re-runs of an attempt that
ended in an infrastructure failure (`clawfast.rollout.retry`); if the caller is interrupted (Ctrl-C) or a rollout
raises (a bug), every rollout of that `run` still in flight is closed and its sandbox destroyed
before the exception propagates; `close` does the same for every rollout of every caller. Not
guaranteed: an order of completion (use `on_result` for streaming).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from clawfast.engines.base import Sampling
from clawfast.records import RolloutResult
from clawfast.rollout.progress import RunStats, rollout_line
from clawfast.rollout.retry import attempt_note, should_retry
from clawfast.rollout.spec import RolloutSpec
from clawfast.rollout.worker import RolloutWorker


def gather(futures: Sequence[concurrent.futures.Future], *, on_result: Callable[[RolloutResult], None] | None,
           progress: bool, running: Callable[[], int],
           cancel: Callable[[Sequence[concurrent.futures.Future]], None]) -> list[RolloutResult]:
    """Wait for every future (each a rollout's result), in the calling thread: `on_result` with each
    as it ends, a live display if `progress`; results in the futures' order. On an exception (the
    caller interrupted, a rollout's bug) `cancel(futures)` cancels the rollouts not done and returns
    once they are closed; then it propagates. `running()`: rollouts running now, for the display."""
    stats = RunStats(total=len(futures))
    display = rollout_line(stats) if progress else None
    try:
        if display:
            display.start()
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            stats.record(result)
            stats.running = running()
            if display:
                display.update()
            if on_result is not None:
                on_result(result)
    except BaseException:
        cancel(futures)
        raise
    finally:
        if display:
            display.stop()
    return [future.result() for future in futures]


class RolloutScheduler:
    """concurrency: rollouts in flight at once, over every caller. infra_retries: how many times a
    spec whose attempt ended in an infrastructure failure runs again (`clawfast.rollout.retry`; 0:
    never). Start with `start` (or `with`), stop with `close`."""

    def __init__(self, worker: RolloutWorker, *, concurrency: int = 8, infra_retries: int = 0) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if infra_retries < 0:
            raise ValueError(f"infra_retries must be >= 0, got {infra_retries}")
        self.worker = worker
        self.concurrency = concurrency
        self.infra_retries = infra_retries
        self.running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._tasks: dict[concurrent.futures.Future, asyncio.Task] = {}
        # `close` and the callers' `submit` / `cancel` meet under this lock: a close refuses new
        # rollouts and stops the loop only once no caller still waits on a cancel that runs there.
        self._lock = threading.Lock()
        self._closing = False
        self._closed = threading.Event()  # set when a close has stopped everything
        self._cancels: set[concurrent.futures.Future] = set()

    def __enter__(self) -> "RolloutScheduler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self._loop is not None:
            return
        # Each rollout holds at most two threads at once (its harness run, and the forwarder work of
        # sandbox close); a private pool keeps the loop's small default executor free.
        if self.worker.executor is None:
            self.worker.executor = ThreadPoolExecutor(self.concurrency * 2 + 2, thread_name_prefix="clawfast-rollout")
        self._loop = asyncio.new_event_loop()
        self._closing = False
        self._closed.clear()
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._semaphore = asyncio.Semaphore(self.concurrency)
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="clawfast-scheduler", daemon=True)
        self._thread.start()
        ready.wait()

    def submit(self, spec: RolloutSpec, sampling: Sampling | None = None) -> concurrent.futures.Future:
        """Queue one rollout (from any thread); its future holds the `RolloutResult`. Stop it with
        `cancel` (which waits until it is closed), not with the future's own ``cancel``."""
        if spec.harness not in self.worker.harnesses:
            raise ValueError(f"no adapter for harness {spec.harness!r}; have {sorted(self.worker.harnesses)}")
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._loop is None or self._closing:
                raise RuntimeError(f"RolloutScheduler is {'closing' if self._closing else 'not started (or closed)'}")
            loop = self._loop

            def start() -> None:
                task = loop.create_task(self._one(spec, sampling))
                self._tasks[out] = task
                task.add_done_callback(lambda t: self._settle(out, t))

            # Queued before any close's cancel (the loop runs callbacks in order), so that cancel sees it.
            loop.call_soon_threadsafe(start)
        return out

    def _settle(self, out: concurrent.futures.Future, task: asyncio.Task) -> None:
        self._tasks.pop(out, None)
        if out.done():
            return
        if task.cancelled():
            out.cancel()
            out.set_running_or_notify_cancel()  # wakes `as_completed` waiters, which `cancel` alone does not
        elif task.exception() is not None:
            out.set_exception(task.exception())
        else:
            out.set_result(task.result())

    async def _one(self, spec: RolloutSpec, sampling: Sampling | None) -> RolloutResult:
        async with self._semaphore:  # held over the retries: a retry takes no other spec's slot
            self.running += 1
            try:
                retries: list[dict] = []
                while True:
                    result = await self.worker.run(spec, sampling, retries)
                    if not should_retry(result, len(retries), self.infra_retries):
                        return result
                    await asyncio.to_thread(self.worker.control.set_aside, result.rollout_id)
                    retries.append(attempt_note(result))
            finally:
                self.running -= 1

    def cancel(self, futures: Sequence[concurrent.futures.Future] | None = None) -> None:
        """Cancel the rollouts of `futures` (None: every one) that are not done, from any thread, and
        return once each is closed (its sandbox destroyed)."""

        async def cancel_and_wait() -> None:
            wanted = self._tasks if futures is None else futures
            tasks = [self._tasks[f] for f in wanted if f in self._tasks]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with self._lock:
            if self._loop is None:
                return
            waiter = asyncio.run_coroutine_threadsafe(cancel_and_wait(), self._loop)
            self._cancels.add(waiter)
        try:
            waiter.result()
        finally:
            with self._lock:
                self._cancels.discard(waiter)

    def run(self, specs: Sequence[RolloutSpec], sampling: Sampling | None = None, *,
            on_result: Callable[[RolloutResult], None] | None = None, progress: bool = False) -> list[RolloutResult]:
        """One result per spec, in spec order, every call of every rollout sampled with `sampling`;
        blocks the calling thread (any thread: concurrent runs share the cap). `on_result` gets each
        result as it ends (in the calling thread); `progress` draws a live line."""
        unknown = sorted({s.harness for s in specs} - set(self.worker.harnesses))
        if unknown:
            raise ValueError(f"no adapter for harness(es) {unknown}; have {sorted(self.worker.harnesses)}")
        futures = [self.submit(spec, sampling) for spec in specs]
        return gather(futures, on_result=on_result, progress=progress, running=lambda: self.running,
                      cancel=self.cancel)

    def close(self) -> None:
        """Cancel every rollout still queued or running (each is closed, its sandbox destroyed), then
        stop the loop and the thread pool. Idempotent; a close while another thread closes returns once
        that one has. A `run` in another thread raises (its rollouts cancelled) instead of waiting on a
        loop that stopped."""
        with self._lock:
            closing_elsewhere = self._closing
            if not closing_elsewhere:
                if self._loop is None:
                    return
                self._closing = True
        if closing_elsewhere:
            self._closed.wait()
            return
        try:
            self.cancel()
            while True:  # other callers' cancels (a `run` whose rollouts this close cancelled) end first
                with self._lock:
                    pending = [w for w in self._cancels if not w.done()]
                    if not pending:
                        loop, self._loop = self._loop, None
                        break
                concurrent.futures.wait(pending)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join()
            loop.close()
            if self.worker.executor is not None:
                self.worker.executor.shutdown(wait=True)
                self.worker.executor = None
        finally:
            with self._lock:
                self._closing = False
            self._closed.set()

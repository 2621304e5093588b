"""`SandboxPool`: at most N sandboxes at once, bounded start retries, nothing left behind.

    with SandboxPool("bwrap", max_concurrency=8) as pool:
        with pool.sandbox(spec) as sb:          # waits for a free slot, starts (retrying), destroys after
            result = sb.run(["mini", "-t", task], timeout=600)
            files = sb.read_files(["answer.txt"])

    async with pool.asandbox(spec) as sb:      # the same for asyncio schedulers
        result = await sb.arun([...])

Guaranteed:
- at most `max_concurrency` sandboxes are handed out at once (sync and async users share the cap);
- a sandbox whose start fails with SandboxError is retried up to `start_retries` more times, then the
  last SandboxError propagates (commands are never retried: a harness run is not idempotent);
- every sandbox is destroyed when its `with` block ends, however it ends, and `close()` destroys any
  still open and then the backend (its temp directory, forwarder thread, cgroups): after `close()`
  no process, mount, cgroup or temporary directory of the pool remains;
- an asyncio task cancelled while its sandbox starts does not leak it: it is destroyed once started,
  and its slot is given back only then (so the cap holds meanwhile);
- `close()` destroys every sandbox even when one of them fails to go (its OSError is raised after).
Not guaranteed: FIFO order among waiters (async waiters poll every <= 20 ms).

Warm sandboxes: with `warm=N, warm_spec=S` a background thread keeps N idle sandboxes started from S
(without files). A request whose spec equals S but for files/source_dir/home_files/name gets one of
them, provisioned with its files, instead of waiting for a start; any other request, or one that
finds none ready, starts a fresh sandbox. Idle bwrap/local sandboxes hold no process (directories, a
cgroup, forwarder sockets), so warm ones do not count against `max_concurrency`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from clawfast.sandbox.base import Sandbox, SandboxBackend, SandboxError
from clawfast.sandbox.spec import SandboxSpec, warm_key


@dataclass
class PoolStats:
    """created: sandboxes handed out; start_failures: failed start attempts (each retry counts, warm
    starts too); active: handed out and not yet destroyed; peak_active: the most active at once;
    closed: handed-out sandboxes destroyed; warm_hits: requests served by a warm sandbox."""

    created: int = 0
    start_failures: int = 0
    active: int = 0
    peak_active: int = 0
    closed: int = 0
    warm_hits: int = 0


class SandboxPool:
    def __init__(
        self,
        backend: SandboxBackend | str = "bwrap",
        *,
        max_concurrency: int = 8,
        start_retries: int = 2,
        retry_delay_s: float = 0.05,
        warm: int = 0,
        warm_spec: SandboxSpec | None = None,
        **backend_options,
    ) -> None:
        from clawfast.sandbox import create_backend

        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if not isinstance(start_retries, int) or start_retries < 0:
            raise ValueError(f"start_retries must be an int >= 0, got {start_retries!r}")
        if not isinstance(warm, int) or warm < 0:
            raise ValueError(f"warm must be an int >= 0, got {warm!r}")
        if warm and warm_spec is None:
            raise ValueError("warm > 0 needs a warm_spec")
        if warm_spec is not None:
            warm_spec = warm_key(warm_spec)
            warm_spec.validate()
        if isinstance(backend, str):
            backend = create_backend(backend, **backend_options)
        elif backend_options:
            raise ValueError("backend options are only accepted with a backend name")
        self.backend = backend
        self.max_concurrency = max_concurrency
        self.start_retries = start_retries
        self.retry_delay_s = retry_delay_s
        self.stats = PoolStats()
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._open: set[Sandbox] = set()
        self._closed = False
        # Commands of pool sandboxes run here from `arun`: one thread per possible concurrent sandbox
        # (plus slack for concurrent commands), so they never queue behind the small default executor.
        self.executor = ThreadPoolExecutor(max_workers=2 * max_concurrency, thread_name_prefix="clawfast-sandbox")
        self.warm = warm
        self.warm_spec = warm_spec
        self._idle: list[Sandbox] = []
        self._refill = threading.Condition(self._lock)
        self._warmer: threading.Thread | None = None
        if warm:
            self._warmer = threading.Thread(target=self._keep_warm, name="clawfast-sandbox-warmer", daemon=True)
            self._warmer.start()

    # -- sync ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def sandbox(self, spec: SandboxSpec, *, wait_timeout: float | None = None) -> Iterator[Sandbox]:
        """Wait for a slot (TimeoutError after `wait_timeout`), start a sandbox, destroy it at exit."""
        spec.validate()
        if not self._slots.acquire(timeout=wait_timeout):
            raise TimeoutError(f"no sandbox slot free within {wait_timeout}s")
        try:
            sandbox = self._start(spec)
            try:
                yield sandbox
            finally:
                self._destroy(sandbox)
        finally:
            self._slots.release()

    # -- async ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def asandbox(self, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        """`sandbox` for asyncio: start and destroy run in the pool's executor."""
        spec.validate()
        delay = 0.001
        while not self._slots.acquire(blocking=False):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        loop = asyncio.get_running_loop()
        slot_handed_off = False
        try:
            starting = loop.run_in_executor(self.executor, self._start, spec)
            try:
                sandbox = await asyncio.shield(starting)
            except asyncio.CancelledError:
                # The start goes on in its thread: destroy what it makes rather than leak it, and
                # keep the slot until then, so that the sandbox still counts against the cap.
                starting.add_done_callback(self._destroy_started)
                slot_handed_off = True
                raise
            try:
                yield sandbox
            finally:
                await loop.run_in_executor(self.executor, self._destroy, sandbox)
        finally:
            if not slot_handed_off:
                self._slots.release()

    def _destroy_started(self, starting: asyncio.Future) -> None:
        """Destroy the sandbox a cancelled `asandbox` was starting, then give its slot back."""
        if starting.cancelled() or starting.exception() is not None:
            self._slots.release()
            return
        sandbox = starting.result()

        def destroy() -> None:
            try:
                self._destroy(sandbox)
            finally:
                self._slots.release()

        try:
            self.executor.submit(destroy)
        except RuntimeError:  # executor shut down: close() destroyed it already
            self._slots.release()

    # -- shared --------------------------------------------------------------------------------

    def _count_start_failure(self) -> None:
        with self._lock:
            self.stats.start_failures += 1

    @property
    def warm_ready(self) -> int:
        """Warm sandboxes started and idle right now."""
        with self._lock:
            return len(self._idle)

    def _keep_warm(self) -> None:
        failures = 0
        while True:
            with self._refill:
                while not self._closed and len(self._idle) >= self.warm:
                    self._refill.wait()
                if self._closed:
                    return
            try:
                sandbox = self.backend.create(self.warm_spec)
                failures = 0
            except SandboxError:
                self._count_start_failure()
                failures += 1
                # A warm start that keeps failing must not spin: back off, up to 5 s.
                time.sleep(min(5.0, self.retry_delay_s * 2**failures))
                continue
            with self._refill:
                if not self._closed:
                    self._idle.append(sandbox)
                    continue
            sandbox.close()
            return

    def _take_warm(self, spec: SandboxSpec) -> Sandbox | None:
        if not self.warm or warm_key(spec) != self.warm_spec:
            return None
        with self._refill:
            if not self._idle:
                return None
            sandbox = self._idle.pop()
            self._refill.notify()
        try:
            sandbox.provision(spec)
        except BaseException:
            sandbox.close()
            raise
        with self._lock:
            self.stats.warm_hits += 1
        return sandbox

    def _start(self, spec: SandboxSpec) -> Sandbox:
        sandbox = self._take_warm(spec)
        attempt = 0
        while sandbox is None:
            if self._closed:
                raise SandboxError("pool is closed")
            try:
                sandbox = self.backend.create(spec)
            except SandboxError:
                self._count_start_failure()
                if attempt >= self.start_retries:
                    raise
                attempt += 1
                time.sleep(self.retry_delay_s * attempt)
        sandbox.executor = self.executor
        with self._lock:
            closed_meanwhile = self._closed
            if not closed_meanwhile:
                self._open.add(sandbox)
                self.stats.created += 1
                self.stats.active += 1
                self.stats.peak_active = max(self.stats.peak_active, self.stats.active)
        if closed_meanwhile:
            sandbox.close()
            raise SandboxError("pool is closed")
        return sandbox

    def _destroy(self, sandbox: Sandbox) -> None:
        with self._lock:
            if sandbox not in self._open:
                return  # already destroyed by close()
            self._open.discard(sandbox)
            self.stats.active -= 1
            self.stats.closed += 1
        sandbox.close()

    def close(self) -> None:
        """Destroy every sandbox, idle or handed out, then the backend. Idempotent."""
        with self._refill:
            if self._closed:
                return
            self._closed = True
            self.stats.active -= len(self._open)
            self.stats.closed += len(self._open)
            self._open.clear()  # what `_destroy` would do for each; the backend closes them below
            self._idle = []
            self._refill.notify_all()
        if self._warmer is not None:
            self._warmer.join()  # it may be starting one sandbox; it closes that itself
        try:
            # Every sandbox of the pool is the backend's: its close closes each, even when one before
            # it raised, and raises the first error at the end.
            self.backend.close()
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> SandboxPool:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

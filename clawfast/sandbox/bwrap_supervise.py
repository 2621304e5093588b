"""Supervising one bwrap run from the host: its output, its PID namespace, its end.

`Capture` reads a run's stdout and stderr through pipes with bounded memory; `StatusPipe` learns the
pid of the run's PID-namespace init from bwrap; `kill_tree` ends the whole namespace (SIGKILL to its
init makes the kernel kill every other process in it) and `wait_namespace_gone` returns only once
nothing of it is left. Every wait for a process to die is bounded by `KILL_GRACE_S`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

from clawfast.sandbox.cgroup import Cgroup
from clawfast.sandbox.hostdir import READY
from clawfast.sandbox.process import MAX_WAIT_MS, wait_exit

KILL_GRACE_S = 5.0


class Capture:
    """A run's stdout and stderr through pipes: the first `cap` bytes of each are kept (stderr's after
    the readiness marker), the rest read and dropped, so that a command printing without end costs
    the host neither disk nor memory."""

    def __init__(self, cap: int) -> None:
        self.out_r, self.out_w = os.pipe()
        self.err_r, self.err_w = os.pipe()
        self.keep = {self.out_r: cap + 1, self.err_r: cap + 1 + len(READY)}
        self.data = {self.out_r: bytearray(), self.err_r: bytearray()}
        self.dropped = {self.out_r: 0, self.err_r: 0}
        self.cap = cap
        self._open = {self.out_r, self.err_r}
        self._writers_closed = False

    def close_write_ends(self) -> None:
        if not self._writers_closed:
            os.close(self.out_w)
            os.close(self.err_w)
            self._writers_closed = True

    def pump_until_exit(self, proc: subprocess.Popen, deadline: float) -> bool:
        """Read output until `proc` exits (True; it is reaped) or `deadline` passes (False)."""
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd: look at the process every 50 ms
            pidfd = None
        try:
            while True:
                if self._pump(deadline, pidfd, 50 if pidfd is None else None) or proc.poll() is not None:
                    proc.wait()
                    return True
                if time.monotonic() >= deadline:
                    return False
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def drain(self, deadline: float) -> None:
        """Read what is left until every writer is gone (end of file on both pipes) or `deadline`."""
        while self._open and time.monotonic() < deadline:
            self._pump(deadline, None, None)

    def _pump(self, deadline: float, pidfd: int | None, tick_ms: int | None) -> bool:
        """One wait and read; True when `pidfd` turned readable (the process exited)."""
        poller = select.poll()
        for fd in self._open:
            poller.register(fd, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        # Capped: poll() takes at most ~24 days (an int of ms) and a timeout may be longer, even inf.
        wait_ms = min(max(0.0, deadline - time.monotonic()) * 1000, tick_ms or MAX_WAIT_MS)
        exited = False
        for fd, _ in poller.poll(wait_ms):
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._open.discard(fd)
                continue
            room = self.keep[fd] - len(self.data[fd])
            self.data[fd] += chunk[:max(room, 0)]
            self.dropped[fd] += max(len(chunk) - max(room, 0), 0)
        return exited

    def result(self, fd: int) -> tuple[bytes, bool]:
        data = bytes(self.data[fd])
        return data[: self.cap], len(data) > self.cap or self.dropped[fd] > 0

    def close(self) -> None:
        self.close_write_ends()
        for fd in (self.out_r, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass


class StatusPipe:
    """bwrap's --json-status-fd pipe: `{"child-pid": N}` (the PID namespace's init, as the host sees
    it) arrives right after bwrap forks it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pid: int | None = None
        self._buf = b""
        os.set_blocking(fd, False)

    def child_pid(self) -> int | None:
        if self._pid is None:
            try:
                while chunk := os.read(self.fd, 65536):
                    self._buf += chunk
            except (BlockingIOError, OSError):
                pass
            for line in self._buf.decode(errors="replace").splitlines():
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("child-pid"), int):
                    self._pid = obj["child-pid"]
        return self._pid


def kill_tree(proc: subprocess.Popen, status: StatusPipe, cgroup: Cgroup | None) -> None:
    """Kill everything a run started and reap bwrap: SIGKILL to the namespace's init makes the kernel
    kill every other process of the namespace."""
    pid = status.child_pid()
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if cgroup is not None:
        cgroup.kill_all()
    if not wait_exit(proc, KILL_GRACE_S if pid is not None else 0.05):
        # No init pid known (killed before bwrap reported it): kill bwrap, --die-with-parent does the rest.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_namespace_gone(status: StatusPipe) -> None:
    """Return once no process of the run's namespace is left.

    bwrap exits as soon as the command does; only then does its init get SIGKILL (--die-with-parent)
    and the kernel kill the rest of the namespace, a moment later (seen: background processes still
    alive right after bwrap was reaped). The init becomes a zombie only after every other process of
    its namespace is gone, so waiting for the init to exit (a pidfd turns readable) is exactly enough.
    (The sandbox's cgroup is no help here: it holds the runs of other threads too.)"""
    pid = status.child_pid()
    if pid is None:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already exited and reaped
    except (AttributeError, OSError):
        _poll_gone(pid)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(KILL_GRACE_S * 1000):
            os.kill(pid, signal.SIGKILL)  # PDEATHSIG did not do it: do it here
            poller.poll(KILL_GRACE_S * 1000)
    finally:
        os.close(fd)


def _poll_gone(pid: int) -> None:
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.001)

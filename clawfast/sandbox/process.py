"""Waiting for and killing the host processes that run a sandbox's commands."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

# The longest single wait in poll(); the loops around it go on until their deadline.
MAX_WAIT_MS = 60_000


def wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for `proc` to exit (and reap it); False if it still runs after `timeout` seconds.

    Popen.wait(timeout) polls with sleeps that grow to 50 ms, which added ~8 ms to every 25 ms sandbox
    start in bench/bench_sandbox.py; a pidfd wakes exactly at exit."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # old kernel or Python without pidfd: fall back to polling
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        # Each wait capped: poll() takes at most ~24 days (an int of ms), and a timeout may be inf.
        while not poller.poll(min(max(0.0, deadline - time.monotonic()) * 1000, MAX_WAIT_MS)):
            if time.monotonic() >= deadline:
                return False
    finally:
        os.close(fd)
    proc.wait()
    return True


def kill_group(proc: subprocess.Popen, timeout: float = 2.0) -> None:
    """SIGKILL the command's process group and wait (bounded) until no member is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.002)

"""Timing and peak-memory measurement shared by the CPU benchmarks (Linux).

Peak memory is the process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs
before the run) minus the resident size before the run, so it counts every byte the run touched,
outputs and gradients included.
"""

from __future__ import annotations

import statistics
import time


def status_mib(key: str) -> float:
    """A ``/proc/self/status`` field (VmRSS, VmHWM, ...) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{key} not in /proc/self/status")


def available_mib() -> float:
    """MemAvailable of the machine, in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def measure(fn, repeats: int) -> tuple[float, float]:
    """(median seconds, peak extra MiB) of ``fn()``: the memory run is a separate first call, then
    ``repeats`` timed calls (at least one; with repeats=0 the memory run is also the timed one)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status_mib("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    peak = status_mib("VmHWM") - before
    del out
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return (statistics.median(times) if times else first), peak

"""The timing harness of bench/gpu_kernels.py: `Bench` times a function (CUDA events on a GPU, the
median of the timed calls, the allocator's peak above what was allocated before them), `Cases` keeps
the cases within the script's budget and turns a case that raises into a row, `versus` makes the row
of ours against a baseline.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

# Seconds each group of cases may need on an H200, compiles included (a case starts only if what is
# left of --budget covers it): rough, from the FLOP counts and compile times in bench/gpu_kernels.py's notes.
EST_S = {"logprobs": 20, "naive": 4, "liger": 8, "cce": 12, "attention": 12, "chain": 6, "small": 15,
         "entropy": 15, "flex": 40, "varlen": 8, "attention_big": 20, "tile": 2, "matmul": 3}


@dataclass
class Timing:
    ms: float
    first_ms: float
    peak_mib: float
    value: object = None


class Bench:
    """Timing and memory on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, device, warmup, repeats):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = max(1, warmup), max(1, repeats)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def measure(self, fn, repeats: int | None = None) -> Timing:
        """The first call alone (compile), warm-up calls, then timed calls; the peak memory
        of the timed calls above what was allocated before them (NaN on a CPU)."""
        torch = self.torch
        self.sync()
        t0 = time.perf_counter()
        value = fn()
        self.sync()
        first_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(self.warmup - 1):
            fn()
        before = 0
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats or self.repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if self.cuda else float("nan")
        return Timing(statistics.median(times), first_ms, peak, value)


class Cases:
    """Runs cases under the budget (seconds from ``start``, a `time.monotonic` reading): a case that raises
    or no longer fits becomes a row saying so."""

    def __init__(self, torch, rows, budget: float | None, cuda: bool, start: float):
        self.torch, self.rows, self.budget, self.cuda, self.start = torch, rows, budget, cuda, start
        self.failures: list[str] = []

    def left(self) -> float:
        return math.inf if self.budget is None else self.budget - (time.monotonic() - self.start)

    def fits(self, group: str, **row) -> bool:
        need = EST_S[group] if self.cuda else 0
        if self.left() >= need:
            return True
        self.rows.add(**row, note=f"skipped: {max(self.left(), 0):.0f} s of the {self.budget:.0f} s budget left, "
                                  f"~{EST_S[group]} s needed on an H200")
        return False

    def error(self, exc: BaseException, *, ours: bool, **row) -> None:
        traceback.print_exc()  # the whole story to the log; the row gets its first line
        self.rows.add(**row, note=f"{'error' if ours else 'baseline failed'}: {describe(exc)}")
        if ours:
            self.failures.append(f"{row.get('op')} {row.get('case')}: {describe(exc)}")
        self.free()

    def free(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0][:160] if text else ""
    oom = "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError"
    return ("out of memory: " if oom else "") + f"{type(exc).__name__}: {first}"


def secs(ms: float) -> str:
    return f"{ms / 1e3:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def try_time(bench, fn):
    """A baseline's Timing, or the exception it raised (out of memory at a large shape, a peer's bug)."""
    try:
        return bench.measure(fn)
    except Exception as exc:  # noqa: BLE001 - the row reports it
        traceback.print_exc()
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return exc


def versus(ours: Timing, base, **row) -> dict:
    """A row of ours against a baseline's Timing (or the exception it raised: said in the note)."""
    row.update(ms=ours.ms, peak_mib=ours.peak_mib, warmup_ms=ours.first_ms)
    if isinstance(base, Timing):
        row.update(baseline_ms=base.ms, ratio=ours.ms / base.ms, baseline_peak_mib=base.peak_mib,
                   baseline_warmup_ms=base.first_ms)
        if base.peak_mib == base.peak_mib and base.peak_mib > 0:
            row["mem_ratio"] = ours.peak_mib / base.peak_mib
    else:
        row["note"] = note(f"baseline failed: {describe(base)}", row.get("note", ""))
    return row


def note(*parts) -> str:
    return "; ".join(p for p in parts if p)

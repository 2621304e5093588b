"""How bench/gpu_correctness.py runs its cases: in ``workers`` processes taking them in plan order from
one queue, each finished case one row (``bench/rows.py``) the moment it finishes.

Triton compiles each new kernel variant on the host (a second or so of CPU each, about 80 variants
here), so the processes compile in parallel while the GPU checks. A case that raises is a failed row
(`run_case` never raises but for out of memory); a process that dies (a CUDA error poisons its
context) fails its case and is replaced; a case out of GPU memory is retried up to twice.
"""

from __future__ import annotations

import math
import os
import queue
import time
import traceback

from gpu_correctness_cases import RUNNERS, NeedsGPU
from gpu_correctness_plan import CASES, Case, bar
from rows import Rows


def case_seed(seed: int, index: int) -> int:
    return (seed + 1_000_003 * index) % 2**31


def _fatal(exc: BaseException) -> bool:
    """A CUDA error that poisons the process's context: its process must not run another case."""
    text = str(exc)
    return any(s in text for s in ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch"))


def run_case(torch, device: str, case: Case, smoke: bool, seed: int, tol_scale: float = 1.0) -> dict:
    """One case, start to finish: its row (never raises; an exception is a failed row)."""
    t0 = time.perf_counter()
    row = {"op": case.op, "case": case.name}
    try:
        shape, errs, dtype, note, plain = RUNNERS[case.run](torch, device, case.sizes(smoke), case.params, seed)
    except NeedsGPU as exc:
        row.update(ms=(time.perf_counter() - t0) * 1e3, note=f"not run on {device}: {exc}")
        return row
    except Exception as exc:  # noqa: BLE001 - reported as the case's result
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        row.update(ok=False, ms=(time.perf_counter() - t0) * 1e3, note=f"{type(exc).__name__}: {first}; seed {seed}")
        row["fatal"] = _fatal(exc)
        return row
    finally:
        if device != "cpu":
            torch.cuda.empty_cache()
    bars = {part: bar(part, dtype, plain) * tol_scale for part in errs}
    ratios = {part: (err / bars[part] if bars[part] > 0 else (math.inf if err else 0.0)) for part, err in errs.items()}
    worst = max(ratios, key=lambda p: (ratios[p], errs[p]))
    parts = ", ".join(f"{p} {e:.2g}" for p, e in errs.items())
    if plain:
        parts += " (plain float32: " + ", ".join(f"{p} {e:.2g}" for p, e in plain.items()) + ")"
    row.update(shape=shape, err=errs[worst], tol=bars[worst],
               ok=all(math.isfinite(e) for e in errs.values()) and ratios[worst] <= 1.0,
               ms=(time.perf_counter() - t0) * 1e3, note=f"{parts}; seed {seed}" + (f"; {note}" if note else ""))
    return row


def _setup(smoke: bool):
    """torch and the device in a process about to run cases (TRITON_INTERPRET set before triton loads)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        if not smoke:
            raise SystemExit("gpu_correctness: no CUDA device (use --smoke on a CPU)")
        os.environ["TRITON_INTERPRET"] = "1"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 cuBLAS in the log-prob matmuls: IEEE
    torch.backends.cudnn.allow_tf32 = False
    import clawfast.kernels  # noqa: F401 - after TRITON_INTERPRET

    return torch, "cuda" if cuda else "cpu"


def _worker(tasks, results, smoke: bool, seed: int, tol_scale: float) -> None:
    torch, device = _setup(smoke)
    cases = {f"{c.op} {c.name}": c for c in CASES}
    pid = os.getpid()
    while True:
        try:
            index, name = tasks.get(timeout=0.2)
        except queue.Empty:
            return
        results.put(("start", pid, index, None))
        try:
            row = run_case(torch, device, cases[name], smoke, case_seed(seed, index), tol_scale)
        except torch.cuda.OutOfMemoryError as exc:
            results.put(("oom", pid, index, str(exc).splitlines()[0][:200]))
            time.sleep(1.0)
            continue
        fatal = row.pop("fatal", False)
        results.put(("row", pid, index, row))
        if fatal:
            return


def run_all(cases: list[Case], smoke: bool, seed: int, workers: int, rows: Rows, tol_scale: float = 1.0) -> None:
    """The cases in ``workers`` processes fed from one queue in plan order; rows as they finish."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    tasks, results = ctx.Queue(), ctx.Queue()
    index_of = {f"{c.op} {c.name}": i for i, c in enumerate(CASES)}
    by_index = {index_of[f"{c.op} {c.name}"]: c for c in cases}
    for i in sorted(by_index):
        tasks.put((i, f"{by_index[i].op} {by_index[i].name}"))
    procs: dict[int, mp.Process] = {}
    inflight: dict[int, int] = {}
    pending = set(by_index)
    queued = len(pending)  # tasks in the queue not yet taken
    ooms: dict[int, int] = {}

    def start() -> None:
        p = ctx.Process(target=_worker, args=(tasks, results, smoke, seed, tol_scale), daemon=True)
        p.start()
        procs[p.pid] = p

    def fail(i: int, note: str) -> None:
        c = by_index[i]
        rows.add(op=c.op, case=c.name, ok=False, note=f"{note}; seed {case_seed(seed, i)}")
        pending.discard(i)

    for _ in range(max(1, min(workers, len(pending)))):
        start()
    while pending:
        try:
            kind, pid, i, payload = results.get(timeout=0.5)
        except queue.Empty:
            kind = None
        if kind == "start":
            inflight[pid] = i
            queued -= 1
        elif kind == "row":
            inflight.pop(pid, None)
            if i in pending:
                rows.add(**payload)
                pending.discard(i)
        elif kind == "oom":
            inflight.pop(pid, None)
            ooms[i] = ooms.get(i, 0) + 1
            if ooms[i] > 2:
                fail(i, f"out of GPU memory three times: {payload}")
            else:
                tasks.put((i, f"{by_index[i].op} {by_index[i].name}"))
                queued += 1
        if kind is not None:
            continue
        for pid, p in list(procs.items()):
            if p.is_alive():
                continue
            procs.pop(pid)
            i = inflight.pop(pid, None)
            if i is not None and i in pending:
                fail(i, f"its process died (exit status {p.exitcode})")
        if pending and queued > 0 and len(procs) < workers:
            start()  # a worker that stopped after a fatal CUDA error, or died, is replaced
        elif pending and not procs:
            for i in sorted(pending):
                fail(i, "not run: no process left to run it")
    for p in procs.values():
        p.join(timeout=5)


def default_workers(smoke: bool) -> int:
    return 2 if smoke else max(1, min(6, (os.cpu_count() or 2) // 2))

"""Correctness of every compiled kernel of clawfast.kernels at GPU shapes: the first GPU-check section.

    python bench/gpu_correctness.py [--rows PATH] [--seed S] [--only TEXT] [--workers W]
    python bench/gpu_correctness.py --smoke     # the same cases, tiny, under TRITON_INTERPRET=1 on a CPU
    python bench/gpu_correctness.py --list      # the cases and their tolerances, nothing run

Each case runs a public op with ``backend="triton"`` (compiled on a GPU) on fresh random inputs and
compares it, forward and gradients, with its float64 reference ``*_ref`` from ``kernels/reference.py``
fed the same rounded inputs (and the same rounded upstream gradients). The references of attention and
log-probs are dense ([H, N, N] scores, [N, V] logits) and run on the GPU in float64, so their shapes are
moderate: 2-4K rows, real head counts and head dims, a 128K vocabulary at d = 4096. The loop references
of GAE, IS weights and the policy loss run on the host in float64 over 2-8K targets. Inputs are
agent-shaped forests: per group a shared prompt, then samples made of output and tool-result segments
that fork where a harness retried or edited its history.

``CASES`` (bench/gpu_correctness_plan.py) is the plan, in value order: the default training path first.
``--smoke`` runs the same cases in the same order with the same tolerances; only the sizes differ.
The errors and their tolerances: that module's docstring.

Each finished case is one row (``bench/rows.py``): op, case, shape, ``err`` and ``tol`` of its worst
part (largest err / tol), ``ok``, ``ms`` (the case's wall time: compiling, kernel, reference) and a
note with every part's error and the case's seed (``--seed S --only CASE`` reruns one case exactly).
The cases run in ``--workers`` processes taking them in order from one queue (default: half the CPUs,
at most 6; two in a smoke run); a case that raises, or whose process dies, is a failed row (how:
gpu_correctness_run.py); a case of a CUDA-only op (backend "varlen") on a CPU is a row that says it
did not run, neither ok nor failed. Exit status 1 when a case failed.

Files: the plan and tolerances (gpu_correctness_plan.py), the cases (gpu_correctness_cases.py), the
forests they run on (gpu_forests.py), the worker processes (gpu_correctness_run.py); this one is the
command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: rows.py, gpu_correctness_*.py

from gpu_correctness_plan import CASES, select  # noqa: E402
from gpu_correctness_run import default_workers, run_all  # noqa: E402
from rows import Rows  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU, Triton's interpreter")
    ap.add_argument("--rows", type=Path, help="append each finished case here as a JSON line (bench/rows.py)")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: fresh, printed)")
    ap.add_argument("--only", nargs="+", help="only the cases whose 'op case' contains one of these texts")
    ap.add_argument("--workers", type=int, default=None, help="processes running cases (default: CPUs / 2, <= 6)")
    ap.add_argument("--tol-scale", type=float, default=1.0,
                    help="multiply every tolerance (0: any nonzero error fails; shows that failures are reported)")
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in CASES:
            print(f"{c.op} | {c.name} | {c.sizes(args.smoke)}")
        return 0
    cases = select(args.only)
    if not cases:
        print(f"no case matches {args.only}")
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    workers = args.workers or default_workers(args.smoke)
    print(f"gpu_correctness: {len(cases)} cases, seed {seed}, {workers} processes"
          f"{' (smoke)' if args.smoke else ''}", flush=True)
    rows = Rows(args.rows)
    t0 = time.perf_counter()
    run_all(cases, args.smoke, seed, workers, rows, args.tol_scale)
    failed = rows.failed
    not_run = [r for r in rows.rows if "ok" not in r]  # a CUDA-only op on a CPU
    ran = len(rows.rows) - len(not_run)
    print(f"gpu_correctness: {ran - len(failed)} of {ran} cases within tolerance in "
          f"{time.perf_counter() - t0:.1f} s (seed {seed})" + (f"; FAILED: {len(failed)}" if failed else "")
          + (f"; {len(not_run)} not run here (CUDA only)" if not_run else ""), flush=True)
    return 1 if failed or len(rows.rows) < len(cases) else 0


if __name__ == "__main__":
    sys.exit(main())

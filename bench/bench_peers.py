"""Against the peers: the same inputs through the peers' own code and ours, in one process.

    bash bench/peers/setup.sh                                        # the peers' venv, pinned
    ~/.cache/clawfast/venv-peers/bin/python bench/bench_peers.py     # every section; --quick: tiny

Sections (one module each in bench/peers/, ``run(quick) -> rows``): ``packing`` (tree building and
packing of harness-shaped rollouts: clawfast vs AReaL's and TRL's tree packers), ``attention``
(tree attention on one packed tree: clawfast vs AReaL's FlexAttention BlockMask; forward on a CPU,
where FlexAttention has no backward), ``logprobs`` (fused log-probs:
clawfast vs Cut Cross-Entropy on the CPU), ``gae`` (clawfast's tree GAE vs verl's
``compute_gae_advantage_return`` on chains and, per path, on trees), ``importance`` (IS weights and
rollout-correction metrics: clawfast vs verl). Each section first checks that both sides compute
the same thing (tokens, log-probs, advantages, metrics within a stated tolerance) and fails if not;
only then it times both: medians after a warm-up, peak extra resident memory of one call
(``bench/memory.py``), and the ratio (``speedup`` = peer time / our time, ``mem_ratio`` = our
memory / the peer's). A section whose peer is not importable here says so and does not run.

Prints one table; writes JSON to ``--out`` (default bench/results/bench_peers.json). Exit status 1
when a section's check failed or a peer was missing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

SECTIONS = ("packing", "attention", "logprobs", "gae", "importance")
COLUMNS = ("section", "case", "shape", "ours_s", "peer_s", "speedup", "ours_mib", "peer_mib", "mem_ratio",
           "max_diff", "tol")


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "" if x is None else str(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_peers.json")
    args = ap.parse_args(argv)
    report = {"bench": "bench_peers", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": args.quick,
              "machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.executable, "sections": {}}
    for name in args.sections:
        start = time.monotonic()
        try:
            rows = importlib.import_module(name).run(args.quick)
            section = {"status": "ok", "rows": rows}
        except ModuleNotFoundError as exc:
            section = {"status": "missing", "rows": [],
                       "note": f"{exc.name} is not importable by {sys.executable}: run bash bench/peers/setup.sh and "
                               "this script with ~/.cache/clawfast/venv-peers/bin/python"}
        except AssertionError as exc:  # the two sides disagree: no timing is worth reporting
            section = {"status": "failed", "rows": [], "note": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a peer's crash is this section's result, the rest still run
            section = {"status": "failed", "rows": [], "note": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}
        section["seconds"] = time.monotonic() - start
        report["sections"][name] = section
        print(f"  {name}: {section['status']} in {section['seconds']:.1f} s"
              + (f" - {section['note']}" if section.get("note") else ""), flush=True)

    print(" | ".join(COLUMNS + ("peer", "note")))
    for name, section in report["sections"].items():
        for row in section["rows"]:
            print(" | ".join([name] + [_cell(row.get(c)) for c in COLUMNS[1:]] + [row["peer"], row.get("note", "")]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    bad = [n for n, s in report["sections"].items() if s["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""`clawfast plot RUN_DIR [--out PNG]`: the run's curves (train and eval metrics) as a PNG.

Reads ``RUN_DIR/metrics.jsonl``; writes ``RUN_DIR/curves.png`` unless ``--out`` says otherwise.
Exit status: 0 on success, 2 when there is nothing to plot or matplotlib is not installed.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")


def run(args: argparse.Namespace) -> int:
    from clawfast.train.plot import plot_run

    try:
        path = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"clawfast plot: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0

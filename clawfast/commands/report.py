"""`clawfast report`: a finished (or running) run's evals side by side.

    clawfast report RUN_DIR

pass@1 before training, after the cold start, at each evaluated step and after training: overall,
per difficulty and per task, with rollouts, seed and harnesses, then the gains (after - before, and
after - cold start: what RL added). Exit status: 0, or 2 when RUN_DIR holds no eval.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR")


def run(args: argparse.Namespace) -> int:
    from clawfast.train.report import run_table

    try:
        print(run_table(args.run_dir))
    except (ValueError, FileNotFoundError) as exc:
        print(f"clawfast report: {exc}", file=sys.stderr)
        return 2
    return 0

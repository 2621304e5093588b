"""`clawfast train`: run (or resume) an RL training run described by a TOML config.

    clawfast train CONFIG [--resume] [--run-dir DIR] [--set KEY=VALUE ...] [--no-progress]

`--set` overrides any config field (``--set steps=3 --set rollout.concurrency=2``; values in TOML
syntax; relative paths are the working directory's; ``none`` sets a setting documented with a None
meaning). `--resume` continues from the run directory's latest checkpoint (model, optimizer moments,
step, data position, RNG states; the optimizer's lr, betas, eps and weight decay are the config's,
so a resumed run may change them; a run directory without a checkpoint yet starts at step 0, saying
so); without it a run directory that holds checkpoints is refused.
Exit status: 0 when the run finished, 2 on a bad config (refused before the first step), 1 on a run
that failed (with its traceback) and on a follower whose rank 0 failed.

With ``distributed.fsdp = true`` launch it once per process with torchrun (rank 0 prints the
summary; see clawfast.train.distributed):

    torchrun --nproc-per-node 8 -m clawfast.cli train CONFIG
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config (see examples/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint of run_dir (none yet: start at step 0, and say so)")
    parser.add_argument("--run-dir", default=None, help="override run_dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live view")


def run(args: argparse.Namespace) -> int:
    from clawfast.train.config_file import ConfigError, load_config
    from clawfast.train.distributed import LeaderFailed
    from clawfast.train.loop import train
    from clawfast.train.report import eval_line

    overrides = list(args.overrides) + ([f"run_dir={json.dumps(args.run_dir)}"] if args.run_dir else [])
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"clawfast train: {exc}", file=sys.stderr)
        return 2
    try:
        summary = train(config, resume=args.resume, progress=not args.no_progress)
    except ValueError as exc:
        print(f"clawfast train: {exc}", file=sys.stderr)
        return 2
    except LeaderFailed as exc:
        print(f"clawfast train: {exc}", file=sys.stderr)
        return 1
    if summary.get("rank", 0) != 0:
        return 0  # an FSDP follower: rank 0 reports the run
    # Without the live display the loop already printed each eval as it finished.
    shown = {"eval_before": "before", "eval_coldstart": "after cold start", "eval_after": "after"}
    for key, label in shown.items() if not args.no_progress else ():
        if key in summary:
            print(eval_line(label, summary[key]))
    print(f"steps done: {summary['steps']}; run directory: {summary['run_dir']}")
    if summary.get("curves"):
        print(f"curves: {summary['curves']}")
    return 0

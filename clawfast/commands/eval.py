"""`clawfast eval`: pass@1 and mean score of a checkpoint on the eval split, per harness, suite,
difficulty, category (and per task with ``--json``), with the tasks judged and not judged and the
grader errors by task.

    clawfast eval CONFIG --checkpoint DIR [--split eval|train] [--samples K] [--set KEY=VALUE ...] [--json]

DIR is a checkpoint directory (``<run_dir>/checkpoints/step-N``), a run directory (its latest
checkpoint), or any Hugging Face model directory. The harnesses, sandbox, engine and sampling
(``eval.temperature``, ``eval.samples_per_task``) and the judge of rubrics (``eval.judge``) come from
CONFIG. Records are written under ``<DIR>/eval-<time>/`` (or ``--out``), with ``scores.jsonl``: each
rollout's score, judge prompt and verdict. pass@1 and the mean score count the rollouts whose every
part was scored; those of tasks with a rubric that no judge scored are counted as not judged (see
`clawfast.tasks.scoring`). Exit status: 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Sub-score names are mostly a task's own: a suite of many tasks has too many to print them all.
SHOWN_SUBSCORES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config (harnesses, tasks, engine, eval settings)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint, run directory or HF model directory")
    parser.add_argument("--split", choices=("train", "eval"), default=None, help="override eval.split")
    parser.add_argument("--samples", type=int, default=None, help="override eval.samples_per_task")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="where the eval's records go")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")


def model_dir_of(path: Path) -> Path:
    """The HF model directory behind a checkpoint, a run directory or a model directory."""
    from clawfast.train.checkpoint import latest_checkpoint
    from clawfast.train.lora import ADAPTER_FILE

    latest = latest_checkpoint(path)  # a run directory (its config.json is the run's, not a model's)
    for checkpoint in (path, latest):
        if checkpoint is not None and (checkpoint / ADAPTER_FILE).is_file():
            raise ValueError(f"{checkpoint} holds a LoRA adapter, not a model: merge it into its base first "
                             f"(clawfast model merge {checkpoint} --out DIR) and evaluate DIR")
    if (path / "model" / "config.json").is_file():  # a checkpoint
        return path / "model"
    if latest is not None:
        return latest / "model"
    if (path / "config.json").is_file() and "model_type" in json.loads((path / "config.json").read_text()):
        return path
    raise ValueError(f"{path}: not a checkpoint, a run directory with checkpoints, or a model directory")


def run(args: argparse.Namespace) -> int:
    from clawfast.train.config_file import ConfigError, load_config
    from clawfast.train.loop import check_evaluable, evaluate

    overrides = list(args.overrides)
    if args.split:
        overrides.append(f'eval.split="{args.split}"')
    if args.samples is not None:
        overrides.append(f"eval.samples_per_task={args.samples}")
    try:
        config = load_config(args.config, overrides=overrides)
        model_dir = model_dir_of(Path(args.checkpoint))
        check_evaluable(config, model_dir)
    except (ConfigError, ValueError) as exc:
        print(f"clawfast eval: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.checkpoint) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    metrics = evaluate(config, model_dir, out)
    if args.json:
        print(json.dumps(metrics, indent=2, sort_keys=True))
        return 0
    print(f"model {model_dir}  suite {config.tasks.suite}  split {config.eval.split}  "
          f"{int(metrics.get('rollouts_all', 0))} rollouts")
    print(f"pass@1 {metrics.get('pass@1', 0.0):.3f}  mean score {metrics.get('reward/mean', 0.0):.3f}  "
          f"over {int(metrics.get('rollouts', 0))} scored rollouts")
    print(f"judged {int(metrics['judged'])}  not judged {int(metrics['not_judged'])}  judge errors "
          f"{int(metrics['judge_errors'])}  (tasks with a rubric; not judged and judge errors are not in pass@1)")
    errors = {k.split("/", 1)[1]: int(v) for k, v in metrics.items() if k.startswith("grader_errors_task/")}
    print(f"grader errors {sum(errors.values())}" + (": " + ", ".join(f"{t} {n}" for t, n in errors.items())
                                                      if errors else ""))
    for title, pass_prefix, reward_prefix in (("harness", "pass@1/", "reward/"),
                                               ("suite", "pass@1_suite/", "reward_suite/"),
                                               ("difficulty", "pass@1_difficulty/", "reward_difficulty/"),
                                               ("category", "pass@1_category/", "reward_category/")):
        rows = [(k[len(pass_prefix):], v, metrics.get(reward_prefix + k[len(pass_prefix):], 0.0))
                for k, v in sorted(metrics.items()) if k.startswith(pass_prefix)]
        if rows:
            print(f"  per {title:<12} {'pass@1':>7} {'score':>7}")
            for name, p, r in rows:
                print(f"    {name:<22} {p:7.3f} {r:7.3f}")
    subscores = [f"{k[9:]} {v:.3f}" for k, v in sorted(metrics.items()) if k.startswith("subscore/")]
    if subscores:
        more = f", and {len(subscores) - SHOWN_SUBSCORES} more (--json)" if len(subscores) > SHOWN_SUBSCORES else ""
        print(f"mean sub-scores: {', '.join(subscores[:SHOWN_SUBSCORES])}{more}")
    statuses = ", ".join(f"{k[7:]} {int(v)}" for k, v in sorted(metrics.items()) if k.startswith("status/"))
    print(f"statuses: {statuses}  (per task: --json)")
    return 0

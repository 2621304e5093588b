"""Training-step time against the micro-batch budget (``optim.micro_batch_tokens``), on a run's own
data.

Takes a config and a directory of captured rollouts (e.g. ``RUN_DIR/records`` of a finished run),
builds the config's policy (``model.path``, ``model.dtype``, ``model.attention``) and times one
full `train_step` (prepare, forward + backward over the micro-batches, clipping, AdamW) per budget,
interleaved over repetitions, median reported. Baseline: the first budget given. Prints per budget
the micro-batches, packed rows, re-included context rows, seconds and the speed-up over the
baseline, which is how the examples' budgets were chosen (bench/RESULTS.md).

    python bench/bench_budget.py CONFIG ROLLOUTS_DIR [--budgets 4096 8192 16384 32768] [--repeats 3]

Rollouts are taken in groups of ``--group`` consecutive files (one GRPO step's worth; rollouts of
one task share their group key, so the step sees real groups).
Writes bench/results/bench_budget.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from clawfast.records import read_rollouts
from clawfast.train.config_file import load_config
from clawfast.train.build import build_optimizer, build_policy, resolve_model_dir
from clawfast.train.prepare import prepare_step
from clawfast.train.step import train_step
from clawfast.train.step_config import step_config

RESULTS = Path(__file__).resolve().parent / "results" / "bench_budget.json"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("rollouts", type=Path, help="a directory of captured rollouts (.cfr)")
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--group", type=int, default=32, help="rollouts per timed step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    rollouts = [r for r in read_rollouts(args.rollouts) if r.calls][: args.group]
    if not rollouts:
        raise SystemExit(f"{args.rollouts}: no rollout with calls")
    base = build_policy(config, resolve_model_dir(config))
    step = step_config(config)
    longest = max(len(c.prompt_ids) + len(c.output_ids) for r in rollouts for c in r.calls)
    budgets = [b for b in args.budgets if b >= longest]
    if len(budgets) < len(args.budgets):
        print(f"budgets below the longest call ({longest} tokens) skipped: "
              f"{sorted(set(args.budgets) - set(budgets))}")
    rows = {b: {"times_s": []} for b in budgets}
    for b in budgets:  # warm-up, untimed: first-call allocations would otherwise land on the first budget
        warm = copy.deepcopy(base)
        train_step(warm, build_optimizer(config, warm), rollouts, None,
                   step.model_copy(update={"micro_batch_tokens": b}))
    for _ in range(args.repeats):
        for b in budgets:
            policy = copy.deepcopy(base)
            m = train_step(policy, build_optimizer(config, policy), rollouts, None,
                           step.model_copy(update={"micro_batch_tokens": b}))
            rows[b]["times_s"].append(m["time_total_s"])
    for b in budgets:
        batches = prepare_step(rollouts, None, step.model_copy(update={"micro_batch_tokens": b})).batches
        rows[b].update(median_s=statistics.median(rows[b]["times_s"]), micro_batches=len(batches),
                       rows=sum(x.num_tokens for x in batches),
                       context_rows=int(sum(x.is_context.sum() for x in batches)))
    first = rows[budgets[0]]
    print(f"{len(rollouts)} rollouts from {args.rollouts}, model {config.model.path} ({config.model.dtype}, "
          f"attention {config.model.attention}), {args.threads} thread(s), median of {args.repeats}")
    print(f"{'budget':>10} {'batches':>8} {'rows':>8} {'context':>8} {'median s':>9} {'vs first':>9}")
    for b, r in rows.items():
        r["speedup_vs_first"] = first["median_s"] / r["median_s"]
        print(f"{b:>10} {r['micro_batches']:>8} {r['rows']:>8} {r['context_rows']:>8} {r['median_s']:>9.3f} "
              f"{r['speedup_vs_first']:>8.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": str(args.config), "rollouts": str(args.rollouts), "num_rollouts": len(rollouts),
        "repeats": args.repeats, "threads": args.threads, "attention": config.model.attention,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "budgets": {str(b): r for b, r in rows.items()}}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The asynchronous loop against the synchronous one (the named baseline), same workload, one process.

Workload: `clawfast.train.loop.train` with the torch engine serving the trained policy (a Qwen3 of
4 layers, hidden 128, vocabulary 64, built here), GRPO, 4 tasks x 4 samples per step, rollouts from
`clawfast.train.sampled.EngineRollouts`: each rollout three calls of --max-tokens tokens (48: long
enough that pushes land while calls decode) shaped like a harness session, with "tool time" between calls that differs 5x across tasks (0.1 s to 0.5 s: the
harness side that a real sandboxed tool call spends), and a reward rule on the sampled tokens (the
fraction in a fixed set of 6 of the 64, so it starts near 0.1 and can be learned).

Modes: ``sync`` (``algorithm.max_staleness`` unset: a step waits for all its rollouts, then
trains, then pushes), ``async-k/<on_update>`` for each --staleness k (groups run up to k steps
ahead) and each --on-update (what the calls in flight at a push do: ``finish`` on the old weights
while the push waits, the named baseline; ``abort`` and run again; ``continue`` on the new weights).
Reported per mode: rollouts trained per minute of loop time, the trainer's idle fraction (time
waiting for rollouts over loop time), the engine's idle fraction (1 - generating time over loop
time), the trainer's mean stall per push (``time/sync_s``), decoded tokens thrown away per push
(aborts) and calls continued per push, prompt tokens the engine ran per rollout (the rest came from
its prefix cache; ``replayed``: those of calls continued across a push, their KV rebuilt), stale
groups dropped, and the mean reward of the first and last quarter of the steps (reward per step:
the async loop must learn as fast per step), plus reward against wall time.
Loop time runs from the first step's start to the last step's end (metrics timestamps), so model
loading is not counted. Writes bench/results/bench_async.json.

    python bench/bench_async.py [--steps 16] [--staleness 1 2] [--on-update finish abort continue]
                                [--max-tokens 48] [--repeats 1] [--out FILE]

With --repeats R every mode runs R times, all modes in turn each time; each figure is the mean over
the repeats, and a ratio the mean of the per-repeat ratios (the runs of one repeat ran back to back,
under the same load), its range beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from clawfast.train.config_file import load_config
from clawfast.train.loop import train
from clawfast.train.sampled import EngineRollouts, TokenTask
from sampled_runs import make_model, run_config  # bench/: the script's own folder

RESULTS = Path(__file__).parent / "results" / "bench_async.json"
GOOD = np.arange(10, 16)


def reward(outputs: list[np.ndarray]) -> float:
    tokens = np.concatenate(outputs)
    return float(np.isin(tokens, GOOD).mean()) if tokens.size else 0.0


def tasks(n: int = 8) -> dict[str, TokenTask]:
    # Tool time 0.1 s .. 0.5 s per call: a 5x spread of task lengths.
    return {f"t{i}": TokenTask(f"t{i}", prompt=tuple(int(x) for x in 20 + (np.arange(24) * (i + 3)) % 40),
                               reward=reward, turns=3, feedback=(5, 6, 7, 8), delay_s=0.1 + 0.4 * i / (n - 1))
            for i in range(n)}


def run_mode(root: Path, model: Path, steps: int, staleness: int | None, on_update: str, max_tokens: int) -> dict:
    name = "sync" if staleness is None else f"async-{staleness}/{on_update}"
    run_dir = root / name.replace("/", "-")
    toml = root / f"{run_dir.name}.toml"
    algorithm = {} if staleness is None else {"max_staleness": staleness}
    toml.write_text(run_config(run_dir, model, seed=0, steps=steps, algorithm=algorithm, lr=3e-3,
                               micro_batch_tokens=2048, max_tokens=max_tokens, engine={"on_update": on_update}))
    engines = []

    def make_source(engine):
        engines.append(engine)
        return EngineRollouts(engine, tasks(), max_tokens=max_tokens, seed=0)

    t0 = time.monotonic()
    train(load_config(toml), progress=False, make_source=make_source)
    total = time.monotonic() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind") == "train"]
    first = records[0]
    step_time = [r["time/rollout_s"] + r["time/train_s"] + r["time/sync_s"] for r in records]
    loop_s = records[-1]["time"] - first["time"] + step_time[0]
    rewards = [r["reward/mean"] for r in records]
    pushed = [r for r in records if "push/bytes" in r]
    quarter = max(1, len(rewards) // 4)
    return {
        "mode": name,
        "steps": len(records),
        "loop_s": loop_s,
        "total_s": total,
        "rollouts_per_min": 60.0 * sum(r["rollouts"] for r in records) / loop_s,
        "trainer_idle": sum(r["time/rollout_s"] for r in records) / loop_s,
        "engine_idle": 1.0 - engines[0].busy_s / loop_s,
        # Per push: a step that made no update pushes nothing (`clawfast.train.loop`).
        "stall_per_push_s": float(np.mean([r["time/sync_s"] for r in pushed])) if pushed else 0.0,
        "discarded_tokens_per_push": engines[0].discarded_tokens / max(1, len(pushed)),
        "continued_calls_per_push": engines[0].continued_calls / max(1, len(pushed)),
        "prefill_tokens_per_rollout": engines[0].prefill_tokens / sum(r["rollouts"] for r in records),
        "replayed_tokens_per_rollout": engines[0].replayed_tokens / sum(r["rollouts"] for r in records),
        "dropped_stale_groups": sum(r.get("async/dropped_stale_groups", 0.0) for r in records),
        "staleness_mean": float(np.mean([r.get("async/staleness_mean", 0.0) for r in records])),
        "reward_first_quarter": float(np.mean(rewards[:quarter])),
        "reward_last_quarter": float(np.mean(rewards[-quarter:])),
        "reward_vs_wall": [(round(r["time"] - first["time"] + step_time[0], 2), round(x, 3))
                           for r, x in zip(records, rewards)],
    }


NUMERIC = ("loop_s", "total_s", "rollouts_per_min", "trainer_idle", "engine_idle", "stall_per_push_s",
           "discarded_tokens_per_push", "continued_calls_per_push", "prefill_tokens_per_rollout",
           "replayed_tokens_per_rollout", "dropped_stale_groups", "staleness_mean",
           "reward_first_quarter", "reward_last_quarter")


def summary(runs: list[dict]) -> list[dict]:
    """One row per mode: each figure's mean over the repeats, and the rollouts per minute against
    the synchronous loop's and the same staleness's "finish" as the mean of the per-repeat ratios
    (runs of one repeat ran back to back, so a ratio pairs runs under the same machine load)."""
    modes = list(dict.fromkeys(run["mode"] for run in runs))
    by = {(run["repeat"], run["mode"]): run for run in runs}
    repeats = sorted({run["repeat"] for run in runs})
    rows = []
    for mode in modes:
        mine = [by[r, mode] for r in repeats]
        finish = mode.split("/")[0] + "/finish"
        row = {"mode": mode, "steps": mine[0]["steps"], "repeats": len(mine),
               **{key: float(np.mean([run[key] for run in mine])) for key in NUMERIC},
               "rollouts_per_min_each": [run["rollouts_per_min"] for run in mine],
               "reward_vs_wall": mine[0]["reward_vs_wall"]}
        for name, other in (("sync", "sync"), ("finish", finish if (repeats[0], finish) in by else mode)):
            ratios = [by[r, mode]["rollouts_per_min"] / by[r, other]["rollouts_per_min"] for r in repeats]
            row[f"ratio_vs_{name}"] = float(np.mean(ratios))
            row[f"ratio_vs_{name}_each"] = ratios
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--on-update", nargs="+", default=["finish", "abort", "continue"],
                        choices=["finish", "abort", "continue"])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every mode this many times, the modes in turn each time (ratios pair the runs of one repeat)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_model(root / "model")
        for repeat in range(args.repeats):
            where = root / f"repeat-{repeat}"
            where.mkdir()
            plan = [(None, "finish")] + [(k, on_update) for k in args.staleness for on_update in args.on_update]
            for k, on_update in plan:
                runs.append({"repeat": repeat, **run_mode(where, model, args.steps, k, on_update, args.max_tokens)})
                print(f"  repeat {repeat + 1}/{args.repeats} {runs[-1]['mode']}: "
                      f"{runs[-1]['rollouts_per_min']:.1f} rollouts/min", flush=True)
    rows = summary(runs)
    print(f"{'mode':<17} {'rollouts/min':>12} {'x sync':>7} {'x finish':>8} {'trainer idle':>12} {'engine idle':>11} "
          f"{'stall/push s':>12} {'discarded/push':>14} {'continued/push':>14} {'prefill/rollout':>15} {'dropped':>7} {'lag':>5} "
          f"{'reward 1st/last quarter':>24}")
    for row in rows:
        spread = (f" ({min(row['ratio_vs_finish_each']):.2f}-{max(row['ratio_vs_finish_each']):.2f})"
                  if args.repeats > 1 else "")
        print(f"{row['mode']:<17} {row['rollouts_per_min']:>12.1f} {row['ratio_vs_sync']:>6.2f}x "
              f"{row['ratio_vs_finish']:>7.2f}x{spread} {row['trainer_idle']:>12.2f} {row['engine_idle']:>11.2f} "
              f"{row['stall_per_push_s']:>12.3f} {row['discarded_tokens_per_push']:>14.1f} "
              f"{row['continued_calls_per_push']:>14.1f} {row['prefill_tokens_per_rollout']:>15.1f} "
              f"{row['dropped_stale_groups']:>7.1f} "
              f"{row['staleness_mean']:>5.2f} {row['reward_first_quarter']:>11.3f} / {row['reward_last_quarter']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "processor": platform.processor(),
                                    "date": time.strftime("%Y-%m-%d"), "max_tokens": args.max_tokens,
                                    "repeats": args.repeats, "rows": rows, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

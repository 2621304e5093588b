"""The asynchronous loop against the synchronous one (the named baseline), same workload, one process.

Workload: `clawfast.train.loop.train` with the torch engine serving the trained policy (a Qwen3 of
4 layers, hidden 128, vocabulary 64, built here), GRPO, 4 tasks x 4 samples per step, rollouts from
`clawfast.train.sampled.EngineRollouts`: each rollout three calls of 12 tokens shaped like a
harness session, with "tool time" between calls that differs 5x across tasks (0.1 s to 0.5 s: the
harness side that a real sandboxed tool call spends), and a reward rule on the sampled tokens (the
fraction in a fixed set of 6 of the 64, so it starts near 0.1 and can be learned).

Modes: ``sync`` (``algorithm.max_staleness`` unset: a step waits for all its rollouts, then
trains, then pushes), ``async-k`` for each --staleness k (groups run up to k steps ahead).
Reported per mode: rollouts trained per minute of loop time, the trainer's idle fraction (time
waiting for rollouts over loop time), the engine's idle fraction (1 - generating time over loop
time), stale groups dropped, and the mean reward of the first and last quarter of the steps
(reward per step: the async loop must learn as fast per step), plus reward against wall time.
Loop time runs from the first step's start to the last step's end (metrics timestamps), so model
loading is not counted. Writes bench/results/bench_async.json.

    python bench/bench_async.py [--steps 16] [--staleness 1 2] [--out FILE]
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


def run_mode(root: Path, model: Path, steps: int, staleness: int | None) -> dict:
    name = "sync" if staleness is None else f"async-{staleness}"
    toml = root / f"{name}.toml"
    algorithm = {} if staleness is None else {"max_staleness": staleness}
    toml.write_text(run_config(root / name, model, seed=0, steps=steps, algorithm=algorithm, lr=3e-3,
                               micro_batch_tokens=1024))
    engines = []

    def make_source(engine):
        engines.append(engine)
        return EngineRollouts(engine, tasks(), max_tokens=12, seed=0)

    t0 = time.monotonic()
    train(load_config(toml), progress=False, make_source=make_source)
    total = time.monotonic() - t0
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind") == "train"]
    first = records[0]
    step_time = [r["time/rollout_s"] + r["time/train_s"] + r["time/sync_s"] for r in records]
    loop_s = records[-1]["time"] - first["time"] + step_time[0]
    rewards = [r["reward/mean"] for r in records]
    quarter = max(1, len(rewards) // 4)
    return {
        "mode": name,
        "steps": len(records),
        "loop_s": loop_s,
        "total_s": total,
        "rollouts_per_min": 60.0 * sum(r["rollouts"] for r in records) / loop_s,
        "trainer_idle": sum(r["time/rollout_s"] for r in records) / loop_s,
        "engine_idle": 1.0 - engines[0].busy_s / loop_s,
        "dropped_stale_groups": sum(r.get("async/dropped_stale_groups", 0.0) for r in records),
        "staleness_mean": float(np.mean([r.get("async/staleness_mean", 0.0) for r in records])),
        "reward_first_quarter": float(np.mean(rewards[:quarter])),
        "reward_last_quarter": float(np.mean(rewards[-quarter:])),
        "reward_vs_wall": [(round(r["time"] - first["time"] + step_time[0], 2), round(x, 3))
                           for r, x in zip(records, rewards)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_model(root / "model")
        rows = [run_mode(root, model, args.steps, None)]
        rows += [run_mode(root, model, args.steps, k) for k in args.staleness]
    base = rows[0]
    print(f"{'mode':<9} {'rollouts/min':>12} {'x sync':>7} {'trainer idle':>12} {'engine idle':>11} "
          f"{'dropped':>7} {'lag':>5} {'reward 1st/last quarter':>24}")
    for row in rows:
        row["ratio_vs_sync"] = row["rollouts_per_min"] / base["rollouts_per_min"]
        print(f"{row['mode']:<9} {row['rollouts_per_min']:>12.1f} {row['ratio_vs_sync']:>6.2f}x "
              f"{row['trainer_idle']:>12.2f} {row['engine_idle']:>11.2f} {row['dropped_stale_groups']:>7.0f} "
              f"{row['staleness_mean']:>5.2f} {row['reward_first_quarter']:>11.3f} / {row['reward_last_quarter']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "processor": platform.processor(),
                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

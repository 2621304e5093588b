"""Training every thread against training the main thread only (the named baseline: the paper's and
every peer's choice), same workload, one process.

Workload: `clawfast.train.loop.train` with the torch engine serving the trained policy (a Qwen3 of
4 layers, hidden 128, vocabulary 64, built here), GRPO, 4 tasks x 4 samples per step, rollouts from
`clawfast.train.sampled.EngineRollouts` in the side-thread shape (`SideThreads`): per rollout a main
call, a subagent with its own prompt, the main call that reads the subagent's answer back, a
compaction call and the main thread restarted from the summary, 12 tokens each; the subagent and the
summary sample 2 of the 5 calls' tokens. Two rewards (--workloads), each the fraction of the
rollout's tokens that are right, so each starts near 0.1:

- ``shared``: right = in a fixed set of 6 of the 64 tokens, in every thread. One skill: what the
  main thread learns carries over to the side threads through the shared weights.
- ``split``: the main thread's right set is that one, the side threads' is another 6: the side
  threads must learn to do their own part, which training the main thread alone cannot teach.
- ``side``: only the side threads' tokens count (right: in the side set): the task is done by the
  subagent and the summary alone, as when the main thread only delegates.

Modes: ``main`` (``train_threads = ["main"]``) and ``all`` (main, subagent, compaction), each with
every --seeds seed and workload (the seed of the model's initial weights, the sampling and the data order).
Reported per run: the reward per step, for each of --levels the first step whose reward, averaged
over it and the two before, reaches it (None: not within --steps), the targets trained per thread kind, and the
calls per kind `clawfast.threads` found (the shape says 3 main, 1 subagent, 1 compaction per rollout:
a misread thread would show here). Writes bench/results/bench_train_threads.json.

    python bench/bench_train_threads.py [--steps 40] [--seeds 0 1] [--workloads shared split]
                                        [--levels 0.3 0.5 0.7 0.9] [--out FILE]
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
from clawfast.train.sampled import SIDE_THREAD_KINDS, EngineRollouts, SideThreads, TokenTask
from sampled_runs import make_model, run_config  # bench/: the script's own folder

RESULTS = Path(__file__).parent / "results" / "bench_train_threads.json"
GOOD = np.arange(10, 16)
SIDE_GOOD = np.arange(16, 22)
MODES = {"main": ["main"], "all": ["main", "subagent", "compaction"]}


def shared_reward(outputs: list[np.ndarray]) -> float:
    tokens = np.concatenate(outputs)
    return float(np.isin(tokens, GOOD).mean()) if tokens.size else 0.0


def split_reward(outputs: list[np.ndarray]) -> float:
    right = [np.isin(out, GOOD if kind == "main" else SIDE_GOOD) for kind, out in zip(SIDE_THREAD_KINDS, outputs)]
    right = np.concatenate(right)
    return float(right.mean()) if right.size else 0.0


def side_reward(outputs: list[np.ndarray]) -> float:
    side = [np.isin(out, SIDE_GOOD) for kind, out in zip(SIDE_THREAD_KINDS, outputs) if kind != "main"]
    return float(np.concatenate(side).mean()) if side else 0.0


REWARDS = {"shared": shared_reward, "split": split_reward, "side": side_reward}


def tasks(reward, n: int = 8) -> dict[str, TokenTask]:
    out = {}
    for i in range(n):
        prompt = tuple(int(x) for x in 20 + (np.arange(24) * (i + 3)) % 40)
        shape = SideThreads(subagent=prompt[:4] + tuple(int(x) for x in 20 + (np.arange(16) * (i + 5)) % 37),
                            compact=(3, 4, 60, 61, 62, 3, 5), restart=prompt[:16] + (3, 4, 63))
        out[f"t{i}"] = TokenTask(f"t{i}", prompt=prompt, reward=reward, feedback=(5, 6, 7, 8), threads=shape)
    return out


def steps_to(rewards: list[float], level: float) -> int | None:
    """The first step (1-based) whose reward averaged with the two steps before reaches `level`."""
    for i in range(len(rewards)):
        if np.mean(rewards[max(0, i - 2): i + 1]) >= level:
            return i + 1
    return None


def run(root: Path, workload: str, mode: str, seed: int, steps: int, levels: list[float], lr: float,
        algorithm: str) -> dict:
    name = f"{workload}-{mode}-seed{seed}"
    model = make_model(root / f"model-{seed}", seed)
    toml = root / f"{name}.toml"
    toml.write_text(run_config(root / name, model, seed=seed, steps=steps, lr=lr, micro_batch_tokens=2048,
                               algorithm={"name": algorithm, "train_threads": MODES[mode]}))
    t0 = time.monotonic()
    train(load_config(toml), progress=False,
          make_source=lambda engine: EngineRollouts(engine, tasks(REWARDS[workload]), max_tokens=12, seed=seed))
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind") == "train"]
    rewards = [r["reward/mean"] for r in records]

    def total(key: str) -> float:
        return float(sum(r.get(key, 0.0) for r in records))

    kinds = ("main", "subagent", "compaction")
    row = {
        "algorithm": algorithm,
        "workload": workload,
        "mode": mode,
        "seed": seed,
        "train_threads": MODES[mode],
        "steps": len(records),
        "seconds": time.monotonic() - t0,
        "rewards": [round(x, 4) for x in rewards],
        "reward_first3": float(np.mean(rewards[:3])),
        "reward_last3": float(np.mean(rewards[-3:])),
        "steps_to": {str(level): steps_to(rewards, level) for level in levels},
        "targets": {k: total(f"threads/{k}/targets") for k in kinds},
        "calls": {k: total(f"threads/{k}/calls") for k in kinds},
        "rollouts": total("rollouts"),
    }
    print(f"{name:<20} reward {row['reward_first3']:.3f} -> {row['reward_last3']:.3f}  steps to {row['steps_to']}  "
          f"targets {row['targets']}  calls {row['calls']}  ({row['seconds']:.0f} s)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workloads", nargs="+", choices=list(REWARDS), default=list(REWARDS))
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9],
                        help="the reward levels whose steps are compared")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            for seed in args.seeds:
                for mode in MODES:
                    rows.append(run(Path(tmp), workload, mode, seed, args.steps, args.levels, args.lr,
                                    args.algorithm))
    print(f"\n{'workload':<8} {'seed':>4} {'mode':<5} {'reward first 3 -> last 3':>25}  "
          + " ".join(f"{'to ' + str(v):>7}" for v in args.levels))
    for row in rows:
        print(f"{row['workload']:<8} {row['seed']:>4} {row['mode']:<5} {row['reward_first3']:>15.3f} -> "
              f"{row['reward_last3']:.3f}  " + " ".join(f"{str(row['steps_to'][str(v)]):>7}" for v in args.levels))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "processor": platform.processor(),
                                    "date": time.strftime("%Y-%m-%d"), "levels": args.levels, "lr": args.lr, "algorithm": args.algorithm,
                                    "rows": rows},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

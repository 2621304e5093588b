"""Trainer-sampler mismatch of a mixture-of-experts policy against a dense one, with routing replay off and on.

Two tiny models of about one size, random weights from a seed: the dense Qwen3 of the learning
benchmarks (`sampled_runs.make_model`: 4 layers, hidden 128, vocabulary 64) and a Qwen3-MoE of the
same shape whose MLPs are 8 experts of width 64, 2 per token (both initialised with transformers'
default range, 0.02). Each runs `clawfast.train.loop.train`
(GRPO, 4 tasks x 4 samples a step, `EngineRollouts` with the reward of bench/bench_async.py,
--steps steps) with the torch engine serving in bfloat16 while the trainer computes in float32, and
again with the engine in float32 (the named baseline: trainer and sampler then differ by rounding
only); the MoE also with ``algorithm.routing_replay = "all"`` (the engine records the experts it chose,
the trainer uses them). Reported per model, engine dtype and replay, as the mean over the steps: ``mismatch_k3`` (the KL
estimate between sampler and trainer per target), ``is_ratio_std`` (the spread of the IS ratios),
``mismatch_log_ppl_abs_diff``. For the MoE, also the router flip rate: on --probe sampled
continuations of the run's trained model (its last checkpoint), the share of (generated token, MoE
layer) pairs whose top-2 experts differ between the model run in bfloat16 and in float32 on the same
tokens (measured alike after each run without replay): the mismatch that routing replay removes and
importance weights only correct for.

    python bench/bench_moe_mismatch.py [--steps 6] [--probe 64]
Writes bench/results/bench_moe_mismatch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from clawfast.moe_routing import ExpertRouting
from clawfast.train.checkpoint import latest_checkpoint
from clawfast.train.config_file import load_config
from clawfast.train.loop import train
from clawfast.train.sampled import EngineRollouts
from bench_async import tasks  # bench/: the script's own folder
from sampled_runs import make_model, run_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_moe import tiny_moe  # noqa: E402  (the tests' MoE builder: one definition of the tiny MoE)

RESULTS = Path(__file__).parent / "results" / "bench_moe_mismatch.json"
METRICS = ("mismatch_k3", "is_ratio_std", "mismatch_log_ppl_abs_diff")


def make_moe(path: Path, seed: int = 0) -> Path:
    # transformers' default initializer range, as the dense model's
    tiny_moe("qwen3_moe", vocab_size=64, hidden=128, layers=4, seed=seed, max_len=512, init=0.02,
             tie_word_embeddings=True).save_pretrained(path)
    return path


def run(root: Path, model: Path, name: str, engine_dtype: str, steps: int, replay: str = "off") -> dict:
    run_dir = root / name
    toml = root / f"{name}.toml"
    toml.write_text(run_config(run_dir, model, seed=0, steps=steps, algorithm={"routing_replay": replay}, lr=3e-3,
                               micro_batch_tokens=2048, max_tokens=24, engine={"dtype": engine_dtype}))
    t0 = time.monotonic()
    train(load_config(toml), progress=False,
          make_source=lambda engine: EngineRollouts(engine, tasks(), max_tokens=24, seed=0))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind") == "train"]
    row = {"run": name, "engine_dtype": engine_dtype, "replay": replay, "steps": len(records),
           "wall_s": round(time.monotonic() - t0, 1)}
    row.update({m: float(np.mean([r[m] for r in records])) for m in METRICS})
    row["checkpoint"] = str(latest_checkpoint(run_dir) / "model")
    return row


def router_choices(routing: ExpertRouting, model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """The experts each MoE layer picks for every position of `ids` ([1, T]): [T, layers, k], each
    row sorted (a set of experts); `routing` is the model's `ExpertRouting`."""
    with routing.recorded(), torch.no_grad():
        model(input_ids=ids)
    return np.sort(routing.take(), axis=-1)


def flip_rate(model_dir: str, probes: int) -> dict:
    """Sample `probes` continuations in bfloat16 (the torch engine, as the runs serve), then compare
    the experts each layer picks at the rows that predicted the sampled tokens, bf16 vs float32."""
    from transformers import AutoModelForCausalLM

    from clawfast.engines.base import SamplingParams
    from clawfast.engines.torch_engine import TorchEngine

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    engine = TorchEngine(bf16, seed=0, max_batch=16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 60, size=int(n)) for n in rng.integers(8, 32, size=probes)]

    async def sample():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=24, temperature=1.0, seed=i))
                                      for i, p in enumerate(prompts)))

    gens = asyncio.run(sample())
    flips = total = 0
    bf16_routing, fp32_routing = ExpertRouting(bf16), ExpertRouting(fp32)
    for prompt, gen in zip(prompts, gens):
        ids = torch.as_tensor(np.concatenate([prompt, gen.output_ids]), dtype=torch.long)[None]
        rows = slice(len(prompt) - 1, len(prompt) - 1 + len(gen.output_ids))  # rows that predicted a sampled token
        a = router_choices(bf16_routing, bf16, ids)[rows]
        b = router_choices(fp32_routing, fp32, ids)[rows]
        flips += int((a != b).any(axis=-1).sum())
        total += a.shape[0] * a.shape[1]
    return {"router_flip_rate": flips / max(total, 1), "router_decisions": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--probe", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {"dense": make_model(root / "dense"), "moe": make_moe(root / "moe")}
        for name, model in models.items():
            for replay in ("off", "all") if name == "moe" else ("off",):
                for dtype in ("float32", "bfloat16"):
                    rows.append(run(root, model, f"{name}-{dtype}-{replay}", dtype, args.steps, replay))
                    if name == "moe" and replay == "off":
                        rows[-1].update(flip_rate(rows[-1]["checkpoint"], args.probe))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "checkpoint"}), flush=True)
    for row in rows:
        row.pop("checkpoint")
    print(f"{'run':<20} {'mismatch_k3':>12} {'is_ratio_std':>12} {'|log-ppl diff|':>14} {'router flips':>12}")
    for row in rows:
        flips = f"{row['router_flip_rate']:.4f}" if "router_flip_rate" in row else "-"
        print(f"{row['run']:<20} {row['mismatch_k3']:>12.2e} {row['is_ratio_std']:>12.2e} "
              f"{row['mismatch_log_ppl_abs_diff']:>14.2e} {flips:>12}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
                                    "steps": args.steps, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

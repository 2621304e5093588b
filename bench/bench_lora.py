"""LoRA against full fine-tuning on the quickstart's model (SmolLM2-135M): what one GRPO step holds in
memory, how long it takes, and what a weight push moves.

Each variant runs in a process of its own (so one's memory cannot hide in the other's): the policy
as a run builds it (`clawfast.train.build.build_policy`, float32, ``model.lora`` set or not), AdamW
as a run builds it, then `train_step` on the same synthetic GRPO group (4 rollouts of 8 calls, at
most 512 prompt tokens, the model's vocabulary; seed 0), twice (the first step allocates AdamW's
moments). Reported: trainable parameters, optimizer state bytes, the trainer's state (weights +
gradients + moments, counted exactly), the two steps' peak resident memory over the loaded model
(VmHWM, `bench/memory.py`: activations, gradients, moments, and what the CPU allocator keeps), the
second step's seconds, and the bytes of the push after it (full: every tensor of the
model in float32; LoRA: `WeightPusher.push_adapter`'s delta, measured on a torch engine serving the
adapted model). The named baseline is full fine-tuning.

    python bench/bench_lora.py [--ranks 8 16]
Writes bench/results/bench_lora.json.

With ``--vllm`` (run with a python that imports vLLM: on the CPU, ``~/.cache/clawfast/venv-vllm``) it
times instead what a push into a `VLLMEngine` costs, in float32: the full weights (the named
baseline: `WeightPusher.update_weights` over the broadcast path, as a full-fine-tuning run pushes)
against the adapter (`WeightPusher.push_adapter`: files in peft's format, `VLLMEngine.load_adapter`);
the median of `--repeats` pushes after one warm-up, each with freshly moved weights.
Writes bench/results/bench_lora_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "bench_lora.json"


def one(rank: int) -> dict:
    import copy

    import numpy as np
    import torch

    from memory import status_mib
    from clawfast.engines.torch_engine import TorchEngine
    from clawfast.pretrained import prepare_model
    from clawfast.synthetic import group_results, task_group
    from clawfast.train.build import build_optimizer, build_policy
    from clawfast.train.config_file import config_from_dict
    from clawfast.train.push import WeightPusher
    from clawfast.train.step import train_step
    from clawfast.train.step_config import StepConfig

    model_dir = prepare_model("smollm2-135m")
    config = config_from_dict({"model": {"path": str(model_dir), **({"lora": {"rank": rank, "alpha": 2 * rank}}
                                                                    if rank else {})},
                               "optim": {"lr": 1e-5}})
    policy = build_policy(config, model_dir)
    optimizer = build_optimizer(config, policy)
    vocab = policy.lm.config.vocab_size
    rng = np.random.default_rng(0)
    rollouts = group_results(task_group(rng, 4, n_calls=8, max_prompt_tokens=512, vocab_size=vocab),
                             task_id="t", rewards=[1.0, 0.0, 1.0, 0.0])
    step = StepConfig(micro_batch_tokens=8192)
    loaded = status_mib("VmRSS")
    train_step(policy, optimizer, rollouts, None, step)  # allocates AdamW's moments
    t0 = time.perf_counter()
    metrics = train_step(policy, optimizer, rollouts, None, step)
    seconds = time.perf_counter() - t0
    peak = status_mib("VmHWM") - loaded  # the two steps' high-water mark over the loaded model
    moments = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t))
    engine = TorchEngine(copy.deepcopy(policy.lm))
    pusher = WeightPusher(engine, torch.float32, delta=False)
    if rank:
        pusher.push_adapter(policy.lm, 1)
    else:
        pusher.update_weights({k: v.detach() for k, v in policy.lm.state_dict().items()}, 1)
    trainable = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    return {"variant": f"lora r{rank}" if rank else "full",
            "trainable": sum(p.numel() for p in policy.parameters() if p.requires_grad),
            "optimizer_mib": moments / 2**20, "state_mib": (weights + trainable + moments) / 2**20,
            "peak_mib": peak, "step_s": seconds,
            "push_bytes": pusher.last["push/bytes"], "full_bytes": pusher.last["push/full_bytes"],
            "tokens_packed": metrics["tokens_packed"]}


def vllm_pushes(ranks: list[int], repeats: int) -> list[dict]:
    import asyncio
    import statistics

    import torch

    from clawfast.engines.vllm_engine import VLLMEngine
    from clawfast.pretrained import prepare_model
    from clawfast.train.build import build_policy
    from clawfast.train.config_file import config_from_dict
    from clawfast.train.lora import adapter_names
    from clawfast.train.push import WeightPusher, engine_layout

    model_dir = prepare_model("smollm2-135m")
    rows = []
    for rank in [0, *ranks]:
        config = config_from_dict({"model": {"path": str(model_dir), **({"lora": {"rank": rank, "alpha": 2 * rank}}
                                                                        if rank else {})}})
        policy = build_policy(config, model_dir)
        engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20,
                            weight_sync="broadcast", lora_rank=rank or None)
        pusher = WeightPusher(engine, torch.float32, delta=False)
        moved = adapter_names(policy.lm) if rank else [n for n, _ in policy.lm.named_parameters()]
        params = dict(policy.lm.named_parameters())
        seconds = []
        try:
            for version in range(1, repeats + 2):
                with torch.no_grad():  # what an optimizer step does: every trained tensor moves
                    for name in moved:
                        params[name].add_(torch.randn_like(params[name]) * 1e-4)
                t0 = time.perf_counter()
                if rank:
                    pusher.push_adapter(policy.lm, version)
                else:
                    pairs = ((k, v.detach()) for k, v in policy.lm.state_dict().items())
                    pusher.update_weights(dict(engine_layout(pusher, policy.lm, pairs)), version)
                seconds.append(time.perf_counter() - t0)
        finally:
            asyncio.run(engine.close())
        rows.append({"variant": f"lora r{rank}" if rank else "full", "push_s": statistics.median(seconds[1:]),
                     "push_bytes": pusher.last["push/bytes"], "full_bytes": pusher.last["push/full_bytes"]})
        print(json.dumps(rows[-1]), flush=True)
    full = rows[0]
    print(f"{'variant':<10} {'push s':>8} {'push bytes':>12} {'bytes / full':>12} {'full s / push s':>15}")
    for r in rows:
        print(f"{r['variant']:<10} {r['push_s']:>8.3f} {r['push_bytes']:>12,.0f} "
              f"{r['push_bytes'] / full['full_bytes']:>12.4%} {full['push_s'] / r['push_s']:>15.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a variant, in this process
    parser.add_argument("--vllm", action="store_true", help="time pushes into a VLLMEngine instead")
    parser.add_argument("--repeats", type=int, default=3, help="--vllm: pushes timed per variant")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.vllm:
        rows = vllm_pushes(args.ranks, args.repeats)
        out = args.out or RESULTS.with_name("bench_lora_vllm.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
                                   "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")
        return
    args.out = args.out or RESULTS
    if args.one is not None:
        print(json.dumps(one(args.one)), flush=True)
        return
    rows = []
    for rank in [0, *args.ranks]:
        out = subprocess.run([sys.executable, __file__, "--one", str(rank)], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    full = rows[0]
    print(f"{'variant':<10} {'trainable':>12} {'optimizer MiB':>14} {'state MiB':>10} {'peak MiB':>9} "
          f"{'step s':>8} {'push bytes':>12} {'push / full':>11}")
    for r in rows:
        print(f"{r['variant']:<10} {r['trainable']:>12,} {r['optimizer_mib']:>14.1f} {r['state_mib']:>10.1f} "
              f"{r['peak_mib']:>9.1f} {r['step_s']:>8.2f} {r['push_bytes']:>12,.0f} "
              f"{r['push_bytes'] / full['full_bytes']:>11.4%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
                                    "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

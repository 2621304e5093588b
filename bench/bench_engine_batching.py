"""Torch engine batching: continuous vs static batching of calls that arrive over time, in one process.

Setup: SmolLM2-135M-Instruct (the quickstart's model, `clawfast model prepare smollm2-135m`, CPU),
``--requests`` calls shaped like one quickstart eval turn (`bench_engine_generate.prompts_of`: the
mini-swe-agent system prompt and bash tool rendered by the model's chat template, then a held-out
task's instruction), arriving ``--gap`` seconds apart as a harness's calls do, greedy, no stop
token; every other call asks for ``--max-tokens`` new tokens and the rest for a quarter of that
(a tool call, then a short submit).

- ``continuous`` (the engine): a call arriving while a batch decodes joins it at the next step, and a
  call that ends leaves and is answered at once.
- ``static`` (baseline, the engine's former batching: ``TorchEngine(continuous=False)``): a running
  batch admits nothing; calls that arrive meanwhile wait for it to end.

Reported: the makespan (first arrival to last answer) and the mean latency (arrival to answer).
Both produce the same tokens (greedy; a difference is printed, not hidden). Repetitions are
interleaved and the median reported. Writes bench/results/bench_engine_batching.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench_engine_generate import prompts_of
from clawfast.engines.base import SamplingParams
from clawfast.engines.torch_engine import TorchEngine
from clawfast.pretrained import prepare_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between two arrivals")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_engine_batching.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_model("smollm2-135m")
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(AutoTokenizer.from_pretrained(model_dir), args.requests)
    params = [SamplingParams(max_tokens=args.max_tokens if i % 2 == 0 else max(1, args.max_tokens // 4), temperature=0.0)
              for i in range(args.requests)]
    engines = {"continuous": TorchEngine(lm, seed=0, max_batch=args.max_batch),
               "static": TorchEngine(lm, seed=0, max_batch=args.max_batch, continuous=False)}

    def serve(engine: TorchEngine) -> tuple[float, float, list]:
        async def call(i: int, start: float):
            await asyncio.sleep(max(0.0, start + i * args.gap - time.perf_counter()))
            arrived = time.perf_counter()
            out = await engine.generate(prompts[i], params[i])
            return arrived, time.perf_counter(), out.output_ids.tolist()

        async def go():
            start = time.perf_counter()
            return start, await asyncio.gather(*[call(i, start) for i in range(args.requests)])

        engine._prefixes.clear()  # every repetition starts cold
        start, done = asyncio.run(go())
        return (max(d for _, d, _ in done) - start, statistics.mean(d - a for a, d, _ in done), [t for _, _, t in done])

    makespan: dict[str, list[float]] = {name: [] for name in engines}
    latency: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            m, lat, tokens[name] = serve(engine)
            makespan[name].append(m)
            latency[name].append(lat)
    differ = sum(a != b for a, b in zip(tokens["continuous"], tokens["static"]))
    if differ:
        print(f"note: {differ} of {args.requests} calls differ between the two (greedy ties under float rounding)")
    med = {name: (statistics.median(makespan[name]), statistics.median(latency[name])) for name in engines}
    print(f"{args.requests} calls {args.gap} s apart, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} or {max(1, args.max_tokens // 4)} new tokens, max_batch {args.max_batch}, "
          f"torch threads {torch.get_num_threads()}")
    for name, (m, lat) in med.items():
        print(f"  {name:<11} makespan {m:6.2f} s  mean latency {lat:6.2f} s  ({', '.join(f'{t:.2f}' for t in makespan[name])})")
    ratio = med["static"][0] / med["continuous"][0], med["static"][1] / med["continuous"][1]
    print(f"  continuous: makespan {ratio[0]:.2f}x, mean latency {ratio[1]:.2f}x shorter than static")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.platform(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "args": vars(args), "makespan_s": makespan, "mean_latency_s": latency,
        "speedup_makespan": ratio[0], "speedup_latency": ratio[1], "calls_differing": differ}, indent=1) + "\n")


if __name__ == "__main__":
    main()

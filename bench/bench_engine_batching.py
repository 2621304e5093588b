"""Torch engine batching: length-grouped batches vs one padded batch, in one process.

Setup: the embedded model (fp32, CPU), four concurrent requests shaped like a mixed-harness step
(two long Codex-sized prompts and two short mini-swe-agent-sized ones, random token ids), greedy,
``--max-tokens`` new tokens each.

- ``grouped`` (the engine): four concurrent `TorchEngine.generate` calls; `_take_batch` puts the long
  prompts in one batch and the short ones in another.
- ``one batch`` (baseline, the engine's former first-come batching): the same four requests through
  `TorchEngine._generate_batch` as one left-padded batch, every row padded to the longest prompt.

Both produce the same tokens (greedy; checked). Repetitions are interleaved and the median reported.
Writes bench/results/bench_engine_batching.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from clawfast.embedded import ensure_embedded_model
from clawfast.engines.base import SamplingParams
from clawfast.engines.torch_engine import TorchEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=12_000, help="tokens of each long prompt")
    ap.add_argument("--short", type=int, default=400, help="tokens of each short prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_engine_batching.json"))
    args = ap.parse_args()

    engine = TorchEngine.from_pretrained(ensure_embedded_model(), seed=0, max_batch=8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, engine.model.config.vocab_size, size=n) for n in (args.long, args.short, args.long, args.short)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=0)

    async def grouped():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    def one_batch():
        return engine._generate_batch([(p, params) for p in prompts])

    times = {"grouped": [], "one batch": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        a = asyncio.run(grouped())
        times["grouped"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = one_batch()
        times["one batch"].append(time.perf_counter() - t0)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.output_ids, y.output_ids)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["one batch"] / med["grouped"]
    print(f"prompts {args.long}, {args.short}, {args.long}, {args.short} tokens; {args.max_tokens} new tokens each; "
          f"torch threads {torch.get_num_threads()}")
    for k, v in med.items():
        print(f"  {k:<10} median {v:7.2f} s  ({', '.join(f'{t:.2f}' for t in times[k])})")
    print(f"  grouped is {ratio:.2f}x faster than one padded batch")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.platform(), "cpu_count": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "args": vars(args), "median_s": med, "times_s": times, "speedup": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()

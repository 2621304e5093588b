"""Benchmark: what `clawfast.threads.reconstruct` adds to a training step, against the stage beside it.

The trainer rebuilds every rollout's threads before it builds its prefix tree (`train.prepare.prepare_step`),
so the named baseline is `clawfast.tree.build_tree` on the same calls: the ratio says how much the
reconstruction adds to that per-rollout stage. Inputs are `clawfast.synthetic.harness_like_rollout`
sessions (retries, subagent chains, a title call, a history edit, compactions when they overflow) at
64 calls / 64K-token prompts, 300 calls / 64K and 1,000 calls / 32K. Also checked: the kinds it
finds match the session's own tags.

    python bench/bench_threads.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from clawfast.synthetic import harness_like_rollout
from clawfast.threads import reconstruct
from clawfast.tree import build_tree

SIZES = ((64, 65536), (300, 65536), (1000, 32768))


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}")
    print(f"{'calls':>6} {'max prompt':>10} {'tokens in':>11} {'reconstruct ms':>15} {'build_tree ms':>14} {'ratio':>6}  kinds = tags")
    for n_calls, max_prompt in SIZES:
        calls = harness_like_rollout(np.random.default_rng(0), n_calls=n_calls, max_prompt_tokens=max_prompt)
        tokens = sum(len(c.prompt_ids) + len(c.output_ids) for c in calls)
        t_threads = best_of(lambda: reconstruct(calls), args.repeats)
        t_tree = best_of(lambda: build_tree(calls), args.repeats)
        kinds = reconstruct(calls).kind_of()
        agree = sum(kinds[c.call_index] == c.tags[0] for c in calls)
        print(f"{n_calls:>6} {max_prompt:>10} {tokens:>11,} {1e3 * t_threads:>15.1f} {1e3 * t_tree:>14.1f} "
              f"{t_threads / t_tree:>6.1f}  {agree}/{len(calls)}")


if __name__ == "__main__":
    main()

"""Benchmark: prefix tree build (+ leaf filter) and packing, C++ fast path against the Python reference.

Inputs are synthetic rollouts shaped like real harness traffic (`clawfast.synthetic`): 64 calls
whose main-thread prompts grow to 64K tokens through tool results, ~10% retried calls, two subagent
chains, a title call and a cleared tool result. The 4x and 16x sizes keep the per-call growth and
multiply the calls (and subagent chains), so the session compacts whenever it would overflow 64K and
its input tokens grow linearly.

Reported per size: input tokens (sum over calls of prompt + output: what the builder must read),
median build time of `clawfast.tree.build_tree` (fast) and `clawfast.tree_ref.build_tree_ref`
(baseline), input tokens/s, the ratio, linearity (time at 16x / time at 1x, against the token
ratio), and packing of the tree (fast `pack` against `pack_ref`). Then a GRPO group: 8 rollouts of
one task packed together, against one sample per call and one sample per kept leaf; and a
prompt-heavy group shaped like Claude Code traffic (a 22K-token system prompt and tool schemas
shared by 8 samples whose paths reach 32K) at several budgets, in rows and in attention pairs
(the visible (query, key) pairs of the tree mask: the attention work), against one sample per leaf.

    python bench/bench_tree.py [--quick]

The reference is slow (pure Python per token, ~15 s at 16x), so it runs once per size above 1x.
Writes bench/results/bench_tree.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from clawfast.kernels import TreeMask
from clawfast.pack import pack, pack_stats
from clawfast.pack_ref import pack_ref
from clawfast.synthetic import harness_like_rollout, shared_prefix, task_group
from clawfast.tree import build_tree
from clawfast.tree_ref import build_tree_ref, kept_leaf_paths_ref

SEED = 0
MAX_PROMPT = 65536
TOKENS_PER_CALL = 1000  # main-thread growth per step: 64 calls reach ~64K (as the default would)
MICRO_BATCH_TOKENS = 65536  # micro-batch budget: one longest path fits
GROUP_BUDGETS = [65536, 98304, 131072, 262144, 524288]  # the group is also packed at these budgets
PROMPT_HEAVY_BUDGETS = [32768, 65536, 131072]
RESULTS = Path(__file__).resolve().parent / "results" / "bench_tree.json"


def make_rollout(scale: int):
    """Setup factory: one harness-shaped rollout of 64 * scale calls."""
    rng = np.random.default_rng(SEED)
    return harness_like_rollout(
        rng,
        n_calls=64 * scale,
        max_prompt_tokens=MAX_PROMPT,
        retry_frac=0.1,
        subagent_chains=2 * scale,
        tokens_per_call=TOKENS_PER_CALL,
        shuffle=True,  # arrival order differs from call order in real captures
    )


_FLUSH = np.ones(128 * 2**20 // 8)  # 128 MiB: well above the last-level cache (32 MiB here)


def flush_caches() -> None:
    """Evict the inputs from the CPU caches. Captured rollouts reach the builder from memory, not
    from a cache warmed by the previous repetition: without this the 1x rollout (9 MB) stays in L3
    between repetitions and looks 2-4x faster than it is, which also fakes the linearity."""
    np.add(_FLUSH, 1.0, out=_FLUSH)


def timed(fn, reps: int) -> tuple[float, object]:
    """Median wall time of `reps` cold-cache calls (after one untimed warm-up when reps > 1) and the
    last result."""
    times = []
    out = None
    if reps > 1:
        out = fn()
    for _ in range(reps):
        gc.collect()
        flush_caches()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def answered_main_output(calls) -> int:
    """Output tokens of main-thread calls that were not retried: what a trainer would expect to
    train on. Compared with the trainable targets, it shows what the leaf rules leave out."""
    ordered = sorted(calls, key=lambda c: c.call_index)
    last_asked = {c.prompt_ids.tobytes(): c.call_index for c in ordered}
    return sum(len(c.output_ids) for c in ordered if not c.excluded and last_asked[c.prompt_ids.tobytes()] == c.call_index)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_sizes(scales: list[int], fast_reps: int) -> list[dict]:
    rows = []
    for scale in scales:
        calls = make_rollout(scale)
        n_in = sum(len(c.prompt_ids) + len(c.output_ids) for c in calls)
        t_fast, tree = timed(lambda: build_tree(calls), fast_reps)
        t_pack, batches = timed(lambda: pack([tree], MICRO_BATCH_TOKENS), fast_reps)
        row = {
            "scale": scale,
            "calls": len(calls),
            "input_tokens": n_in,
            "unique_tokens": tree.num_unique_tokens,
            "segments": tree.num_segments,
            "leaves": {s: sum(lf.status == s for lf in tree.leaves) for s in ("kept", "dead", "excluded")},
            "build_fast_s": t_fast,
            "build_fast_tok_s": n_in / t_fast,
            "pack_fast_s": t_pack,
            "packed_tokens": sum(b.num_tokens for b in batches),
            "trainable_targets": sum(len(b.target_ids) for b in batches),
            "answered_main_output_tokens": answered_main_output(calls),
            "build_pack_fast_tok_s": n_in / (t_fast + t_pack),
            "peak_rss_mb_after_fast": peak_rss_mb(),
        }
        # The reference is pure Python (~0.5 us per input token): fewer repetitions at large sizes.
        t_ref, ref_tree = timed(lambda: build_tree_ref(calls), 3 if scale == 1 else 1)
        t_pack_ref, _ = timed(lambda: pack_ref([ref_tree], MICRO_BATCH_TOKENS), 1)
        row.update(build_ref_s=t_ref, pack_ref_s=t_pack_ref)
        rows.append(row)
        print(f"  scale {scale:>2}x: {n_in / 1e6:.1f}M input tokens, fast build {t_fast * 1e3:.1f} ms", file=sys.stderr)
    for r in rows:
        r["build_ref_tok_s"] = r["input_tokens"] / r["build_ref_s"]
        r["build_speedup"] = r["build_ref_s"] / r["build_fast_s"]
        r["pack_speedup"] = r["pack_ref_s"] / r["pack_fast_s"]
    return rows


def bench_group(k: int, n_calls: int, fast_reps: int) -> dict:
    group = task_group(np.random.default_rng(SEED + 1), k, n_calls=n_calls, max_prompt_tokens=MAX_PROMPT,
                       tokens_per_call=TOKENS_PER_CALL)
    n_in = sum(len(c.prompt_ids) + len(c.output_ids) for calls in group for c in calls)
    t_build, trees = timed(lambda: [build_tree(calls) for calls in group], fast_reps)
    t_pack, batches = timed(lambda: pack(trees, MICRO_BATCH_TOKENS), fast_reps)
    stats = pack_stats(batches)
    whole = pack(trees, sum(t.num_unique_tokens for t in trees))  # no budget: the deduplicated forest
    per_call = sum(t.num_call_tokens for t in trees)
    per_leaf = sum(t.num_flat_tokens for t in trees)
    packed = stats["num_tokens"]
    t_pack_ref, _ = timed(lambda: pack_ref(trees, MICRO_BATCH_TOKENS), 1)
    budgets = []
    for budget in GROUP_BUDGETS:
        st = pack_stats(pack(trees, budget))
        budgets.append({"micro_batch_tokens": budget, "micro_batches": st["num_batches"],
                        "packed_tokens": st["num_tokens"], "context_rows": st["num_context_tokens"],
                        "fill_mean": st["fill_mean"], "vs_per_kept_leaf": per_leaf / st["num_tokens"]})
    return {
        "rollouts": k,
        "calls_per_rollout": n_calls,
        "input_tokens": n_in,
        "build_s": t_build,
        "pack_s": t_pack,
        "pack_ref_s": t_pack_ref,
        "build_pack_tok_s": n_in / (t_build + t_pack),
        "one_sample_per_call_tokens": per_call,
        "one_sample_per_kept_leaf_tokens": per_leaf,
        "forest_tokens": whole[0].num_tokens,
        "packed_tokens": packed,
        "context_rows": stats["num_context_tokens"],
        "micro_batches": stats["num_batches"],
        "fill_mean": stats["fill_mean"],
        "targets": stats["num_targets"],
        "saving_vs_per_call": per_call / packed,
        "saving_vs_per_leaf": per_leaf / packed,
        "budgets": budgets,
    }


def attention_pairs(batches) -> int:
    """Visible (query, key) pairs of the batches' tree masks (`TreeMask.visible_pairs`)."""
    return sum(TreeMask(torch.as_tensor(b.kv_end)).visible_pairs() for b in batches)


def bench_prompt_heavy_group(k: int = 8) -> dict:
    rng = np.random.default_rng(SEED + 2)
    prefix = shared_prefix(rng, 32000, system_tokens=22000)  # Claude Code's ~22K in the embedded tokenizer
    trees = [build_tree(harness_like_rollout(rng, 30, 32000, prefix=prefix, rollout_id=f"s{i}")) for i in range(k)]
    leaf_paths = [len(p) for t in trees for p in kept_leaf_paths_ref(t)]
    per_leaf = {"rows": sum(leaf_paths), "pairs": sum(n * (n + 1) // 2 for n in leaf_paths)}
    budgets = []
    for budget in PROMPT_HEAVY_BUDGETS:
        batches = pack(trees, budget)
        st = pack_stats(batches)
        pairs = attention_pairs(batches)
        budgets.append({"micro_batch_tokens": budget, "micro_batches": st["num_batches"],
                        "packed_tokens": st["num_tokens"], "attention_pairs": pairs,
                        "rows_vs_per_leaf": per_leaf["rows"] / st["num_tokens"],
                        "pairs_vs_per_leaf": per_leaf["pairs"] / pairs})
    return {"rollouts": k, "system_prompt_tokens": 22000, "per_leaf": per_leaf, "budgets": budgets}


def print_tables(rows: list[dict], group: dict, linearity: dict, heavy: dict) -> None:
    print("\nPrefix tree build + leaf filter (one rollout), C++ `build_tree` vs Python `build_tree_ref`")
    head = (f"{'size':>5} {'calls':>6} {'input tok':>11} {'unique':>9} {'fast ms':>9} {'fast Mtok/s':>12} "
            f"{'ref s':>8} {'ref Mtok/s':>11} {'speedup':>8} {'pack ms':>8} {'pack ref s':>10} {'pack x':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{str(r['scale']) + 'x':>5} {r['calls']:>6} {r['input_tokens']:>11,} {r['unique_tokens']:>9,} "
              f"{r['build_fast_s'] * 1e3:>9.1f} {r['build_fast_tok_s'] / 1e6:>12.1f} "
              f"{r['build_ref_s']:>8.2f} {r['build_ref_tok_s'] / 1e6:>11.2f} {r['build_speedup']:>7.0f}x "
              f"{r['pack_fast_s'] * 1e3:>8.1f} {r['pack_ref_s']:>10.2f} {r['pack_speedup']:>6.0f}x")
    print("\nTrainable targets against the output tokens of answered (not retried) main-thread calls:")
    for r in rows:
        print(f"  {r['scale']:>2}x: {r['trainable_targets']:>9,} of {r['answered_main_output_tokens']:>9,} "
              f"({r['trainable_targets'] / r['answered_main_output_tokens']:.0%})")
    print(f"\nLinearity (fast build): {linearity['token_ratio']:.1f}x tokens took {linearity['time_ratio']:.1f}x time "
          f"(bar: 16x tokens in <= 20x time)")
    g = group
    print(f"\nGroup of {g['rollouts']} rollouts of one task ({g['calls_per_rollout']} calls each, "
          f"{g['input_tokens']:,} input tokens), packed at micro_batch_tokens={MICRO_BATCH_TOKENS}:")
    print(f"{'layout':<34} {'tokens':>12} {'vs packed':>10}")
    for name, key in (("one sample per call (as captured)", "one_sample_per_call_tokens"),
                      ("one sample per kept leaf", "one_sample_per_kept_leaf_tokens"),
                      ("deduplicated forest (no budget)", "forest_tokens"),
                      ("packed micro-batches", "packed_tokens")):
        print(f"{name:<34} {g[key]:>12,} {g[key] / g['packed_tokens']:>9.2f}x")
    print(f"  {g['micro_batches']} micro-batches, fill {g['fill_mean']:.3f}, {g['context_rows']:,} re-included "
          f"context rows, {g['targets']:,} targets; build+pack {g['build_pack_tok_s'] / 1e6:.0f}M input tok/s; "
          f"pack {g['pack_s'] * 1e3:.1f} ms vs pack_ref {g['pack_ref_s']:.2f} s ({g['pack_ref_s'] / g['pack_s']:.0f}x)")
    print("\nThe same group at other micro-batch budgets (split subtrees re-include their ancestor path):")
    print(f"{'micro_batch_tokens':>18} {'batches':>8} {'packed':>10} {'context':>9} {'fill':>6} "
          f"{'per-leaf/packed':>16}")
    for b in g["budgets"]:
        print(f"{b['micro_batch_tokens']:>18,} {b['micro_batches']:>8} {b['packed_tokens']:>10,} "
              f"{b['context_rows']:>9,} {b['fill_mean']:>6.3f} {b['vs_per_kept_leaf']:>15.2f}x")
    h = heavy
    print(f"\nPrompt-heavy group ({h['rollouts']} samples sharing a {h['system_prompt_tokens']:,}-token prompt, paths "
          f"to 32K): one sample per kept leaf is {h['per_leaf']['rows']:,} rows, "
          f"{h['per_leaf']['pairs'] / 1e9:.2f}G attention pairs")
    print(f"{'micro_batch_tokens':>18} {'batches':>8} {'packed':>10} {'pairs':>8} {'per-leaf/packed rows':>21} "
          f"{'pairs':>7}")
    for b in h["budgets"]:
        print(f"{b['micro_batch_tokens']:>18,} {b['micro_batches']:>8} {b['packed_tokens']:>10,} "
              f"{b['attention_pairs'] / 1e9:>7.2f}G {b['rows_vs_per_leaf']:>20.2f}x {b['pairs_vs_per_leaf']:>6.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1x and 4x only, fewer repetitions")
    args = parser.parse_args(argv)
    scales = [1, 4] if args.quick else [1, 4, 16]
    fast_reps = 3 if args.quick else 7
    rows = bench_sizes(scales, fast_reps)
    group = bench_group(8, 64, 3 if args.quick else 5)
    first, last = rows[0], rows[-1]
    linearity = {
        "from_scale": first["scale"],
        "to_scale": last["scale"],
        "token_ratio": last["input_tokens"] / first["input_tokens"],
        "time_ratio": last["build_fast_s"] / first["build_fast_s"],
    }
    heavy = bench_prompt_heavy_group()
    print_tables(rows, group, linearity, heavy)
    one = rows[0]
    bars = {
        "build_speedup_1x_ge_50": one["build_speedup"] >= 50,
        "build_fast_1x_ge_100M_tok_s": one["build_fast_tok_s"] >= 100e6,
    }
    if last["scale"] == 16:
        bars["linearity_16x_le_20x_time"] = linearity["time_ratio"] <= 20
    print("\nBars: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in bars.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "bench": "bench_tree",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "config": {"seed": SEED, "max_prompt_tokens": MAX_PROMPT, "tokens_per_call": TOKENS_PER_CALL,
                   "micro_batch_tokens": MICRO_BATCH_TOKENS, "fast_reps": fast_reps, "scales": scales,
                   "group_budgets": GROUP_BUDGETS},
        "sizes": rows,
        "linearity": linearity,
        "group": group,
        "prompt_heavy_group": heavy,
        "bars": bars,
        "peak_rss_mb": peak_rss_mb(),
    }, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tree attention, forward + backward: the CPU fast path against FlexAttention and dense-mask SDPA.

Batches are harness-shaped: for a size N, a GRPO group of 8 rollouts of one task
(`clawfast.synthetic.task_group`: 64 calls, main-thread prompts growing to N/2 tokens, retries,
subagent chains, a title call) is packed at ``micro_batch_tokens = N`` and the fullest micro-batch is
attended. Heads: 4 query heads, 2 key/value heads, head_dim 64, float32 (the CPU training dtype).

Paths (same q, k, v, kv_end):
- ``torch``: `clawfast.kernels.tree_attention(backend="torch")`, the block-sparse CPU fast path.
- ``flex``: compiled FlexAttention with the tree's block mask (`TreeMask.flex_block_mask`). It has no
  backward on CPU (torch 2.13), so only its forward is timed; compile time is reported apart.
- ``dense``: ``F.scaled_dot_product_attention`` with the additive [1, 1, N, N] float mask that
  ``Policy(attention="sdpa-dense")`` gives the model. Not run where the mask alone (N^2 floats plus
  the boolean mask it is built from) would exceed half the available memory; its need is printed.

``--window W`` runs every path with a sliding window of W rows along each path (Mistral-style
layers): the torch path and flex with ``window=W`` (their schedules drop the pairs out of every
row's window), dense SDPA with the windowed dense mask; the report adds the unwindowed torch path's
fwd+bwd (``torch-full``) as the baseline of what the window saves.

Each (size, path) runs in a fresh subprocess, so its peak memory (`memory.measure`: resident
high-water mark over the resident size with the inputs in place) is its own. Reported per size:
visible pairs (what the tree mask allows, against N^2/2 for a causal mask), fwd and fwd+bwd seconds,
peak extra MiB, and the ratios dense/torch and flex/torch.

    python bench/bench_tree_attention.py [--sizes 4096 16384 65536 131072] [--window W] [--quick]

Writes bench/results/bench_tree_attention.json (with a window: bench_tree_attention_window{W}.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
PATHS = ("torch", "flex", "dense")


def harness_batch_kv_end(size: int, seed: int = 0) -> np.ndarray:
    """kv_end of the fullest micro-batch of a harness-shaped group packed at ``size`` rows."""
    from clawfast.pack import pack
    from clawfast.synthetic import task_group
    from clawfast.tree import build_tree

    group = task_group(np.random.default_rng(seed), 8, n_calls=64, max_prompt_tokens=size // 2,
                       tokens_per_call=max(1, size // 128), vocab_size=32000)
    batches = pack([build_tree(calls) for calls in group], size)
    return max(batches, key=lambda b: b.num_tokens).kv_end.astype(np.int64)


def dense_need_mib(n: int) -> float:
    return n * n * (4 + 1) / 2**20  # float32 additive mask + the bool mask it is made from


# ------------------------------------------------------------------------------- one measurement


def run_one(path: str, kv_end_file: str, repeats: int, threads: int, window: int | None) -> dict:
    """Time and peak extra memory of one path in this (fresh) process (``torch-full``: the torch
    path without the window)."""
    import time

    import torch
    import torch.nn.functional as F
    from memory import measure

    from clawfast.kernels import TreeMask, tree_attention
    from clawfast.tree_mask import dense_tree_mask

    torch.set_num_threads(threads)
    kv_end = torch.from_numpy(np.load(kv_end_file))
    n = kv_end.shape[0]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    grad = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    out: dict = {}
    if path in ("torch", "torch-full"):
        w = window if path == "torch" else None

        def forward():
            with torch.no_grad():
                return tree_attention(q, k, v, TreeMask(kv_end), window=w, backend="torch")

        def step():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            tree_attention(qq, kk, vv, TreeMask(kv_end), window=w, backend="torch").backward(grad)
            return qq.grad, kk.grad, vv.grad
    elif path == "flex":
        mask = TreeMask(kv_end)
        t0 = time.perf_counter()
        tree_attention(q, k, v, mask, window=window, backend="flex")  # compiles for this shape
        out["compile_s"] = time.perf_counter() - t0

        def forward():
            return tree_attention(q, k, v, TreeMask(kv_end), window=window, backend="flex")

        step = None
    else:
        qh, kh, vh, gh = (t.transpose(0, 1)[None] for t in (q, k, v, grad))

        def forward():
            with torch.no_grad():
                return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=dense_tree_mask(kv_end, window=window),
                                                      enable_gqa=True)

        def step():
            qq, kk, vv = (t.detach().requires_grad_() for t in (qh, kh, vh))
            F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense_tree_mask(kv_end, window=window),
                                           enable_gqa=True).backward(gh)
            return qq.grad, kk.grad, vv.grad
    out["fwd_s"], out["fwd_mib"] = measure(forward, repeats)
    if step is not None:
        out["fwd_bwd_s"], out["fwd_bwd_mib"] = measure(step, repeats)
    return out


def measure_in_subprocess(path: str, kv_end_file: str, repeats: int, threads: int, window: int | None) -> dict:
    cmd = [sys.executable, __file__, "--one", path, kv_end_file, "--repeats", str(repeats), "--threads", str(threads)]
    if window is not None:
        cmd += ["--window", str(window)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} on {kv_end_file} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------- run


def run(sizes: list[int], repeats: int, threads: int, window: int | None) -> dict:
    import torch
    from memory import available_mib

    from clawfast.kernels import TreeMask

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            kv_end = harness_batch_kv_end(size)
            n = int(kv_end.shape[0])
            file = str(Path(tmp) / f"kv_end_{size}.npy")
            np.save(file, kv_end)
            mask = TreeMask(torch.from_numpy(kv_end))
            pairs = mask.visible_pairs()
            row = {"size": size, "rows": n, "visible_pairs": pairs, "causal_fraction": pairs / (n * (n + 1) / 2),
                   "paths": {}}
            if window is not None:
                row["block_pairs"] = {"full": mask.schedule(128).num_pairs, "window": mask.schedule(128, window).num_pairs}
            reps = repeats if n <= 16384 else 0  # the memory run is the timed run at 64K and up
            for path in PATHS + (("torch-full",) if window is not None else ()):
                if path == "dense" and dense_need_mib(n) > available_mib() / 2:
                    row["paths"][path] = {"skipped": f"mask needs {dense_need_mib(n) / 1024:.1f} GiB, more than half "
                                                     f"of the {available_mib() / 1024:.1f} GiB available"}
                else:
                    row["paths"][path] = measure_in_subprocess(path, file, reps, threads, window)
                print(f"  {size:>7} rows {n:>7} {path:<6} {row['paths'][path]}", file=sys.stderr)
            rows.append(row)
    for row in rows:
        t = row["paths"]["torch"]
        for name in [p for p in row["paths"] if p != "torch"]:
            other = row["paths"][name]
            if "fwd_s" in other:
                other["fwd_time_ratio"] = other["fwd_s"] / t["fwd_s"]
                other["fwd_mem_ratio"] = other["fwd_mib"] / max(t["fwd_mib"], 1e-9)
            if "fwd_bwd_s" in other:
                other["fwd_bwd_time_ratio"] = other["fwd_bwd_s"] / t["fwd_bwd_s"]
                other["fwd_bwd_mem_ratio"] = other["fwd_bwd_mib"] / max(t["fwd_bwd_mib"], 1e-9)
    return {"rows": rows}


def print_table(out: dict) -> None:
    window = out["setup"]["window"]
    print(f"Tree attention on CPU, {HEADS} q heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, float32, "
          f"{out['setup']['threads']} thread(s)" + (f", sliding window {window} (torch-full: none)" if window else ""))
    head = (f"{'rows':>7} {'pairs/causal':>12} {'path':<10} {'fwd s':>8} {'fwd MiB':>8} {'fwd+bwd s':>10} "
            f"{'f+b MiB':>8} {'path/torch (t, mem)':>22} {'compile s':>9}")
    print(head)
    print("-" * len(head))
    for row in out["rows"]:
        if "block_pairs" in row:
            bp = row["block_pairs"]
            print(f"{row['rows']:>7} block pairs (B = 128): {bp['window']:,} with the window, {bp['full']:,} without")
        for name, r in row["paths"].items():
            if "skipped" in r:
                print(f"{row['rows']:>7} {row['causal_fraction']:>12.3f} {name:<10} skipped: {r['skipped']}")
                continue
            ratio = ""
            if name != "torch":
                key = "fwd_bwd" if "fwd_bwd_s" in r else "fwd"
                ratio = f"{key} {r[key + '_time_ratio']:.2f}x, {r[key + '_mem_ratio']:.2f}x"
            fb = f"{r['fwd_bwd_s']:>10.3f} {r['fwd_bwd_mib']:>8.0f}" if "fwd_bwd_s" in r else f"{'n/a':>10} {'':>8}"
            print(f"{row['rows']:>7} {row['causal_fraction']:>12.3f} {name:<10} {r['fwd_s']:>8.3f} {r['fwd_mib']:>8.0f} "
                  f"{fb} {ratio:>22} {r.get('compile_s', float('nan')):>9.1f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path up to 16K rows (1 above)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--window", type=int, help="sliding window (rows along each path) for every path")
    p.add_argument("--quick", action="store_true", help="1K rows, one repeat (a smoke test)")
    p.add_argument("--out", type=Path)
    p.add_argument("--one", nargs=2, metavar=("PATH", "KV_END_NPY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.repeats, args.threads, args.window)))
        return
    if args.quick:
        args.sizes, args.repeats = [1024], 1
    if args.window is not None and args.window < 1:
        p.error(f"--window must be a positive number of rows, got {args.window}")
    out = run(args.sizes, args.repeats, args.threads, args.window)
    out["setup"] = {"sizes": args.sizes, "repeats": args.repeats, "threads": args.threads, "heads": HEADS,
                    "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "window": args.window}
    out["machine"] = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                      "load_avg_1m": os.getloadavg()[0]}
    print_table(out)
    path = args.out or RESULTS / ("bench_tree_attention.json" if args.window is None
                                  else f"bench_tree_attention_window{args.window}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""CPU benchmark of clawfast.kernels against named baselines, in one process.

1. Fused log-probs (``tree_logprobs``, torch fast path) against the naive
   ``log_softmax(hidden @ weight.T).gather(...)``: median wall time and peak extra memory of a
   no-grad forward (an old/ref log-prob pass) and of forward+backward (loss = sum of log-probs).
2. Tree GAE (``tree_gae``, path mode) against the Python loop over time steps of common RL stacks
   (verl's ``compute_gae_advantage_return``, vectorised over the expanded root-to-leaf paths), on
   agent-like forests: k samples sharing a prompt, each a chain of turns with some retries.

Peak memory: `memory.measure` (the resident high-water mark over the resident size before the run,
so every byte the run touched counts, outputs and gradients included). Results: a table on stdout and
bench/results/bench_kernels.json. ``--quick`` runs tiny sizes (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from clawfast.kernels import tree_gae, tree_logprobs
from clawfast.kernels.reference import gae_loop, tree_paths_ref
from memory import measure

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- log-probs


def logprob_setup(n, d, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) / d**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


def naive_logprobs(hidden, weight, labels):
    return torch.log_softmax(hidden @ weight.t(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def fused_logprobs(hidden, weight, labels, chunk_rows=None):
    rows = torch.arange(hidden.shape[0])
    return tree_logprobs(hidden, weight, rows, labels, backend="torch", chunk_rows=chunk_rows)[0]


def fwd_bwd(fn, hidden, weight, labels, **kw):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    fn(h, w, labels, **kw).sum().backward()
    return h.grad, w.grad


def bench_logprobs(sizes, repeats, chunk_sweep):
    rows = []
    for n, d, v in sizes:
        hidden, weight, labels = logprob_setup(n, d, v)
        # correctness first (fp32 against each other; the tests hold the float64 comparisons)
        with torch.no_grad():
            err = float((naive_logprobs(hidden, weight, labels)
                         - fused_logprobs(hidden, weight, labels)).abs().max())
        chunks = sorted({None, *chunk_sweep}, key=lambda c: -1 if c is None else c)
        for mode in ("no-grad forward", "forward+backward"):
            if mode == "no-grad forward":
                def run(fn, **kw):
                    with torch.no_grad():
                        return fn(hidden, weight, labels, **kw)
            else:
                def run(fn, **kw):
                    return fwd_bwd(fn, hidden, weight, labels, **kw)
            t_naive, m_naive = measure(lambda: run(naive_logprobs), repeats)
            for chunk in chunks:
                t_fast, m_fast = measure(lambda: run(fused_logprobs, chunk_rows=chunk), repeats)
                rows.append(dict(op="tree_logprobs", mode=mode, N=n, d=d, V=v,
                                 chunk_rows=chunk or "auto", naive_s=t_naive, fused_s=t_fast,
                                 time_ratio=t_fast / t_naive, naive_peak_mib=m_naive,
                                 fused_peak_mib=m_fast, mem_ratio=m_fast / max(m_naive, 1e-9),
                                 max_abs_diff=err))
                print(f"  [{mode} N={n} chunk={chunk or 'auto'}] fused/naive time "
                      f"{t_fast / t_naive:.3f}, memory {m_fast / max(m_naive, 1e-9):.4f}", flush=True)
    return rows


# ---------------------------------------------------------------------------------- GAE


def agent_forest(total, samples=8, prompt=512, turn=200, retry_p=0.15, seed=0):
    """k samples of one task merged on a shared prompt; each sample a chain of turns, where a
    turn is sometimes retried (a second child of the turn's first token). DFS-ordered parents."""
    g = torch.Generator().manual_seed(seed)
    parent = list(range(-1, prompt - 1))
    per_sample = max(1, (total - prompt) // samples)
    for _ in range(samples):
        attach, left = prompt - 1, per_sample
        while left > 0:
            length = min(left, turn)
            start = len(parent)
            parent.extend([attach] + list(range(start, start + length - 1)))
            left -= length
            if left > 0 and float(torch.rand(1, generator=g)) < retry_p:
                # a retried turn: the dead branch is a sibling chain under the same attach point
                length2 = min(left, turn // 2)
                s2 = len(parent)
                parent.extend([attach] + list(range(s2, s2 + length2 - 1)))
                left -= length2
            attach = start + length - 1
    return torch.tensor(parent[:total] if len(parent) >= total else parent, dtype=torch.int32)


def bench_gae(sizes, repeats):
    # one intra-op thread for both sides: on a shared 2-core machine, two-thread torch ops on
    # 16K-element tensors stall on the descheduled thread and time the scheduler, not the code
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_bench_gae_one(total, shape, repeats) for total in sizes
                for shape in ("chain", "agent")]
    finally:
        torch.set_num_threads(threads)


def _bench_gae_one(total, shape, repeats):
    if shape == "chain":  # one flat sequence: the case a per-time-step loop handles best
        parent = torch.arange(-1, total - 1, dtype=torch.int32)
    else:
        parent = agent_forest(total, samples=4, prompt=total // 8, turn=256)
    n = parent.shape[0]
    g = torch.Generator().manual_seed(1)
    rewards = torch.zeros(n, dtype=torch.float64)
    values = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) < 0.7).double()
    paths = tree_paths_ref(parent)
    rewards[[p[-1] for p in paths]] = torch.rand(len(paths), generator=g, dtype=torch.float64)
    # the baseline's input: every root-to-leaf path expanded and right-padded (mask 0)
    width = max(len(p) for p in paths)
    idx = torch.full((len(paths), width), -1, dtype=torch.long)
    for i, p in enumerate(paths):
        idx[i, : len(p)] = torch.tensor(p)
    pad = idx < 0
    safe = idx.clamp(min=0)
    r_b = torch.where(pad, 0.0, rewards[safe])
    v_b = torch.where(pad, 0.0, values[safe])
    m_b = torch.where(pad, 0.0, mask[safe])

    def baseline():
        return gae_loop(r_b, v_b, m_b, 0.99, 0.95)

    def fast():
        return tree_gae(rewards, values, parent, mask=mask, gamma=0.99, lam=0.95, mode="path")

    # same numbers: the mean over paths of the baseline's per-path advantages
    adv_b, _ = baseline()
    tot = torch.zeros(n, dtype=torch.float64).index_add_(0, safe[~pad], adv_b[~pad])
    cnt = torch.zeros(n, dtype=torch.float64).index_add_(0, safe[~pad], torch.ones_like(adv_b[~pad]))
    err = float((fast()[0] - tot / cnt).abs().max())
    # medians: a single timed loop run swung 0.15-0.33 s on the shared 2-core machine
    t_base, _ = measure(baseline, repeats)
    t_fast, _ = measure(fast, repeats * 5)
    return dict(op="tree_gae", shape=shape, tokens=n, paths=len(paths),
                expanded_tokens=int((~pad).sum()), loop_s=t_base, fused_s=t_fast,
                speedup=t_base / t_fast, max_abs_diff=err)


def print_table(title, rows, cols):
    print(f"\n{title}")
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            x = r[c]
            cells.append(f"{x:>14.4g}" if isinstance(x, float) else f"{x!s:>14}")
        print(" | ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-sweep", type=int, nargs="*", default=[],
                    help="extra chunk_rows values to time for tree_logprobs")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_kernels.json")
    ap.add_argument("--sections", nargs="+", choices=["logprobs", "gae"], default=["logprobs", "gae"],
                    help="run only these; the others keep their rows from an existing --out file")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.quick:
        lp_sizes, gae_sizes, repeats = [(256, 32, 1024)], [1024], 1
    else:
        lp_sizes = [(2048, 256, 8192), (8192, 512, 32768)]
        gae_sizes = [1024, 4096, 16384]
        repeats = args.repeats
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    lp_rows, gae_rows = previous.get("logprobs", []), previous.get("gae", [])
    if "logprobs" in args.sections:
        lp_rows = bench_logprobs(lp_sizes, repeats, args.chunk_sweep)
    print_table("fused tree log-probs vs naive log_softmax(h @ W.T).gather (CPU, fp32)", lp_rows,
                ["mode", "N", "d", "V", "chunk_rows", "naive_s", "fused_s", "time_ratio",
                 "naive_peak_mib", "fused_peak_mib", "mem_ratio"])
    if "gae" in args.sections:
        gae_rows = bench_gae(gae_sizes, repeats)
    print_table("tree GAE (path mode) vs Python loop over time steps on expanded paths (CPU)",
                gae_rows, ["shape", "tokens", "paths", "expanded_tokens", "loop_s", "fused_s",
                           "speedup", "max_abs_diff"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(),
                machine=platform.machine(), quick=args.quick, repeats=repeats)
    args.out.write_text(json.dumps(dict(meta=meta, logprobs=lp_rows, gae=gae_rows), indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

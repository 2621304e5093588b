"""Timings of clawfast.kernels' Triton kernels on one GPU, against their baselines and peers, each case
streamed through bench/rows.py the moment it finishes (most valuable first).

    python bench/gpu_kernels.py --rows ROWS.jsonl           # CUDA, bfloat16 (~110 s on an H200)
    python bench/gpu_kernels.py --smoke --rows ROWS.jsonl   # tiny sizes; CPU + TRITON_INTERPRET=1 without a GPU

Timings only: correctness is bench/gpu_correctness.py's. Each timed function runs once on its own
first (Triton compiles there: reported as ``warmup_ms`` and in the note), then
``--warmup - 1`` more untimed calls, then ``--repeats`` timed calls (CUDA events; the median).
Peak memory is the allocator's high-water mark over the timed calls above what was allocated before
them. ``ratio`` = our ms / the baseline's ms (below 1: ours faster); ``mem_ratio`` likewise for peak
memory. A case whose code raises (a baseline out of memory, a peer that fails) is a row with the error;
a peer that is not importable is one row saying so; a case that no longer fits ``--budget`` (seconds
from the script's start) is a row saying it was skipped. In order:

1. ``tree_logprobs`` at Liger-Kernel's published shape (N = 32,768 rows, d = 4,096, V = 128,256, bf16,
   one target per row as the peers take them): no-grad forward vs ONE bf16 matmul of the same shape
   (bar <= 1.2) and vs the same matmul writing float32 (its chunks' own product: the rest is their
   passes), forward+backward of the log-likelihood vs THREE (bar <= 1.5), vs the naive
   ``log_softmax(h @ W.T).gather`` (peak memory bar <= 0.02), vs Liger-Kernel's fused linear
   cross-entropy (``LigerFusedLinearCrossEntropyLoss``, its own code; forward+backward and no-grad)
   and vs Cut Cross-Entropy (``cut_cross_entropy.linear_cross_entropy``, its own Triton kernels:
   as shipped, ``filter_eps="high"``, which skips gradient blocks whose softmax entries are all
   below 2^-12 (nearly all of them on random weights, where softmax is near uniform), then exact,
   ``filter_eps=None``, then no-grad).
2. ``tree_attention`` on an agent-shaped forest of 16K rows (32 query / 8 key-value heads, head_dim
   128, bf16), forward+backward: Triton vs SDPA with the dense [N, N] tree mask; then on one plain
   causal chain of the same rows, Triton vs SDPA's causal kernel (torch's flash backend: the kernel a
   flat trainer runs, so the ratio prices the tree kernel per attention pair), forward+backward and
   the forward alone.
3. ``tree_attention`` Triton vs FlexAttention (compiled; its compile reported) and vs backend
   "varlen" (flash-attention's varlen kernel over the forest's path segments) on that forest: which
   one ``attention="auto"`` should run on a GPU (the first H200 run had no time left for it).
4. ``tree_gae`` (path and tree modes) on 16K rows vs the torch path and vs the per-step loop on the
   host; ``importance_weights`` (token, sequence level) and ``policy_loss`` (forward+backward), Triton
   vs the torch path.
5. ``tree_logprobs`` forward+backward with the entropy's gradient too (the trainer with an entropy
   bonus; one more compiled variant) vs three matmuls.
6. The larger forests of ``--attention-tokens`` (64K) vs dense SDPA, as the budget allows.

``--smoke`` runs tiny sizes (on a CPU under Triton's interpreter, wall-clock timings, no memory
figures); ``--out`` also writes every row as one JSON document.

Files: the timing harness (gpu_kernels_timing.py), the cases by op (gpu_kernels_logprobs.py,
gpu_kernels_attention.py, gpu_kernels_small.py), their forests (gpu_forests.py); this one is the
command line and the order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_START = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: rows.py, gpu_kernels_*.py

from gpu_kernels_attention import AttentionInputs, bench_attention, bench_backend  # noqa: E402
from gpu_kernels_logprobs import bench_logprobs, bench_logprobs_entropy  # noqa: E402
from gpu_kernels_small import bench_small_ops  # noqa: E402
from gpu_kernels_timing import Bench, Cases  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; CPU + TRITON_INTERPRET=1 if no GPU")
    ap.add_argument("--rows", type=Path, default=None, help="JSON lines, one per finished case (bench/rows.py)")
    ap.add_argument("--out", type=Path, default=None, help="also write all rows as one JSON document")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the script's start; a case that no longer fits is reported as skipped "
                         "(default 110 on a GPU, none in smoke)")
    ap.add_argument("--logprob-tokens", type=int, default=32768, help="rows of the log-probs cases")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--attention-tokens", type=int, nargs="+", default=[16384, 65536],
                    help="rows of the attention forests: the first in section 2, the others last")
    ap.add_argument("--gae-tokens", type=int, default=16384, help="rows of the GAE / IS / loss cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls, the first (compile) included")
    args = ap.parse_args(argv)
    if args.budget is None and not args.smoke:
        args.budget = 110.0
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: interpreted kernels
    import torch

    import clawfast.kernels as K
    from rows import Rows

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: run with --smoke (TRITON_INTERPRET=1 on the CPU)")
        return 2
    rows = Rows(args.rows)
    if args.smoke:
        lp_n, d, v, attn, gae_n, repeats, warmup = 40, 32, 80, [64, 96], 160, 1, 1
    else:
        lp_n, d, v, attn, gae_n = args.logprob_tokens, args.hidden, args.vocab, args.attention_tokens, args.gae_tokens
        repeats, warmup = args.repeats, args.warmup
    cuda = device.type == "cuda"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (TRITON_INTERPRET=1)'}; "
          f"{time.monotonic() - T_START:.1f} s since start", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    bench = Bench(torch, device, warmup, repeats)
    cases = Cases(torch, rows, args.budget, cuda, T_START)

    lp = bench_logprobs(K, torch, bench, cases, rows, device, lp_n, d, v, gen, "triton")
    cases.free()
    x = AttentionInputs(K, torch, device, attn[0], gen)
    ours_attn = bench_attention(K, torch, bench, cases, rows, x, with_chain=True)
    cases.free()
    for backend in ("flex", "varlen"):
        bench_backend(K, torch, bench, cases, rows, x, ours_attn, backend)
        cases.free()
    del x
    cases.free()
    bench_small_ops(K, torch, bench, cases, rows, device, gae_n, gen)
    bench_logprobs_entropy(bench, cases, rows, lp)
    lp.clear()
    cases.free()
    for n in attn[1:]:
        try:
            big = AttentionInputs(K, torch, device, n, gen)
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, op="tree_attention", case="fwd+bwd triton", shape=f"N={n}")
            continue
        bench_attention(K, torch, bench, cases, rows, big, with_chain=False)
        del big
        cases.free()

    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(device=str(device), smoke=args.smoke, rows=rows.rows), indent=2,
                                       default=str))
        print(f"wrote {args.out}")
    print(f"done in {time.monotonic() - T_START:.1f} s", flush=True)
    if cases.failures:
        print("FAILED:\n  " + "\n  ".join(cases.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

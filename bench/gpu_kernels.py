"""GPU check and benchmark of every Triton kernel in clawfast.kernels, in one script.

On a CUDA machine (bfloat16; default sizes are the issue's: Liger-Kernel's published shape for the
log-probs, agent-length forests for attention and GAE):

1. ``tree_logprobs`` at N = 32,768 rows, d = 4,096, V = 128,256: correctness against the dense
   reference (float32, on a slice of rows, forward and gradients), then CUDA-event timings (warm-up
   first, median of repeats) and peak memory of a no-grad forward vs ONE bf16 matmul of the same
   shape, forward+backward vs THREE bf16 matmuls, the naive ``log_softmax(h @ W.T).gather`` and,
   when importable, Liger-Kernel's fused linear cross-entropy. Bars (from the kernels issue):
   no-grad <= 1.2x one matmul, fwd+bwd <= 1.5x three, peak extra memory <= 2% of naive.
2. ``tree_attention`` at N = 16K and 64K rows: the Triton kernel and FlexAttention against the dense
   reference (outputs and q/k/v gradients, float32 and bfloat16, on a small packed forest), then
   forward+backward timings and peak memory on agent-shaped forests (32 query / 8 key-value heads,
   head_dim 128, bfloat16): Triton vs FlexAttention vs SDPA with the dense [N, N] mask (where it fits).
3. ``tree_gae`` on 64K rows: Triton vs the torch backend on the same device (values must agree) and
   vs the per-step loop (``tree_gae_ref``: one Python step per row, on the host); then
   ``importance_weights`` (token and sequence level) and ``policy_loss``, Triton vs torch.

``--smoke`` runs tiny sizes; without CUDA it sets TRITON_INTERPRET=1 before anything imports
triton, runs the same code paths on the CPU with wall-clock timings, and checks the same
tolerances (the test suite runs this mode). Prints one table; writes JSON with ``--out`` (default
bench/results/gpu_kernels.json for full runs, nothing for smoke runs). ``bench/gpu_check.py`` runs
this script as one of its sections.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; CPU + TRITON_INTERPRET=1 if no GPU")
    ap.add_argument("--logprob-tokens", type=int, nargs="+", default=[32768], help="rows of the log-probs cases")
    ap.add_argument("--attention-tokens", type=int, nargs="+", default=[16384, 65536], help="rows of the attention cases")
    ap.add_argument("--gae-tokens", type=int, default=65536, help="rows of the GAE / IS / loss cases")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


class Bench:
    """Timing and memory on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, device, warmup, repeats):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = warmup, repeats

    def time_ms(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peak_mib(self, fn) -> float:
        """Peak memory allocated during ``fn`` above what was allocated before (NaN on CPU)."""
        if not self.cuda:
            fn()
            return float("nan")
        torch = self.torch
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20


def rel(torch, a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def try_run(fn):
    """Run a baseline that may not fit (naive logits at 64K x 152K) or not exist."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table, never hidden
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


def tree_targets(torch, n, v, device, gen):
    """One target per row plus branch rows: 5% of rows get a second target, row 0 gets 16."""
    rows = torch.arange(n, device=device)
    extra = torch.nonzero(torch.rand(n, generator=gen) < 0.05).view(-1).to(device)
    rows = torch.cat([rows, extra, torch.zeros(16, dtype=torch.long, device=device)])
    ids = torch.randint(0, v, (rows.shape[0],), generator=gen).to(device)
    return rows.to(torch.int32), ids.to(torch.int32)


def check_logprobs(K, torch, device, dtype, d, v, gen, tol_grad):
    """Fused vs dense float32 reference on a slice small enough for dense logits."""
    n = 48 if device.type == "cpu" else 1024
    h = (torch.randn(n, d, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=gen) / d**0.5).to(device, dtype).requires_grad_()
    rows, ids = tree_targets(torch, n, v, device, gen)
    # several row chunks, so the float32 weight-gradient accumulation across chunks is checked
    lp, ent = K.tree_logprobs(h, w, rows, ids, backend="triton", chunk_rows=max(16, n // 4))
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    lp_r, ent_r = K.tree_logprobs_ref(hr, wr, rows, ids)
    g1 = torch.randn(lp.shape, generator=gen).to(device)
    g2 = torch.randn(ent.shape, generator=gen).to(device)
    ((lp * g1).sum() + (ent * g2).sum()).backward()
    ((lp_r * g1).sum() + (ent_r * g2).sum()).backward()
    errs = dict(lp=rel(torch, lp, lp_r), ent=rel(torch, ent, ent_r),
                grad_h=rel(torch, h.grad, hr.grad), grad_w=rel(torch, w.grad, wr.grad))
    ok = errs["lp"] <= 1e-4 and errs["ent"] <= 1e-4 and max(errs["grad_h"], errs["grad_w"]) <= tol_grad
    return ok, errs


def bench_logprobs(K, torch, bench, device, dtype, n, d, v, gen):
    rows_out = []
    h = (torch.randn(n, d, generator=gen) * 0.5).to(device, dtype)
    w = (torch.randn(v, d, generator=gen) / d**0.5).to(device, dtype)
    rows, ids = tree_targets(torch, n, v, device, gen)
    labels = ids[:n].long()

    def one_mm():
        return h @ w.t()

    def three_mm():
        z = h @ w.t()
        return z @ w, z.t() @ h

    def fused_nograd():
        with torch.no_grad():
            return K.tree_logprobs(h, w, rows, ids, backend="triton")

    def fused_fwd_bwd():
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        lp, ent = K.tree_logprobs(hg, wg, rows, ids, backend="triton")
        (lp.sum() + 0.01 * ent.sum()).backward()
        return hg.grad, wg.grad

    def naive_fwd_bwd():
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        logp = torch.log_softmax((hg @ wg.t()).float(), dim=-1)
        lp = logp[rows.long(), ids.long()]
        lp.sum().backward()
        return hg.grad, wg.grad

    def liger_fwd_bwd():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        LigerFusedLinearCrossEntropyLoss(reduction="sum")(wg, hg, labels).backward()
        return hg.grad, wg.grad

    t_mm = bench.time_ms(one_mm)
    t_3mm = bench.time_ms(three_mm)
    t_nograd = bench.time_ms(fused_nograd)
    m_nograd = bench.peak_mib(fused_nograd)
    t_fb = bench.time_ms(fused_fwd_bwd)
    m_fb = bench.peak_mib(fused_fwd_bwd)
    naive_t = try_run(lambda: bench.time_ms(naive_fwd_bwd))
    naive_m = try_run(lambda: bench.peak_mib(naive_fwd_bwd))
    liger_t = try_run(lambda: bench.time_ms(liger_fwd_bwd))
    liger_m = try_run(lambda: bench.peak_mib(liger_fwd_bwd))
    shape = f"N={n} d={d} V={v}"
    rows_out.append(dict(op="tree_logprobs", case="no-grad fwd", shape=shape, ms=t_nograd,
                         baseline="1 bf16 matmul", baseline_ms=t_mm, ratio=t_nograd / t_mm,
                         bar="<= 1.2", peak_mib=m_nograd))
    rows_out.append(dict(op="tree_logprobs", case="fwd+bwd", shape=shape, ms=t_fb,
                         baseline="3 bf16 matmuls", baseline_ms=t_3mm, ratio=t_fb / t_3mm,
                         bar="<= 1.5", peak_mib=m_fb))
    for name, bt, bm in (("naive torch", naive_t, naive_m), ("Liger FLCE", liger_t, liger_m)):
        row = dict(op="tree_logprobs", case="fwd+bwd", shape=shape, ms=t_fb, baseline=name)
        if isinstance(bt, float):
            row.update(baseline_ms=bt, ratio=t_fb / bt, baseline_peak_mib=bm, peak_mib=m_fb)
            if name == "naive torch" and isinstance(bm, float):
                row.update(mem_ratio=m_fb / bm, bar="mem <= 0.02")
        else:
            row.update(baseline_ms=bt)
        rows_out.append(row)
    return rows_out


def agent_parent(torch, n, gen):
    """A forest like a packed GRPO group: 4 samples under a shared prompt, turns with retries."""
    parent = list(range(-1, n // 8 - 1))
    per = (n - len(parent)) // 4
    for _ in range(4):
        attach, left = n // 8 - 1, per
        while left > 0:
            length = min(left, 256)
            start = len(parent)
            parent.extend([attach] + list(range(start, start + length - 1)))
            left -= length
            if float(torch.rand(1, generator=gen)) < 0.2:
                attach = start  # the next turn branches from inside this one (an edit/retry)
            else:
                attach = start + length - 1
    return torch.tensor(parent, dtype=torch.int32)


def kv_end_of(torch, parent):
    """kv_end[j]: the last row of j's subtree (rows in DFS order)."""
    end = list(range(parent.shape[0]))
    par = parent.tolist()
    for i in reversed(range(len(par))):
        if par[i] >= 0:
            end[par[i]] = max(end[par[i]], end[i])
    return torch.tensor(end, dtype=torch.int32)


def check_tree_attention(K, torch, device, gen, backend, dtype, tol, options=False):
    """``backend`` vs the dense float32 reference: output and q/k/v gradients (flex on a CPU: the
    output only, FlexAttention having no CPU backward). ``options``: with a sliding window,
    soft-capping and sinks (and their gradient)."""
    n, hq, hkv, d = (40, 4, 2, 16) if device.type == "cpu" else (1500, 8, 2, 64)
    kv_end = kv_end_of(torch, agent_parent(torch, n, gen)).to(device)
    n = kv_end.shape[0]
    grads = not (backend == "flex" and device.type == "cpu")
    q, k, v = (torch.randn(n, h, d, generator=gen).to(device, dtype).requires_grad_(grads) for h in (hq, hkv, hkv))
    g = torch.randn(n, hq, d, generator=gen).to(device)
    extra = dict(window=max(2, n // 8), softcap=5.0) if options else {}
    if options:
        extra["sinks"] = torch.randn(hq, generator=gen).to(device, dtype).requires_grad_(grads)
    out = K.tree_attention(q, k, v, kv_end, backend=backend, **extra)
    inputs = [q, k, v] + ([extra["sinks"]] if "sinks" in extra else [])
    refs = [t.detach().float().requires_grad_() for t in inputs]
    ref = K.tree_attention_ref(*refs[:3], kv_end, **{**extra, "sinks": refs[3] if "sinks" in extra else None})
    errs = dict(out=rel(torch, out, ref))
    if grads:
        (out.float() * g).sum().backward()
        (ref * g).sum().backward()
        errs.update({f"d{name}": rel(torch, t.grad, r.grad) for name, t, r in zip("qkvs", inputs, refs)})
    case = f"check {backend} {str(dtype)[6:]}" + (" window+softcap+sinks" if options else "")
    return dict(op="tree_attention", case=case + ("" if grads else " fwd"),
                shape=f"N={n} Hq={hq} Hkv={hkv} D={d}", err=max(errs.values()), tol=tol)


def bench_tree_attention(K, torch, bench, device, n, gen):
    """Forward+backward of Triton, FlexAttention and dense-mask SDPA on one agent-shaped forest."""
    import torch.nn.functional as F

    cpu = device.type == "cpu"
    hq, hkv, d, dtype = (4, 2, 16, torch.float32) if cpu else (32, 8, 128, torch.bfloat16)
    kv_end = kv_end_of(torch, agent_parent(torch, n, gen)).to(device)
    n = kv_end.shape[0]
    mask = K.TreeMask(kv_end)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    g = torch.randn(n, hq, d, generator=gen).to(device, dtype)

    def step(backend):
        def run():
            qq, kk, vv = (t.detach().requires_grad_(not (cpu and backend == "flex")) for t in (q, k, v))
            out = K.tree_attention(qq, kk, vv, mask, backend=backend)
            if out.requires_grad:
                out.backward(g)
            return out
        return run

    def dense():
        qq, kk, vv = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
        allowed = K.tree_mask_ref(kv_end)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, enable_gqa=True)
        out.backward(g.transpose(0, 1)[None])
        return out

    shape = f"N={n} Hq={hq} Hkv={hkv} D={d} pairs/causal={mask.visible_pairs() / (n * (n + 1) / 2):.2f}"
    t_tri, m_tri = bench.time_ms(step("triton")), bench.peak_mib(step("triton"))
    rows = []
    for name, fn in (("flex", step("flex")), ("dense sdpa", dense)):
        bt = try_run(lambda: bench.time_ms(fn))
        bm = try_run(lambda: bench.peak_mib(fn))
        row = dict(op="tree_attention", case="fwd+bwd triton" + (" (flex: fwd)" if cpu and name == "flex" else ""),
                   shape=shape, ms=t_tri, baseline=name, peak_mib=m_tri)
        row.update(baseline_ms=bt, ratio=t_tri / bt if isinstance(bt, float) else "")
        if isinstance(bm, float):
            row.update(baseline_peak_mib=bm, mem_ratio=m_tri / bm if bm == bm and bm > 0 else "")
        rows.append(row)
    return rows


def bench_small_ops(K, torch, bench, device, n, gen):
    out = []
    parent = agent_parent(torch, n, gen).to(device)
    nn = parent.shape[0]
    r = torch.randn(nn, generator=gen).to(device)
    v = torch.randn(nn, generator=gen).to(device)
    mask = (torch.rand(nn, generator=gen) < 0.7).float().to(device)
    for mode in ("path", "tree"):
        a_t, _ = K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="triton")
        a_c, _ = K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="torch")
        t_t = bench.time_ms(lambda: K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="triton"))
        t_c = bench.time_ms(lambda: K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="torch"))
        out.append(dict(op="tree_gae", case=mode, shape=f"N={nn}", ms=t_t, baseline="torch path",
                        baseline_ms=t_c, ratio=t_t / t_c, err=rel(torch, a_t, a_c), tol=1e-5))
    # The per-step loop a trainer without a tree kernel runs (one Python step per row, on the host,
    # where such a loop lives): timed once, the device copy back included.
    host = [t.cpu() for t in (r, v, parent, mask)]
    t0 = time.perf_counter()
    a_loop, _ = K.tree_gae_ref(host[0], host[1], host[2], mask=host[3], mode="tree")
    t_loop = (time.perf_counter() - t0) * 1e3
    t_t = bench.time_ms(lambda: K.tree_gae(r, v, parent, mask=mask, mode="tree", backend="triton"))
    a_t, _ = K.tree_gae(r, v, parent, mask=mask, mode="tree", backend="triton")
    out.append(dict(op="tree_gae", case="tree", shape=f"N={nn}", ms=t_t, baseline="per-step loop (host)",
                    baseline_ms=t_loop, ratio=t_t / t_loop, err=rel(torch, a_t.cpu(), a_loop), tol=1e-5))
    m = nn
    infer = -torch.rand(m, generator=gen).to(device) * 3
    train = infer + 0.1 * torch.randn(m, generator=gen).to(device)
    tmask = (torch.rand(m, generator=gen) < 0.9).float().to(device)
    seq = torch.randint(0, 64, (m,), generator=gen).to(device)
    paths = K.TreePaths.from_sequences(seq, num_seqs=64)
    for level in ("token", "sequence"):
        cfg = K.ISConfig(level=level, mode="mask" if level == "sequence" else "truncate")
        res_t = K.importance_weights(train, infer, tmask, config=cfg, paths=paths, backend="triton")
        res_c = K.importance_weights(train, infer, tmask, config=cfg, paths=paths, backend="torch")
        err = max([rel(torch, res_t.weights, res_c.weights)]
                  + [abs(res_t.metrics[k] - res_c.metrics[k]) / max(abs(res_c.metrics[k]), 1.0)
                     for k in res_c.metrics])
        t_t = bench.time_ms(lambda: K.importance_weights(train, infer, tmask, config=cfg, paths=paths,
                                                         backend="triton"))
        t_c = bench.time_ms(lambda: K.importance_weights(train, infer, tmask, config=cfg, paths=paths,
                                                         backend="torch"))
        out.append(dict(op="importance_weights", case=level, shape=f"M={m}", ms=t_t,
                        baseline="torch path", baseline_ms=t_c, ratio=t_t / t_c, err=err, tol=1e-5))
    adv = torch.randn(m, generator=gen).to(device)

    def loss_step():
        lp = train.detach().requires_grad_()
        loss, _ = K.policy_loss(lp, infer, adv, mask=tmask, infer_logprobs=infer, dual_clip=3.0,
                                aggregation="seq-mean-token-mean", seq_ids=seq, backend="triton")
        loss.backward()

    out.append(dict(op="policy_loss", case="fwd+bwd, token IS", shape=f"M={m}",
                    ms=bench.time_ms(loss_step)))
    return out


def print_table(rows):
    cols = ["op", "case", "shape", "ms", "baseline", "baseline_ms", "ratio", "bar", "peak_mib",
            "baseline_peak_mib", "mem_ratio", "err", "tol"]
    print(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c, "")
            cells.append(f"{x:.4g}" if isinstance(x, float) else str(x))
        print(" | ".join(cells))


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        # must precede the first import of triton (decides interpreted vs compiled kernels)
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    import clawfast.kernels as K
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        sys.exit("no CUDA device: run with --smoke (TRITON_INTERPRET=1 on the CPU)")
    if args.smoke:
        lp_tokens, attn_tokens, gae_tokens, d, v, repeats, warmup = [40], [64], 160, 32, 80, 1, 1
    else:
        lp_tokens, attn_tokens, gae_tokens = args.logprob_tokens, args.attention_tokens, args.gae_tokens
        d, v, repeats, warmup = args.hidden, args.vocab, args.repeats, args.warmup
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    bench = Bench(torch, device, warmup, repeats)
    failures = []
    rows = []
    for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        ok, errs = check_logprobs(K, torch, device, dt, d if args.smoke else 1024,
                                  v if args.smoke else 32000, gen, tol)
        rows.append(dict(op="tree_logprobs", case=f"check {str(dt)[6:]}", err=max(errs.values()),
                         tol=tol, shape="slice"))
        if not ok:
            failures.append(f"tree_logprobs {dt}: {errs}")
    for backend in ("triton", "flex"):
        for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            rows.append(check_tree_attention(K, torch, device, gen, backend, dt, tol))
        rows.append(check_tree_attention(K, torch, device, gen, backend, torch.float32, 1e-4, options=True))
    for n in lp_tokens:
        rows += bench_logprobs(K, torch, bench, device, dtype, n, d, v, gen)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for n in attn_tokens:
        rows += bench_tree_attention(K, torch, bench, device, n, gen)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows += bench_small_ops(K, torch, bench, device, gae_tokens, gen)
    for r in rows:
        if "err" in r and not r["err"] <= r["tol"]:
            failures.append(f"{r['op']} {r['case']}: err {r['err']:.3g} > {r['tol']}")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (TRITON_INTERPRET=1)'}")
    print_table(rows)
    out = args.out or (None if args.smoke else RESULTS / "gpu_kernels.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(device=str(device), smoke=args.smoke, rows=rows), indent=2))
        print(f"wrote {out}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

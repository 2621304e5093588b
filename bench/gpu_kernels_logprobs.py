"""The log-prob cases of bench/gpu_kernels.py (its sections 1 and 4): ``tree_logprobs`` against one and
three bf16 matmuls of its shape, the naive ``log_softmax(h @ W.T).gather``, Liger-Kernel's fused linear
cross-entropy and Cut Cross-Entropy; then with the entropy's gradient."""

from __future__ import annotations

from importlib import import_module

from gpu_kernels_timing import Timing, describe, note, secs, try_time, versus


def bench_logprobs(K, torch, bench, cases, rows, device, n, d, v, gen, backend):
    dtype = torch.bfloat16
    h = (torch.randn(n, d, generator=gen, device=device) * 0.5).to(dtype)
    w = (torch.randn(v, d, generator=gen, device=device) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    target_rows = torch.arange(n, device=device, dtype=torch.int32)
    target_ids = labels.to(torch.int32)
    shape = f"N={n} d={d} V={v} bf16, one target per row"
    op = "tree_logprobs"
    mm_flops = 2.0 * n * d * v

    def one_mm():
        h @ w.t()

    chunk_product = import_module("clawfast.kernels.tree_logprobs")
    w_logits = chunk_product._matmul_weight(h, w)

    def one_mm_float32():  # the chunks' own product (`_logits`): float32 logits from bf16 operands
        chunk_product._logits(h, w_logits)

    def three_mm():
        z = h @ w.t()
        z @ w
        z.t() @ h

    def ours_nograd():
        with torch.no_grad():
            lp, _ = K.tree_logprobs(h, w, target_rows, target_ids, backend=backend)
        return -lp.sum()  # the summed NLL, as the peers' reduction="sum" returns it

    def ours_fwd_bwd(entropy=False):
        def run():
            hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
            lp, ent = K.tree_logprobs(hg, wg, target_rows, target_ids, backend=backend)
            loss = -lp.sum() - (0.01 * ent.sum() if entropy else 0.0)
            loss.backward()
            return -lp.sum().detach()
        return run

    def naive_fwd_bwd():
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        logp = torch.log_softmax((hg @ wg.t()).float(), dim=-1)
        loss = -logp.gather(1, labels[:, None]).sum()
        loss.backward()
        return loss.detach()

    def agree(ours: Timing, base) -> str:
        if not isinstance(base, Timing) or base.value is None or ours.value is None:
            return ""
        a, b = float(ours.value), float(base.value)
        return f"summed NLL {a:.6g} vs {b:.6g} (rel diff {abs(a - b) / max(abs(b), 1e-30):.1e})"

    out = {}
    # (key, case, ours, its matmul baseline, how many matmuls, bar, what the first call compiles)
    for key, case, fn, base_fn, mms, bar, first in (
            ("nograd", "no-grad forward", ours_nograd, one_mm, 1, "<= 1.2", "Triton compile"),
            ("fb", "fwd+bwd (log-likelihood)", ours_fwd_bwd(), three_mm, 3, "<= 1.5", "backward compile")):
        row = dict(op=op, case=case, shape=shape)
        if not cases.fits("logprobs", **row):
            continue
        try:
            base = bench.measure(base_fn)
            ours = bench.measure(fn)
            out[key] = ours
            baseline = "1 bf16 matmul (h @ W.T)" if mms == 1 else "3 bf16 matmuls (logits, dh, dW)"
            rows.add(**versus(ours, base, **row, baseline=baseline, bar=bar, note=note(
                f"first call {secs(ours.first_ms)} ({first})",
                f"{'matmul' if mms == 1 else f'{mms} matmuls'} {mms * mm_flops / base.ms / 1e9:.0f} TFLOP/s"
                if bench.cuda else "")))
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, **row)
    fb, ng = out.get("fb"), out.get("nograd")
    # the no-grad pass against its own matmul (float32 logits, which the bf16 matmul above does not
    # write): the rest of the ratio is the passes over the chunks and the targets' dot products
    row = dict(op=op, case="no-grad forward", shape=shape,
               baseline="1 bf16 matmul writing float32 (torch.mm out_dtype: the chunks' own product)")
    if ng is not None and cases.fits("matmul", **row):
        base = try_time(bench, one_mm_float32)
        rows.add(**versus(ng, base, **row, note=note(
            f"{mm_flops / base.ms / 1e9:.0f} TFLOP/s" if isinstance(base, Timing) and bench.cuda else "")))
    if fb is None:
        return out

    row = dict(op=op, case="fwd+bwd (log-likelihood)", shape=shape, baseline="naive torch log_softmax(h @ W.T)")
    if cases.fits("naive", **row):
        base = try_time(bench, naive_fwd_bwd)
        rows.add(**versus(fb, base, **row, bar="mem <= 0.02", note=agree(fb, base)))

    # Liger-Kernel: its module, as a transformer model's loss would call it.
    row = dict(op=op, case="fwd+bwd (log-likelihood)", shape=shape)
    try:
        import importlib.metadata

        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_name = f"Liger-Kernel {importlib.metadata.version('liger-kernel')} LigerFusedLinearCrossEntropyLoss"
    except Exception as exc:  # noqa: BLE001 - one row says why, never silently dropped
        rows.add(**row, baseline="Liger-Kernel fused linear cross-entropy", note=f"not importable: {describe(exc)}")
    else:
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_fwd_bwd():
            hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss = liger(wg, hg, labels)
            loss.backward()
            return loss.detach()

        def liger_nograd():
            with torch.no_grad():
                return liger(w, h, labels)

        if cases.fits("liger", **row, baseline=liger_name):
            base = try_time(bench, liger_fwd_bwd)
            rows.add(**versus(fb, base, **row, baseline=liger_name, note=note(
                agree(fb, base), f"Liger's first call {secs(base.first_ms)}" if isinstance(base, Timing) else "")))
            if ng is not None:
                base = try_time(bench, liger_nograd)
                rows.add(**versus(ng, base, op=op, case="no-grad forward", shape=shape, baseline=liger_name,
                                  note=agree(ng, base)))

    # Cut Cross-Entropy: its own Triton kernels (impl="cce"), as shipped and exact.
    try:
        from cut_cross_entropy import __version__ as cce_version
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:  # noqa: BLE001
        rows.add(**row, baseline="Cut Cross-Entropy linear_cross_entropy", note=f"not importable: {describe(exc)}")
    else:
        def cce_fwd_bwd(filter_eps):
            def run():
                hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
                loss = linear_cross_entropy(hg, wg, labels, reduction="sum", filter_eps=filter_eps, impl="cce")
                loss.backward()
                return loss.detach()
            return run

        def cce_nograd():
            with torch.no_grad():
                return linear_cross_entropy(h, w, labels, reduction="sum", impl="cce")

        for eps, label, extra in (
                ("high", "filter_eps='high' (default: gradient blocks below 2^-12 skipped)",
                 "approximate gradient; on random weights the softmax is near uniform (~1/V per entry), so "
                 "nearly every block is skipped"),
                (None, "filter_eps=None (exact gradient)", "")):
            name = f"Cut Cross-Entropy {cce_version} linear_cross_entropy(impl='cce', {label})"
            if not cases.fits("cce", **row, baseline=name):
                break
            base = try_time(bench, cce_fwd_bwd(eps))
            rows.add(**versus(fb, base, **row, baseline=name, note=note(
                agree(fb, base), extra, f"CCE's first call {secs(base.first_ms)}" if isinstance(base, Timing) else "")))
        if ng is not None and cases.fits("cce", op=op, case="no-grad forward", shape=shape):
            name = f"Cut Cross-Entropy {cce_version} linear_cross_entropy(impl='cce')"
            base = try_time(bench, cce_nograd)
            rows.add(**versus(ng, base, op=op, case="no-grad forward", shape=shape, baseline=name,
                              note=agree(ng, base)))
    out["run_entropy"] = ours_fwd_bwd(entropy=True)
    out["three_mm"] = three_mm
    out["shape"] = shape
    return out


def bench_logprobs_entropy(bench, cases, rows, lp):
    """Section 4: the trainer's form with an entropy bonus (the entropy's gradient: one more compiled variant)."""
    if "run_entropy" not in lp:
        return
    row = dict(op="tree_logprobs", case="fwd+bwd (log-likelihood + entropy)", shape=lp["shape"])
    if not cases.fits("entropy", **row):
        return
    try:
        ours = bench.measure(lp["run_entropy"])
        mm3 = bench.measure(lp["three_mm"])
        extra = f"{ours.ms / lp['fb'].ms:.2f}x the log-likelihood-only time" if "fb" in lp else ""
        rows.add(**versus(ours, mm3, **row, baseline="3 bf16 matmuls (logits, dh, dW)", bar="<= 1.5", note=note(
            f"first call {secs(ours.first_ms)} (the entropy-gradient variant's compile)", extra)))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)

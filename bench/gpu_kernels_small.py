"""The small ops of bench/gpu_kernels.py (its section 3): ``tree_gae`` (path and tree modes) against the
torch path and the per-step loop on the host; ``importance_weights`` and ``policy_loss`` against the
torch path."""

from __future__ import annotations

import time

from gpu_forests import agent_parent
from gpu_kernels_timing import Timing, note, secs, try_time, versus


def bench_small_ops(K, torch, bench, cases, rows, device, n, gen):
    if not cases.fits("small", op="tree_gae", case="path, tree, loop; importance_weights; policy_loss"):
        return

    def rel(a, b) -> float:
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0

    gen_host = torch.Generator().manual_seed(n)
    parent = agent_parent(torch, n, gen_host).to(device)
    nn = parent.shape[0]
    r = torch.randn(nn, generator=gen, device=device)
    v = torch.randn(nn, generator=gen, device=device)
    mask = (torch.rand(nn, generator=gen, device=device) < 0.7).float()
    first_tree = None
    for mode in ("path", "tree"):
        row = dict(op="tree_gae", case=mode, shape=f"N={nn} agent forest")
        try:
            ours = bench.measure(lambda: K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="triton")[0])
            base = try_time(bench, lambda: K.tree_gae(r, v, parent, mask=mask, mode=mode, backend="torch")[0])
            diff = rel(ours.value, base.value) if isinstance(base, Timing) else None
            rows.add(**versus(ours, base, **row, baseline="torch path", note=note(
                f"first call {secs(ours.first_ms)} (compile)",
                f"max rel diff vs torch {diff:.1e}" if diff is not None else "")))
            if mode == "tree":
                first_tree = ours
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, **row)
    # The per-step loop a trainer without a tree kernel runs (one Python step per row, on the host,
    # where such a loop lives): timed once, the copy to the host included.
    row = dict(op="tree_gae", case="tree", shape=f"N={nn} agent forest", baseline="per-step loop (host)")
    if first_tree is not None:
        try:
            t0 = time.perf_counter()
            host = [t.cpu() for t in (r, v, parent, mask)]
            a_loop, _ = K.tree_gae_ref(host[0], host[1], host[2], mask=host[3], mode="tree")
            t_loop = (time.perf_counter() - t0) * 1e3
            rows.add(**row, ms=first_tree.ms, baseline_ms=t_loop, ratio=first_tree.ms / t_loop,
                     note=f"max rel diff vs the loop {rel(first_tree.value, a_loop):.1e}; the loop timed once")
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=False, **row)
    m = nn
    infer = -torch.rand(m, generator=gen, device=device) * 3
    train = infer + 0.1 * torch.randn(m, generator=gen, device=device)
    tmask = (torch.rand(m, generator=gen, device=device) < 0.9).float()
    seq = torch.randint(0, 64, (m,), generator=gen, device=device)
    paths = K.TreePaths.from_sequences(seq, num_seqs=64)
    for level in ("token", "sequence"):
        row = dict(op="importance_weights", case=level, shape=f"M={m}, 64 sequences")
        try:
            cfg = K.ISConfig(level=level, mode="mask" if level == "sequence" else "truncate")

            def run(backend, cfg=cfg):
                return K.importance_weights(train, infer, tmask, config=cfg, paths=paths, backend=backend)

            ours = bench.measure(lambda: run("triton"))
            base = try_time(bench, lambda: run("torch"))
            diff = rel(ours.value.weights, base.value.weights) if isinstance(base, Timing) else None
            rows.add(**versus(ours, base, **row, baseline="torch path", note=note(
                f"first call {secs(ours.first_ms)} (compile)",
                f"max rel diff of the weights vs torch {diff:.1e}" if diff is not None else "")))
        except Exception as exc:  # noqa: BLE001
            cases.error(exc, ours=True, **row)
    adv = torch.randn(m, generator=gen, device=device)

    def loss_step(backend):
        def run():
            lp = train.detach().requires_grad_()
            loss, _ = K.policy_loss(lp, infer, adv, mask=tmask, infer_logprobs=infer, dual_clip=3.0,
                                    aggregation="seq-mean-token-mean", seq_ids=seq, backend=backend)
            loss.backward()
            return loss.detach()
        return run

    row = dict(op="policy_loss", case="fwd+bwd, token IS", shape=f"M={m}")
    try:
        ours = bench.measure(loss_step("triton"))
        base = try_time(bench, loss_step("torch"))
        diff = rel(ours.value, base.value) if isinstance(base, Timing) else None
        rows.add(**versus(ours, base, **row, baseline="torch path", note=note(
            f"first call {secs(ours.first_ms)} (compile)", f"loss rel diff vs torch {diff:.1e}" if diff is not None
            else "")))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)

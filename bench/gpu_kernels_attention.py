"""The attention cases of bench/gpu_kernels.py (its sections 2, 3 and 6): ``tree_attention`` forward+backward
on an agent forest against SDPA with the dense tree mask, on one causal chain against SDPA's causal
kernel, and against FlexAttention and flash-attention's varlen kernel (backend "varlen")."""

from __future__ import annotations

from gpu_forests import agent_parent, subtree_ends
from gpu_kernels_timing import Timing, note, secs, try_time, versus


class AttentionInputs:
    def __init__(self, K, torch, device, n, gen):
        cpu = device.type == "cpu"
        self.cpu = cpu
        self.hq, self.hkv, self.d = (4, 2, 16) if cpu else (32, 8, 128)
        self.dtype = torch.float32 if cpu else torch.bfloat16
        gen_host = torch.Generator().manual_seed(n)  # the forest's shape: drawn on the host
        parent = agent_parent(torch, n, gen_host).tolist()
        self.kv_end = torch.tensor(subtree_ends(parent), dtype=torch.int32, device=device)
        self.n = n = self.kv_end.shape[0]
        self.mask = K.TreeMask(self.kv_end)
        self.q, self.k, self.v = (torch.randn(n, h, self.d, generator=gen, device=device).to(self.dtype)
                                  for h in (self.hq, self.hkv, self.hkv))
        self.g = torch.randn(n, self.hq, self.d, generator=gen, device=device).to(self.dtype)
        pairs = self.mask.visible_pairs()
        self.pairs = pairs
        self.shape = (f"N={n} Hq={self.hq} Hkv={self.hkv} D={self.d} {str(self.dtype)[6:]}, agent forest, "
                      f"pairs/causal={pairs / (n * (n + 1) / 2):.2f}")

    def flops(self, pairs, backward: bool = True):
        # the forward: 2 matmuls per pair; the backward 2.5x the forward
        return (3.5 if backward else 1.0) * 4.0 * self.hq * self.d * pairs


def tree_step(K, torch, x: AttentionInputs, backend, mask=None):
    """Forward+backward of tree attention (forward only for flex on a CPU: no flex backward there)."""
    grads = not (x.cpu and backend == "flex")
    mask = x.mask if mask is None else mask

    def run():
        q, k, v = (t.detach().requires_grad_(grads) for t in (x.q, x.k, x.v))
        out = K.tree_attention(q, k, v, mask, backend=backend)
        if grads:
            out.backward(x.g)
    return run


def bench_attention(K, torch, bench, cases, rows, x: AttentionInputs, with_chain: bool):
    """Triton vs SDPA with the dense mask on the forest; Triton vs SDPA causal on one chain."""
    import torch.nn.functional as F

    op = "tree_attention"
    row = dict(op=op, case="fwd+bwd triton", shape=x.shape)
    if not cases.fits("attention" if with_chain else "attention_big", **row, baseline="dense SDPA"):
        return None
    try:
        ours = bench.measure(tree_step(K, torch, x, "triton"))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)
        return None

    def dense():
        # key/value heads repeated for the query heads, as HF's SDPA path does with a mask: the
        # memory-efficient kernel takes a mask but no GQA (enable_gqa would fall back to math)
        q, k, v = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (x.q, x.k, x.v))
        rep = x.hq // x.hkv
        allowed = K.tree_mask_ref(x.kv_end)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=allowed)
        out.backward(x.g.transpose(0, 1)[None])

    base = try_time(bench, dense)
    dense_name = "dense SDPA (bool [N, N] tree mask; k, v repeated to Hq heads)"
    rows.add(**versus(ours, base, **row, baseline=dense_name, note=note(
        f"first call {secs(ours.first_ms)} (compile)",
        f"triton {x.flops(x.pairs) / ours.ms / 1e9:.0f} TFLOP/s on the visible pairs" if bench.cuda else "")))
    if not with_chain:
        return ours
    cases.free()
    # One plain causal chain of N rows: the same kernel on a flat sample, against the kernel a flat
    # trainer runs (SDPA is_causal: torch's flash backend on a GPU); forward+backward, then the
    # forward alone, so that the gap splits into the forward kernel's and the backward kernels' shares.
    chain = K.TreeMask(torch.full_like(x.kv_end, x.n - 1))
    shape = f"N={x.n} Hq={x.hq} Hkv={x.hkv} D={x.d} {str(x.dtype)[6:]}, one sequence"
    if cases.fits("chain", op=op, case="one causal chain", shape=shape):
        for backward in (True, False):
            if not _chain_row(K, torch, bench, cases, rows, x, chain, shape, backward):
                break
    return ours


def _chain_row(K, torch, bench, cases, rows, x: AttentionInputs, chain, shape: str, backward: bool) -> bool:
    """Triton vs SDPA is_causal on one causal chain, forward+backward or forward only (False: ours raised)."""
    import torch.nn.functional as F

    row = dict(op="tree_attention", case=f"{'fwd+bwd' if backward else 'forward'} triton, one causal chain",
               shape=shape)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def causal():
        q, k, v = (t.detach().transpose(0, 1)[None].requires_grad_(backward) for t in (x.q, x.k, x.v))
        if backward:
            sdpa(q, k, v).backward(x.g.transpose(0, 1)[None])
        else:
            with torch.no_grad():
                sdpa(q, k, v)

    def tree_forward():
        with torch.no_grad():
            K.tree_attention(x.q, x.k, x.v, chain, backend="triton")

    try:
        mine = bench.measure(tree_step(K, torch, x, "triton", chain) if backward else tree_forward)
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)
        return False
    base = try_time(bench, causal)
    flops = x.flops(x.n * (x.n + 1) // 2, backward)
    rows.add(**versus(mine, base, **row, baseline="SDPA is_causal (torch's flash backend on a GPU)"
                      + ("" if backward else ", forward"), note=note(
        f"triton {flops / mine.ms / 1e9:.0f} TFLOP/s" if bench.cuda else "",
        f"SDPA {flops / base.ms / 1e9:.0f} TFLOP/s" if bench.cuda and isinstance(base, Timing) else "")))
    return True


def bench_backend(K, torch, bench, cases, rows, x: AttentionInputs, ours: Timing | None, backend: str):
    """Triton vs another backend of ``tree_attention`` on the forest, forward+backward: which one
    ``attention="auto"`` should run on a GPU. ``"flex"``: FlexAttention (compiled, the tree's block
    mask; forward only on a CPU; its compile reported); ``"varlen"``: flash-attention's varlen kernel
    over the forest's path segments, their ancestors' keys gathered (CUDA only: on a CPU the row says
    why)."""
    if backend == "flex":
        case = "fwd+bwd triton" + (" (flex: forward only on a CPU)" if x.cpu else "")
        baseline = "FlexAttention (compiled, the tree's block mask)"
    else:
        case, baseline = "fwd+bwd triton", "varlen (flash-attention's varlen kernel over the path segments)"
    row = dict(op="tree_attention", case=case, shape=x.shape, baseline=baseline)
    if not cases.fits(backend, **row):
        return
    try:
        ours = ours or bench.measure(tree_step(K, torch, x, "triton"))
    except Exception as exc:  # noqa: BLE001
        cases.error(exc, ours=True, **row)
        return
    base = try_time(bench, tree_step(K, torch, x, backend))
    timed = isinstance(base, Timing)
    if backend == "flex":
        parts = [f"flex's first call {secs(base.first_ms)} (torch.compile)" if timed else ""]
    else:
        seg = x.mask.path_segments()
        parts = [f"{seg.cu_q.shape[0] - 1} segments, keys gathered {seg.gathered_rows / x.n:.2f}x the rows",
                 f"varlen {x.flops(x.pairs) / base.ms / 1e9:.0f} TFLOP/s on the visible pairs"
                 if bench.cuda and timed else ""]
    rows.add(**versus(ours, base, **row, note=note(*parts)))

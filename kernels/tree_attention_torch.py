"""Tree attention's torch path: the CPU fast path (and the path of float64 and of what Triton refuses).

Online softmax over chunks of each query block's listed key blocks (`TreeMask.host_lists`) in plain
torch: a chunk of scores ``[Hq, B, C]`` at a time; full blocks unmasked, runs of consecutive blocks as
views. The backward recomputes the scores from the saved log-sum-exp, as flash-attention does.
Memory: O(N) besides one scores chunk of at most `_CPU_CHUNK_ELEMS` elements; no [N, N] tensor.
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, dropout_keep, dropout_threshold
from .tree_attention_schedule import Scores, TreeMask

# Query blocks of 128 rows; a scores chunk of at most 2**22 elements (16 MiB in float32) per step, so
# the key chunk shrinks as heads grow. Measured by bench/bench_tree_attention.py.
CPU_BLOCK = 128
_CPU_CHUNK_ELEMS = 1 << 22
# Runs of at least this many consecutive key blocks are attended in place; shorter ones are gathered.
_CPU_MIN_RUN = 4


def _key_chunks(blocks: list[int], block: int, n: int, per_chunk: int, device):
    """Cut an ascending list of key blocks into chunks of at most ``per_chunk`` blocks.

    Yields (rows, take): rows[C] are the key rows; take is a slice for a run of consecutive blocks
    (a view, no copy) and an index tensor for the short runs, gathered together so that a bushy
    ancestry does not turn into many tiny matmuls."""
    runs: list[list[int]] = []
    for kb in blocks:
        if runs and runs[-1][-1] == kb - 1:
            runs[-1].append(kb)
        else:
            runs.append([kb])
    scattered: list[int] = []
    for run in runs:
        if len(run) < _CPU_MIN_RUN:
            scattered += run
            continue
        for c in range(0, len(run), per_chunk):
            a, b = run[c] * block, min(n, (run[min(c + per_chunk, len(run)) - 1] + 1) * block)
            yield torch.arange(a, b, device=device), slice(a, b)
    for c in range(0, len(scattered), per_chunk):
        rows = torch.cat([torch.arange(kb * block, min(n, kb * block + block), device=device)
                          for kb in scattered[c : c + per_chunk]])
        yield rows, rows


def _take(t: torch.Tensor, take) -> torch.Tensor:
    """Rows ``take`` of a [H, N, D] tensor."""
    return t[:, take] if isinstance(take, slice) else t.index_select(1, take)


def _cpu_layout(q, k, v, dt, scale: float):
    """Head-major copies in the accumulation dtype: q * scale [Hkv, G, N, D], k and v [Hkv, N, D].
    One O(N) copy up front makes every row slice a plain strided matrix for bmm (no copy per
    chunk); folding the scale into q saves a pass over every scores chunk."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    qh = (q.permute(1, 0, 2).to(dt) * scale).contiguous().view(hkv, hq // hkv, n, d)
    return qh, k.permute(1, 0, 2).to(dt).contiguous(), v.permute(1, 0, 2).to(dt).contiguous()


def _query_blocks(mask: TreeMask, block: int, heads: int, window: int | None, device):
    """Per query block: (start, end, its rows, chunks), chunks yielding (rows, take, hidden) for each chunk
    of its listed key rows: ``rows`` are their indices, ``take`` selects them (`_take`), ``hidden``
    is bool [query rows, keys] where a key is not visible to a row, or None for a chunk of full
    blocks (every row sees every key: most ancestor blocks), which then needs no mask at all."""
    n = mask.num_rows
    kv_end = mask.kv_end.long()
    depth = None if window is None else mask.depth().long()
    ptr, part, idx = mask.host_lists(block, window)
    per_chunk = max(1, _CPU_CHUNK_ELEMS // (heads * block * block))

    def chunks(qb: int, rows_i: torch.Tensor):
        for rows_j, take in _key_chunks(idx[ptr[qb] : part[qb]], block, n, per_chunk, device):
            yield rows_j, take, None
        for rows_j, take in _key_chunks(idx[part[qb] : ptr[qb + 1]], block, n, per_chunk, device):
            hidden = (rows_j[None, :] > rows_i[:, None]) | (kv_end[rows_j][None, :] < rows_i[:, None])
            if depth is not None:
                hidden |= depth[rows_i][:, None] - depth[rows_j][None, :] >= window
            yield rows_j, take, hidden

    for qb in range(len(ptr) - 1):
        s, e = qb * block, min(n, qb * block + block)
        rows_i = torch.arange(s, e, device=device)
        yield s, e, rows_i, chunks(qb, rows_i)


def _dropout_scale(rule: Scores, hkv: int, g: int, rows_i: torch.Tensor, rows_j: torch.Tensor, dt):
    """[Hkv, G * Bq, C]: 1 / (1 - p) where an entry survives dropout, 0 where it is dropped; None
    without dropout."""
    if not rule.dropout_p:
        return None
    heads = torch.arange(hkv * g, device=rows_i.device).view(hkv, g)
    keep = dropout_keep(rule.seed, heads, rows_i, rows_j, dropout_threshold(rule.dropout_p))
    return (keep.to(dt) / (1.0 - rule.dropout_p)).view(hkv, g * rows_i.shape[0], -1)


def forward_torch(q, k, v, sinks, mask: TreeMask, rule: Scores, block: int):
    """(out [N, Hq, D] in q's dtype, log-sum-exp [Hkv, G, N] in the accumulation dtype), query blocks of
    ``block`` rows."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dt = acc_dtype(q.dtype)
    cap = rule.softcap
    qh, kh, vh = _cpu_layout(q, k, v, dt, rule.scale)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(hkv, g, n, dtype=dt, device=q.device)
    for s, e, rows_i, chunks in _query_blocks(mask, block, hq, rule.window, q.device):
        bq = e - s
        qq = qh[:, :, s:e].reshape(hkv, g * bq, d)
        m = torch.full((hkv, g * bq), float("-inf"), dtype=dt, device=q.device)
        l = torch.zeros(hkv, g * bq, dtype=dt, device=q.device)
        acc = torch.zeros(hkv, g * bq, d, dtype=dt, device=q.device)
        for rows_j, take, hidden in chunks:
            sc = torch.bmm(qq, _take(kh, take).transpose(1, 2))  # [Hkv, G*Bq, C], scaled through q
            if cap is not None:
                sc.div_(cap).tanh_().mul_(cap)
            if hidden is not None:
                sc.view(hkv, g, bq, -1).masked_fill_(hidden, float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            # a chunk can hide every key from a row (its keys lie on another branch): keep -inf - -inf out
            shift = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = sc.sub_(shift[..., None]).exp_()
            alpha = torch.exp(m - shift)
            l = l * alpha + p.sum(-1)
            z = _dropout_scale(rule, hkv, g, rows_i, rows_j, dt)
            if z is not None:  # the normaliser counts every key; the weighted sum only the kept ones
                p.mul_(z)
            acc = acc * alpha[..., None] + torch.bmm(p, _take(vh, take))
            m = m_new
        o = acc / l[..., None]
        lse_b = (m + torch.log(l)).view(hkv, g, bq)
        if sinks is not None:
            lse_b, o = _with_sinks(lse_b, o.view(hkv, g, bq, d), sinks.to(dt).view(hkv, g, 1))
        out[s:e] = o.view(hkv, g, bq, d).permute(2, 0, 1, 3).reshape(bq, hq, d).to(q.dtype)
        lse[:, :, s:e] = lse_b
    return out, lse


def _with_sinks(lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor):
    """Add each head's sink logit to the softmax's denominator (gpt-oss): the log-sum-exp grows to
    logaddexp(lse, sink) and the output shrinks by exp(lse - that). lse [..., R], out [..., R, D]."""
    total = torch.logaddexp(lse, sinks)
    return total, out * torch.exp(lse - total)[..., None]


def backward_torch(q, k, v, lse, delta, dout, mask: TreeMask, rule: Scores, block: int):
    """(dq, dk, dv) from the saved log-sum-exp and ``delta`` = rowsum(dO * O) [Hq, N]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dt = lse.dtype
    cap = rule.softcap
    qh, kh, vh = _cpu_layout(q, k, v, dt, rule.scale)
    doh = dout.to(dt).permute(1, 0, 2).reshape(hkv, g, n, d)
    delta = delta.view(hkv, g, n)
    dq = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(hkv, n, d, dtype=dt, device=q.device)
    dv = torch.zeros(hkv, n, d, dtype=dt, device=q.device)
    for s, e, rows_i, chunks in _query_blocks(mask, block, hq, rule.window, q.device):
        bq = e - s
        qq = qh[:, :, s:e].reshape(hkv, g * bq, d)
        do = doh[:, :, s:e].reshape(hkv, g * bq, d)
        neg_lse = lse[:, :, s:e].reshape(hkv, g * bq, 1).neg()
        neg_delta = delta[:, :, s:e].reshape(hkv, g * bq, 1).neg()
        dqq = torch.zeros(hkv, g * bq, d, dtype=dt, device=q.device)
        for rows_j, take, hidden in chunks:
            kk, vv = _take(kh, take), _take(vh, take)
            if cap is None:
                # baddbmm adds the broadcast -lse (and -delta below) inside the matmul: no extra pass
                p = torch.baddbmm(neg_lse, qq, kk.transpose(1, 2)).exp_()
            else:
                t = torch.bmm(qq, kk.transpose(1, 2)).div_(cap).tanh_()
                p = torch.add(neg_lse, t, alpha=cap).exp_()
            if hidden is not None:
                p.view(hkv, g, bq, -1).masked_fill_(hidden, 0.0)
            z = _dropout_scale(rule, hkv, g, rows_i, rows_j, dt)
            if z is None:
                dvv = torch.bmm(p.transpose(1, 2), do)  # [Hkv, C, D], summed over the group's heads
                ds = torch.baddbmm(neg_delta, do, vv.transpose(1, 2)).mul_(p)
            else:  # O = (P * Z) V: dV = (P * Z)^T dO, dP = (dO V^T) * Z; delta = rowsum(dO * O) still
                dvv = torch.bmm((p * z).transpose(1, 2), do)
                ds = torch.bmm(do, vv.transpose(1, 2)).mul_(z).add_(neg_delta).mul_(p)
            if cap is not None:
                ds.mul_(t.square_().neg_().add_(1.0))  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
            dqq.baddbmm_(ds, kk)
            dkk = torch.bmm(ds.transpose(1, 2), qq)  # q carries the scale: this is dK
            if isinstance(take, slice):
                dk[:, take] += dkk
                dv[:, take] += dvv
            else:
                dk.index_add_(1, take, dkk)
                dv.index_add_(1, take, dvv)
        dq[s:e] = (dqq * rule.scale).view(hkv, g, bq, d).permute(2, 0, 1, 3).reshape(bq, hq, d).to(q.dtype)
    return dq, dk.permute(1, 0, 2).to(k.dtype), dv.permute(1, 0, 2).to(v.dtype)

"""Tree attention: softmax attention over a packed prefix forest without an [N, N] tensor.

Rows are a forest in DFS order (docs/TREE.md); key j is visible to query i iff
``j <= i <= kv_end[j]``, so a query sees exactly its ancestors and itself. Inputs use the varlen
layout of flash-attention: q ``[N, Hq, D]``, k and v ``[N, Hkv, D]`` (GQA when Hq is a multiple of
Hkv, query head h reading key head ``h // (Hq // Hkv)``); the output is ``[N, Hq, D]``. A flat batch
of sequences is the special case of a forest of chains.

Block schedule (`TreeMask`): cut the rows into blocks of B. Key block kb holds a key visible to some
query of query block qb iff ``kb <= qb <= max(kv_end[kb-block]) // B`` (the key with the largest
kv_end sees the first row of every such block; no other block can see any key of kb). So each key
block is seen by one contiguous range of query blocks, and the schedule (the CSR list of key blocks
per query block, and the query-block range per key block) is built in O(N / B + pairs) without any
[N, N] or [N/B, N/B] tensor (only FlexAttention's ``BlockMask`` is a dense [N/128, N/128] index
table, as flex requires). A pair is *full* when every row of the query block sees every key of the
key block; only the other, *partial* pairs need the exact predicate, entry by entry. The cost
follows the visible pairs (ancestor counts), not N^2.

Layers (one op, one name):
- ``TreeMask`` / ``BlockSchedule``: kv_end, checked once, and its schedules (one per block size,
  cached), shared by every layer of a model; ``flex_block_mask()`` is the same schedule as a
  FlexAttention ``BlockMask`` (partial and full blocks).
- ``_forward_torch`` / ``_backward_torch``: the CPU fast path, online softmax over chunks of the
  listed key blocks in plain torch (a chunk of scores ``[Hq, B, C]`` at a time; full blocks
  unmasked, runs of consecutive blocks as views); the backward recomputes the scores from the
  saved log-sum-exp, as flash-attention does.
- ``_tree_attn_fwd_kernel``, ``_tree_attn_dq_kernel``, ``_tree_attn_dkdv_kernel``: Triton, one
  program per (query block, head) walking its key-block list, resp. per (key block, kv head)
  walking its query-block range (no atomics: dK/dV sum the group's query heads in one program).
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a ``mask_mod`` reading kv_end and
  the block mask above: the portable GPU path and the baseline of the Triton kernel. FlexAttention
  has no backward on CPU (torch 2.13): there it runs without gradients only.
- ``TreeAttentionFunction`` (autograd) and ``tree_attention`` (entry point).

Guaranteed: the result of ``tree_attention_ref`` (dense softmax under the mask) up to summation
order; softmax statistics in float32 (float64 for float64 inputs); memory O(N) besides one scores
chunk; every row sees at least itself, so no row is empty.
Not guaranteed: bitwise determinism across block sizes (summation order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._common import HAS_TRITON, acc_dtype, check_1d, check_int, triton_interpret

if HAS_TRITON:
    import triton
    import triton.language as tl

BACKENDS = ("auto", "torch", "triton", "flex")

# CPU: query blocks of 128 rows; a scores chunk of at most 2**22 elements (16 MiB in float32) per
# step, so the key chunk shrinks as heads grow. Measured by bench/bench_tree_attention.py.
_CPU_BLOCK = 128
_CPU_CHUNK_ELEMS = 1 << 22
# Runs of at least this many consecutive key blocks are attended in place; shorter ones are gathered.
_CPU_MIN_RUN = 4
# FlexAttention's default sparse block size.
_FLEX_BLOCK = 128


def _triton_block(head_dim: int) -> int:
    if triton_interpret():
        return 16  # small tiles keep the interpreter's per-element cost low
    return 64 if head_dim <= 128 else 32


# ----------------------------------------------------------------------------------------------
# The mask and its block schedules
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockSchedule:
    """The block pairs of a tree mask at one block size B (int32 tensors on kv_end's device).

    kv_ptr[QB + 1], kv_idx[P]: for query block qb, the key blocks ``kv_idx[kv_ptr[qb]:kv_ptr[qb+1]]``
    (ascending, the diagonal block last) that hold a key visible to one of its rows.
    q_hi[KB]: key block kb is seen by the query blocks ``kb ..= q_hi[kb]``.
    full_hi[KB]: of those, ``kb < qb <= full_hi[kb]`` see every key of kb from every row (full pairs,
    run without a mask by the CPU path and flex).
    """

    block: int
    num_blocks: int
    kv_ptr: torch.Tensor
    kv_idx: torch.Tensor
    q_hi: torch.Tensor
    full_hi: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.kv_idx.shape[0])


def _block_schedule(kv_end: torch.Tensor, block: int) -> BlockSchedule:
    n = kv_end.shape[0]
    nb = (n + block - 1) // block
    dev = kv_end.device
    pad = nb * block - n
    ke = kv_end.long()
    kb_max = torch.nn.functional.pad(ke, (0, pad), value=-1).view(nb, block).amax(1)
    kb_min = torch.nn.functional.pad(ke, (0, pad), value=n).view(nb, block).amin(1)
    blocks = torch.arange(nb, device=dev)
    q_hi = kb_max // block
    # every row of query block qb sees every key of kb iff kb < qb and the smallest kv_end of kb
    # reaches the block's last row (the last block ends at row n - 1)
    last_row = torch.clamp((blocks + 1) * block, max=n) - 1
    full_hi = torch.searchsorted(last_row, kb_min, right=True) - 1
    full_hi = torch.minimum(full_hi, q_hi)
    counts = q_hi - blocks + 1
    key_block = torch.repeat_interleave(blocks, counts)
    first = torch.cumsum(counts, 0) - counts
    query_block = blocks[key_block] + torch.arange(key_block.shape[0], device=dev) - first[key_block]
    order = torch.argsort(query_block, stable=True)  # key blocks stay ascending within a query block
    kv_ptr = torch.zeros(nb + 1, dtype=torch.long, device=dev)
    torch.cumsum(torch.bincount(query_block, minlength=nb), 0, out=kv_ptr[1:])
    i32 = torch.int32
    return BlockSchedule(block, nb, kv_ptr.to(i32), key_block[order].to(i32), q_hi.to(i32), full_hi.to(i32))


class TreeMask:
    """The tree mask of one packed batch: ``kv_end`` (checked once) and its block schedules.

    Build it once per micro-batch and pass it to every layer's `tree_attention` call: the schedule
    and the FlexAttention block mask are computed on first use and cached.
    """

    def __init__(self, kv_end: torch.Tensor):
        check_1d("kv_end", kv_end)
        check_int("kv_end", kv_end)
        n = kv_end.shape[0]
        if n == 0:
            raise ValueError("kv_end is empty: a tree batch has at least one row")
        rows = torch.arange(n, device=kv_end.device)
        bad = (kv_end < rows) | (kv_end >= n)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"kv_end[j] must lie in [j, N) for every row j (N = {n}); kv_end[{j}] = "
                             f"{int(kv_end[j])}")
        self.kv_end = kv_end.to(torch.int32).contiguous()
        self.num_rows = n
        self._schedules: dict[int, BlockSchedule] = {}
        self._host: dict[int, tuple[list[int], list[int], list[int]]] = {}
        self._flex = None

    @property
    def device(self) -> torch.device:
        return self.kv_end.device

    def schedule(self, block: int) -> BlockSchedule:
        """The block pairs at block size ``block`` (cached)."""
        if block not in self._schedules:
            self._schedules[block] = _block_schedule(self.kv_end, block)
        return self._schedules[block]

    def host_lists(self, block: int) -> tuple[list[int], list[int], list[int]]:
        """(kv_ptr, kv_idx, full_hi) of ``schedule(block)`` as Python lists (the CPU path loops over them)."""
        if block not in self._host:
            s = self.schedule(block)
            self._host[block] = (s.kv_ptr.tolist(), s.kv_idx.tolist(), s.full_hi.tolist())
        return self._host[block]

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the mask allows: the sum over rows of (ancestors + 1)."""
        # row j is seen by kv_end[j] - j + 1 queries
        rows = torch.arange(self.num_rows, device=self.device)
        return int((self.kv_end.long() - rows + 1).sum())

    def mask_mod(self):
        """The predicate in FlexAttention's ``mask_mod`` signature."""
        kv_end, last = self.kv_end, self.num_rows - 1

        def tree_mask_mod(b, h, q_idx, kv_idx):
            # flex may evaluate padding positions of a partial last block: keep the index in range
            return (kv_idx <= q_idx) & (kv_end[torch.clamp(kv_idx, max=last)] >= q_idx)

        return tree_mask_mod

    def flex_block_mask(self):
        """The schedule at flex's block size as a ``BlockMask`` (partial and full blocks), cached."""
        if self._flex is None:
            from torch.nn.attention.flex_attention import BlockMask

            s = self.schedule(_FLEX_BLOCK)
            nb = s.num_blocks
            qb, kb = _pairs(s)
            full = (kb < qb) & (qb <= s.full_hi.long()[kb])
            parts = []
            for sel in (~full, full):
                q_sel, k_sel = qb[sel], kb[sel]
                counts = torch.bincount(q_sel, minlength=nb)
                start = torch.cumsum(counts, 0) - counts
                rank = torch.arange(q_sel.shape[0], device=self.device) - start[q_sel]
                idx = torch.zeros(nb, nb, dtype=torch.int32, device=self.device)
                idx[q_sel, rank] = k_sel.to(torch.int32)
                parts += [counts.to(torch.int32)[None, None], idx[None, None]]
            self._flex = BlockMask.from_kv_blocks(*parts, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=self.mask_mod(),
                                                  seq_lengths=(self.num_rows, self.num_rows))
        return self._flex


def _pairs(s: BlockSchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """(query block, key block) of every listed pair, sorted by query block."""
    counts = (s.kv_ptr[1:] - s.kv_ptr[:-1]).long()
    qb = torch.repeat_interleave(torch.arange(s.num_blocks, device=counts.device), counts)
    return qb, s.kv_idx.long()


# ----------------------------------------------------------------------------------------------
# CPU fast path
# ----------------------------------------------------------------------------------------------


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


def _query_blocks(mask: TreeMask, block: int, heads: int, device):
    """Per query block: (start, end, chunks), chunks yielding (take, hidden) for each chunk of its
    listed key rows: ``take`` selects them (`_take`), ``hidden`` is bool [rows, keys] where a key is
    not visible to a row, or None for a chunk of full blocks (every row sees every key: most
    ancestor blocks), which then needs no mask at all."""
    n = mask.num_rows
    kv_end = mask.kv_end.long()
    ptr, idx, full_hi = mask.host_lists(block)
    per_chunk = max(1, _CPU_CHUNK_ELEMS // (heads * block * block))

    def chunks(qb: int, s: int, e: int):
        blocks = idx[ptr[qb] : ptr[qb + 1]]
        full = [kb for kb in blocks if kb < qb <= full_hi[kb]]
        for _, take in _key_chunks(full, block, n, per_chunk, device):
            yield take, None
        rows_i = torch.arange(s, e, device=device)
        partial = [kb for kb in blocks if not kb < qb <= full_hi[kb]]
        for rows_j, take in _key_chunks(partial, block, n, per_chunk, device):
            yield take, (rows_j[None, :] > rows_i[:, None]) | (kv_end[rows_j][None, :] < rows_i[:, None])

    for qb in range(len(ptr) - 1):
        s, e = qb * block, min(n, qb * block + block)
        yield s, e, chunks(qb, s, e)


def _forward_torch(q, k, v, mask: TreeMask, scale: float, block: int):
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dt = acc_dtype(q.dtype)
    qh, kh, vh = _cpu_layout(q, k, v, dt, scale)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(hkv, g, n, dtype=dt, device=q.device)
    for s, e, chunks in _query_blocks(mask, block, hq, q.device):
        bq = e - s
        qq = qh[:, :, s:e].reshape(hkv, g * bq, d)
        m = torch.full((hkv, g * bq), float("-inf"), dtype=dt, device=q.device)
        l = torch.zeros(hkv, g * bq, dtype=dt, device=q.device)
        acc = torch.zeros(hkv, g * bq, d, dtype=dt, device=q.device)
        for take, hidden in chunks:
            sc = torch.bmm(qq, _take(kh, take).transpose(1, 2))  # [Hkv, G*Bq, C], scaled through q
            if hidden is not None:
                sc.view(hkv, g, bq, -1).masked_fill_(hidden, float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            # a chunk can hide every key from a row (its keys lie on another branch): keep -inf - -inf out
            shift = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = sc.sub_(shift[..., None]).exp_()
            alpha = torch.exp(m - shift)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, _take(vh, take))
            m = m_new
        out[s:e] = (acc / l[..., None]).view(hkv, g, bq, d).permute(2, 0, 1, 3).reshape(bq, hq, d).to(q.dtype)
        lse[:, :, s:e] = (m + torch.log(l)).view(hkv, g, bq)
    return out, lse


def _backward_torch(q, k, v, out, lse, dout, mask: TreeMask, scale: float, block: int):
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dt = lse.dtype
    qh, kh, vh = _cpu_layout(q, k, v, dt, scale)
    doh = dout.to(dt).permute(1, 0, 2).reshape(hkv, g, n, d)
    delta = (dout.to(dt) * out.to(dt)).sum(-1).t().reshape(hkv, g, n)  # rowsum(dO * O)
    dq = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(hkv, n, d, dtype=dt, device=q.device)
    dv = torch.zeros(hkv, n, d, dtype=dt, device=q.device)
    for s, e, chunks in _query_blocks(mask, block, hq, q.device):
        bq = e - s
        qq = qh[:, :, s:e].reshape(hkv, g * bq, d)
        do = doh[:, :, s:e].reshape(hkv, g * bq, d)
        neg_lse = lse[:, :, s:e].reshape(hkv, g * bq, 1).neg()
        neg_delta = delta[:, :, s:e].reshape(hkv, g * bq, 1).neg()
        dqq = torch.zeros(hkv, g * bq, d, dtype=dt, device=q.device)
        for take, hidden in chunks:
            kk, vv = _take(kh, take), _take(vh, take)
            # baddbmm adds the broadcast -lse (and -delta below) inside the matmul: no extra pass
            p = torch.baddbmm(neg_lse, qq, kk.transpose(1, 2)).exp_()
            if hidden is not None:
                p.view(hkv, g, bq, -1).masked_fill_(hidden, 0.0)
            dvv = torch.bmm(p.transpose(1, 2), do)  # [Hkv, C, D], summed over the group's heads
            ds = torch.baddbmm(neg_delta, do, vv.transpose(1, 2)).mul_(p)
            dqq.baddbmm_(ds, kk)
            dkk = torch.bmm(ds.transpose(1, 2), qq)  # q carries the scale: this is dK
            if isinstance(take, slice):
                dk[:, take] += dkk
                dv[:, take] += dvv
            else:
                dk.index_add_(1, take, dkk)
                dv.index_add_(1, take, dvv)
        dq[s:e] = (dqq * scale).view(hkv, g, bq, d).permute(2, 0, 1, 3).reshape(bq, hq, d).to(q.dtype)
    return dq, dk.permute(1, 0, 2).to(k.dtype), dv.permute(1, 0, 2).to(v.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # float32 inputs: no TF32 rounding, so fp32 results match the reference
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _load_rows(ptr, rows, row_ok, cols, col_ok, stride_n, UPCAST: tl.constexpr):
        """[len(rows), len(cols)] tile of a row-major view; UPCAST: bf16/fp16 read as float32 (the
        interpreter's half-precision tl.dot is unreliable; GPUs never take this)."""
        x = tl.load(ptr + rows.to(tl.int64)[:, None] * stride_n + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _store_rows(ptr, rows, row_ok, cols, col_ok, stride_n, x):
        tl.store(ptr + rows.to(tl.int64)[:, None] * stride_n + cols[None, :], x.to(ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _block(b, N, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows of block b and the head dimension's lanes, with their in-range masks."""
        rows = b * BLOCK + tl.arange(0, BLOCK)
        ds = tl.arange(0, BLOCK_D)
        return rows, rows < N, ds, ds < D

    @triton.jit
    def _key_block(k_ptr, v_ptr, kv_end_ptr, kb, hk, ds, d_ok, N, skn, skh, svn, svh,
                   BLOCK: tl.constexpr, UPCAST: tl.constexpr):
        """Key block kb of kv head hk: (cols, k, v, kv_end of the cols)."""
        cols = kb * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < N
        k = _load_rows(k_ptr + hk * skh, cols, col_ok, ds, d_ok, skn, UPCAST)
        v = _load_rows(v_ptr + hk * svh, cols, col_ok, ds, d_ok, svn, UPCAST)
        kve = tl.load(kv_end_ptr + cols, mask=col_ok, other=-1)  # padding keys are seen by no row
        return cols, k, v, kve

    @triton.jit
    def _visible(rows, cols, kve):
        return (cols[None, :] <= rows[:, None]) & (kve[None, :] >= rows[:, None])

    @triton.jit
    def _tree_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kv_end_ptr, kv_ptr_ptr, kv_idx_ptr,
                              N, D, G, scale_ptr, sqn, sqh, skn, skh, svn, svh, son, soh,
                              BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                              IEEE: tl.constexpr, UPCAST: tl.constexpr):
        qb = tl.program_id(0)
        h = tl.program_id(1)
        scale = tl.load(scale_ptr)
        rows, row_ok, ds, d_ok = _block(qb, N, D, BLOCK, BLOCK_D)
        q = _load_rows(q_ptr + h * sqh, rows, row_ok, ds, d_ok, sqn, UPCAST)
        m = tl.full([BLOCK], float("-inf"), dtype=ACC)
        l = tl.zeros([BLOCK], dtype=ACC)
        acc = tl.zeros([BLOCK, BLOCK_D], dtype=ACC)
        for t in range(tl.load(kv_ptr_ptr + qb), tl.load(kv_ptr_ptr + qb + 1)):
            cols, k, v, kve = _key_block(k_ptr, v_ptr, kv_end_ptr, tl.load(kv_idx_ptr + t), h // G, ds, d_ok, N,
                                         skn, skh, svn, svh, BLOCK, UPCAST)
            s = tl.where(_visible(rows, cols, kve), _dot(q, tl.trans(k), IEEE).to(ACC) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # a block can hide every key from a row (another branch): keep -inf - -inf out
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m - shift)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE).to(ACC)
            m = m_new
        l_safe = tl.where(l > 0, l, 1.0)  # padding rows only: every real row sees itself
        _store_rows(o_ptr + h * soh, rows, row_ok, ds, d_ok, son, acc / l_safe[:, None])
        tl.store(lse_ptr + h * N + rows, m + tl.log(l_safe), mask=row_ok)

    @triton.jit
    def _tree_attn_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, kv_end_ptr,
                             kv_ptr_ptr, kv_idx_ptr, N, D, G, scale_ptr, sqn, sqh, skn, skh, svn, svh,
                             sdon, sdoh, sdqn, sdqh, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                             ACC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        qb = tl.program_id(0)
        h = tl.program_id(1)
        scale = tl.load(scale_ptr)
        rows, row_ok, ds, d_ok = _block(qb, N, D, BLOCK, BLOCK_D)
        q = _load_rows(q_ptr + h * sqh, rows, row_ok, ds, d_ok, sqn, UPCAST)
        do = _load_rows(do_ptr + h * sdoh, rows, row_ok, ds, d_ok, sdon, UPCAST)
        lse = tl.load(lse_ptr + h * N + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + h * N + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK, BLOCK_D], dtype=ACC)
        for t in range(tl.load(kv_ptr_ptr + qb), tl.load(kv_ptr_ptr + qb + 1)):
            cols, k, v, kve = _key_block(k_ptr, v_ptr, kv_end_ptr, tl.load(kv_idx_ptr + t), h // G, ds, d_ok, N,
                                         skn, skh, svn, svh, BLOCK, UPCAST)
            p = tl.where(_visible(rows, cols, kve), tl.exp(_dot(q, tl.trans(k), IEEE).to(ACC) * scale - lse[:, None]), 0.0)
            dsc = p * (_dot(do, tl.trans(v), IEEE).to(ACC) - delta[:, None])
            dq += _dot(dsc.to(k.dtype), k, IEEE).to(ACC)
        _store_rows(dq_ptr + h * sdqh, rows, row_ok, ds, d_ok, sdqn, dq * scale)

    @triton.jit
    def _tree_attn_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr,
                               kv_end_ptr, q_hi_ptr, N, D, G, scale_ptr, sqn, sqh, skn, skh, svn, svh,
                               sdon, sdoh, sdkn, sdkh, sdvn, sdvh, BLOCK: tl.constexpr,
                               BLOCK_D: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr,
                               UPCAST: tl.constexpr):
        kb = tl.program_id(0)
        hk = tl.program_id(1)
        scale = tl.load(scale_ptr)
        cols, col_ok, ds, d_ok = _block(kb, N, D, BLOCK, BLOCK_D)
        _, k, v, kve = _key_block(k_ptr, v_ptr, kv_end_ptr, kb, hk, ds, d_ok, N, skn, skh, svn, svh, BLOCK, UPCAST)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=ACC)
        dv = tl.zeros([BLOCK, BLOCK_D], dtype=ACC)
        for gi in range(0, G):  # the group's query heads share this key head: sum them here
            h = hk * G + gi
            for qb in range(kb, tl.load(q_hi_ptr + kb) + 1):
                rows, row_ok, _, _ = _block(qb, N, D, BLOCK, BLOCK_D)
                q = _load_rows(q_ptr + h * sqh, rows, row_ok, ds, d_ok, sqn, UPCAST)
                do = _load_rows(do_ptr + h * sdoh, rows, row_ok, ds, d_ok, sdon, UPCAST)
                lse = tl.load(lse_ptr + h * N + rows, mask=row_ok, other=0.0)
                delta = tl.load(delta_ptr + h * N + rows, mask=row_ok, other=0.0)
                s = _dot(q, tl.trans(k), IEEE).to(ACC) * scale
                p = tl.where(_visible(rows, cols, kve), tl.exp(s - lse[:, None]), 0.0)
                dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE).to(ACC)
                dsc = p * (_dot(do, tl.trans(v), IEEE).to(ACC) - delta[:, None])
                dk += _dot(tl.trans(dsc.to(q.dtype)), q, IEEE).to(ACC)
        _store_rows(dk_ptr + hk * sdkh, cols, col_ok, ds, d_ok, sdkn, dk * scale)
        _store_rows(dv_ptr + hk * sdvh, cols, col_ok, ds, d_ok, sdvn, dv)


def _triton_flags(q: torch.Tensor) -> dict:
    upcast = triton_interpret() and q.dtype in (torch.float16, torch.bfloat16)
    return dict(BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])),
                ACC=tl.float64 if q.dtype == torch.float64 else tl.float32,
                IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast)


def _scale_arg(scale: float, like: torch.Tensor) -> torch.Tensor:
    # a one-element tensor, not a float argument: Triton passes Python floats as float32, which
    # would round the float64 path's scale
    return torch.full((1,), scale, dtype=like.dtype, device=like.device)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any row and head strides but need each head's vector contiguous."""
    return t if t.stride(2) == 1 else t.contiguous()


def _forward_triton(q, k, v, mask: TreeMask, scale: float, block: int):
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    n, hq, d = q.shape
    s = mask.schedule(block)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, n, dtype=acc_dtype(q.dtype), device=q.device)
    _tree_attn_fwd_kernel[(s.num_blocks, hq)](
        q, k, v, out, lse, mask.kv_end, s.kv_ptr, s.kv_idx, n, d, hq // k.shape[1], _scale_arg(scale, lse),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
        out.stride(1), BLOCK=block, **_triton_flags(q))
    return out, lse


def _backward_triton(q, k, v, out, lse, dout, mask: TreeMask, scale: float, block: int):
    n, hq, d = q.shape
    hkv = k.shape[1]
    s = mask.schedule(block)
    q, k, v, dout = (_unit_last_stride(t) for t in (q, k, v, dout))
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).t().contiguous()  # [Hq, N]
    dq = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(n, hkv, d, dtype=k.dtype, device=q.device)
    dv = torch.empty(n, hkv, d, dtype=v.dtype, device=q.device)
    flags = _triton_flags(q)
    common = (n, d, hq // hkv, _scale_arg(scale, lse), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
              v.stride(1), dout.stride(0), dout.stride(1))
    _tree_attn_dq_kernel[(s.num_blocks, hq)](
        q, k, v, dout, dq, lse, delta, mask.kv_end, s.kv_ptr, s.kv_idx, *common, dq.stride(0), dq.stride(1),
        BLOCK=block, **flags)
    _tree_attn_dkdv_kernel[(s.num_blocks, hkv)](
        q, k, v, dout, dk, dv, lse, delta, mask.kv_end, s.q_hi, *common, dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), BLOCK=block, **flags)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# FlexAttention
# ----------------------------------------------------------------------------------------------

_compiled_flex = None


def _forward_flex(q, k, v, mask: TreeMask, scale: float) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("FlexAttention has no backward on CPU (torch "
                                  f"{torch.__version__}): use backend='torch' to train on CPU")
    if _compiled_flex is None:
        # torch.compile's default: the second row count recompiles with a dynamic N, later ones reuse it
        _compiled_flex = torch.compile(flex_attention)
    # flex takes [B, H, N, D]; enable_gqa maps query head h to key head h // G as the other paths do
    out = _compiled_flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         block_mask=mask.flex_block_mask(), scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# Autograd and entry point
# ----------------------------------------------------------------------------------------------


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: TreeMask, scale: float, backend: str):
        if backend == "triton":
            block = _triton_block(q.shape[2])
            out, lse = _forward_triton(q, k, v, mask, scale, block)
        else:
            block = _CPU_BLOCK
            out, lse = _forward_torch(q, k, v, mask, scale, block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.backend, ctx.block = mask, scale, backend, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        run = _backward_triton if ctx.backend == "triton" else _backward_torch
        dq, dk, dv = run(q, k, v, out, lse, dout, ctx.mask, ctx.scale, ctx.block)
        return dq, dk, dv, None, None, None


def _pick(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if (q.is_cuda and HAS_TRITON) else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' requested but triton is not installed")
        if not q.is_cuda and not triton_interpret():
            raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return backend


def _check(q, k, v, mask: TreeMask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [N, heads, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    n, hq, d = q.shape
    if k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"k is {tuple(k.shape)}; with q {tuple(q.shape)} it must be [{n}, Hkv, {d}]")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if mask.num_rows != n:
        raise ValueError(f"kv_end has {mask.num_rows} rows, q has {n}")
    if not (q.device == k.device == v.device == mask.device):
        raise ValueError(f"q, k, v and kv_end must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}, {mask.device}")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_end: torch.Tensor | TreeMask, *,
                   scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention of the rows of a packed forest: query i attends to key j iff
    ``j <= i <= kv_end[j]`` (its ancestors and itself).

    q ``[N, Hq, D]``, k and v ``[N, Hkv, D]`` (Hq a multiple of Hkv), kv_end ``[N]`` integers or a
    `TreeMask` built from them (reuse one across layers); returns ``[N, Hq, D]`` in q's dtype,
    differentiable w.r.t. q, k and v. ``scale`` defaults to ``1 / sqrt(D)``. ``backend``: "auto"
    (Triton for CUDA tensors, the torch fast path otherwise), "torch", "triton" (CPU tensors need
    TRITON_INTERPRET=1) or "flex" (compiled FlexAttention; no gradients on CPU).
    """
    mask = kv_end if isinstance(kv_end, TreeMask) else TreeMask(kv_end)
    _check(q, k, v, mask)
    backend = _pick(backend, q)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if backend == "flex":
        return _forward_flex(q, k, v, mask, scale)
    return TreeAttentionFunction.apply(q, k, v, mask, scale, backend)

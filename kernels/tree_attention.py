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
per query block, and the same pairs listed by key block) is built in O(N / B + pairs) without any
[N, N] or [N/B, N/B] tensor (only FlexAttention's ``BlockMask`` is a dense [N/128, N/128] index
table, as flex requires). A pair is *full* when every row of the query block sees every key of the
key block; only the other, *partial* pairs need the exact predicate, entry by entry. The cost
follows the visible pairs (ancestor counts), not N^2.

Options of HF decoders, along each path (`Scores`): a sliding ``window`` over depths (block pairs
out of every row's window dropped from the schedule), ``softcap``, per-head ``sinks``, attention
dropout (its mask a hash of seed and entry, `_common.dropout_keep`, regenerated in the backward).

Layers (one op, one name):
- ``TreeMask`` / ``BlockSchedule``: kv_end, checked once, its depths and its schedules (one per
  block size and window, cached), shared by every layer of a model; ``flex_block_mask()`` is the same schedule as a
  FlexAttention ``BlockMask`` (partial and full blocks).
- ``_forward_torch`` / ``_backward_torch``: the CPU fast path, online softmax over chunks of the
  listed key blocks in plain torch (a chunk of scores ``[Hq, B, C]`` at a time; full blocks
  unmasked, runs of consecutive blocks as views); the backward recomputes the scores from the
  saved log-sum-exp, as flash-attention does.
- ``_tree_attn_fwd_kernel``, ``_tree_attn_dq_kernel``, ``_tree_attn_dkdv_kernel``: Triton, one
  program per (query block, head) walking its key-block list, resp. per (key block, kv head)
  walking its pairs by key block in query tiles of ``TritonTiles.dkdv_rows`` rows, computed
  transposed (no atomics: dK/dV sum the group's query heads in one program); dQ walks its key
  blocks in tiles of ``TritonTiles.dq_cols`` keys. Launch tiles per
  (dtype, head dim): ``_GPU_TILES``, checked by ``clawfast.kernels.aot``.
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a ``mask_mod`` reading kv_end and
  the block mask above: the portable GPU path and the baseline of the Triton kernel. FlexAttention
  has no backward and no log-sum-exp on CPU (torch 2.13): there it runs without gradients or sinks,
  and it has no dropout anywhere.
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

from ._common import (
    HAS_TRITON,
    acc_dtype,
    check_1d,
    check_int,
    dropout_keep,
    dropout_threshold,
    pick_backend,
    refuses_dtype,
    triton_interpret,
)

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


@dataclass(frozen=True)
class TritonTiles:
    """How the three Triton kernels are launched for one (dtype, head dim): the block size B of the
    schedule (query and key blocks alike), the head-dim tile, (num_warps, num_stages) per kernel, the
    keys the dQ kernel and the query rows the dK / dV kernel take at a time (divisors of B)."""

    block: int
    block_d: int
    fwd: tuple[int, int]
    dq: tuple[int, int]
    dkdv: tuple[int, int]
    dq_cols: int
    dkdv_rows: int


# GPU launches by (bytes per element, head-dim tile): the head dim rounded up to a power of two,
# at least 64 (a smaller head pads its lanes). Chosen so that no variant spills registers or
# exceeds sm_80's 163 KiB of shared memory per block, the smaller of the two targets, with the latest
# Triton and with the GPU image's (3.6): `clawfast.kernels.aot` compiles every variant (its tables:
# bench/results/kernel_compile*.md). Register allocation differs between Triton releases, so a
# config at the edge in one spills in the other. dQ keeps q, dO and its accumulator live across its
# walk and dK / dV two accumulators and k, v: both walk their partner blocks in half-block tiles.
# float32 operands run as three TF32 products, which hold twice the operand registers: smaller
# blocks, and at head dim 256 every tile spills (such inputs take the torch path, `_triton_refuses`).
_GPU_TILES = {
    (2, 64): TritonTiles(64, 64, (4, 3), (4, 3), (8, 3), 32, 32),
    (2, 128): TritonTiles(64, 128, (8, 3), (8, 3), (8, 3), 32, 32),
    (2, 256): TritonTiles(32, 256, (4, 3), (4, 4), (8, 2), 16, 16),
    (4, 64): TritonTiles(32, 64, (8, 2), (8, 2), (8, 2), 16, 16),
    (4, 128): TritonTiles(16, 128, (8, 2), (8, 1), (8, 2), 16, 16),
}


def _gpu_tiles_key(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """The `_GPU_TILES` key: bytes per element, and the head dim as a power of two of at least 64."""
    return dtype.itemsize, max(64, 1 << (head_dim - 1).bit_length())


def _triton_tiles(dtype: torch.dtype, head_dim: int) -> TritonTiles:
    if triton_interpret():
        # the interpreter runs every program in Python: small tiles keep its per-element cost low,
        # and dQ / dK / dV walk each block in two halves, as on a GPU
        return TritonTiles(16, max(16, triton.next_power_of_2(head_dim)), (1, 1), (1, 1), (1, 1), 8, 8)
    return _GPU_TILES[_gpu_tiles_key(dtype, head_dim)]


def _triton_refuses(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton kernels cannot take this dtype and head dim (None: they can)."""
    if (reason := refuses_dtype(dtype)) is not None:
        return reason
    if _gpu_tiles_key(dtype, head_dim) not in _GPU_TILES:
        return (f"the Triton tree attention has no {str(dtype).removeprefix('torch.')} kernel for head dim "
                f"{head_dim} (every tile spills registers)" if head_dim <= 256 else
                f"the Triton tree attention takes head dims up to 256, got {head_dim}")
    return None


# ----------------------------------------------------------------------------------------------
# The mask and its block schedules
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockSchedule:
    """The block pairs of a tree mask at one block size B and sliding window (tensors on kv_end's
    device; indices int32).

    kv_ptr[QB + 1], kv_idx[P], kv_full[P] (bool): for query block qb, the key blocks
    ``kv_idx[kv_ptr[qb]:kv_ptr[qb+1]]`` (ascending, the diagonal block last) that may hold a key
    visible to one of its rows, and whether the pair is *full* (every row sees every key: the CPU
    path and flex run it without a mask).
    q_ptr[KB + 1], q_idx[P]: the same pairs by key block (query blocks ascending), for dK / dV.
    Without a window the listed pairs are exactly those with a visible key. A window drops the
    pairs where the depth ranges (of the key block, and of the query rows that can see it) keep
    every key out of every row's window; a listed pair may then still hide all its keys (the
    kernels allow that), and `kv_full` stays exact.
    """

    block: int
    window: int | None
    num_blocks: int
    kv_ptr: torch.Tensor
    kv_idx: torch.Tensor
    kv_full: torch.Tensor
    q_ptr: torch.Tensor
    q_idx: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.kv_idx.shape[0])


def _ptr(owner: torch.Tensor, nb: int) -> torch.Tensor:
    """CSR row pointer of pairs sorted by ``owner`` (a block index per pair)."""
    ptr = torch.zeros(nb + 1, dtype=torch.int32, device=owner.device)
    ptr[1:] = torch.cumsum(torch.bincount(owner, minlength=nb), 0)
    return ptr


def _block_schedule(kv_end: torch.Tensor, depth: torch.Tensor | None, block: int, window: int | None) -> BlockSchedule:
    n = kv_end.shape[0]
    nb = (n + block - 1) // block
    dev = kv_end.device
    pad = nb * block - n

    def per_block(x, fill, reduce):
        return reduce(torch.nn.functional.pad(x, (0, pad), value=fill).view(nb, block), 1)

    ke = kv_end.long()
    blocks = torch.arange(nb, device=dev)
    kb_max = per_block(ke, -1, torch.amax)
    q_hi = kb_max // block
    # every row of query block qb sees every key of kb iff kb < qb <= full_hi[kb]: the smallest
    # kv_end of kb reaches the block's last row (the last block ends at row n - 1)
    last_row = torch.clamp((blocks + 1) * block, max=n) - 1
    full_hi = torch.minimum(torch.searchsorted(last_row, per_block(ke, n, torch.amin), right=True) - 1, q_hi)
    counts = q_hi - blocks + 1
    key_block = torch.repeat_interleave(blocks, counts)  # key-major, query blocks ascending
    first = torch.cumsum(counts, 0) - counts
    query_block = key_block + torch.arange(key_block.shape[0], device=dev) - first[key_block]
    full = (key_block < query_block) & (query_block <= full_hi[key_block])
    if window is not None:
        # a visible key j is in row i's window iff depth[i] - depth[j] < window (HF's
        # ``kv_idx > q_idx - sliding_window`` along the row's path). The rows of query block qb
        # that see any key of an earlier block kb are qb's first rows up to max(kv_end over kb):
        # their smallest depth is a prefix minimum within qb (tight where a block holds the end of
        # one path and the start of the next).
        d = depth.long()
        d_min, d_max = per_block(d, n, torch.amin), per_block(d, -1, torch.amax)
        prefix_min = torch.cummin(torch.nn.functional.pad(d, (0, pad), value=n).view(nb, block), 1).values.flatten()
        last_seeing = torch.minimum(kb_max[key_block], (query_block + 1) * block - 1)
        keep = prefix_min[last_seeing] - d_max[key_block] < window
        full &= d_max[query_block] - d_min[key_block] < window
        key_block, query_block, full = key_block[keep], query_block[keep], full[keep]
    order = torch.argsort(query_block, stable=True)  # key blocks stay ascending within a query block
    i32 = torch.int32
    return BlockSchedule(block, window, nb, _ptr(query_block, nb), key_block[order].to(i32), full[order],
                         _ptr(key_block, nb), query_block.to(i32))


class TreeMask:
    """The tree mask of one packed batch: ``kv_end`` (checked once) and its block schedules.

    Build it once per micro-batch and pass it to every layer's `tree_attention` call: the depths,
    the schedules and the FlexAttention block masks are computed on first use and cached (one per
    block size and window, so windowed and global layers of one model share a mask).
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
        self._depth: torch.Tensor | None = None
        self._max_depth: int | None = None
        self._schedules: dict[tuple[int, int | None], BlockSchedule] = {}
        self._host: dict[tuple[int, int | None], tuple[list[int], list[int], list[bool]]] = {}
        self._flex: dict[tuple[int | None, bool], object] = {}

    @property
    def device(self) -> torch.device:
        return self.kv_end.device

    def depth(self) -> torch.Tensor:
        """int32 [N]: each row's number of ancestors (its position in its path, from 0), cached."""
        if self._depth is None:
            n = self.num_rows
            # row j is an ancestor of rows j + 1 ..= kv_end[j]: +1 from j + 1, -1 after kv_end[j]
            diff = torch.zeros(n + 1, dtype=torch.long, device=self.device)
            ones = torch.ones(n, dtype=torch.long, device=self.device)
            diff.index_add_(0, torch.arange(1, n + 1, device=self.device), ones)
            diff.index_add_(0, self.kv_end.long() + 1, -ones)
            self._depth = torch.cumsum(diff, 0)[:n].to(torch.int32)
        return self._depth

    def max_depth(self) -> int:
        if self._max_depth is None:
            self._max_depth = int(self.depth().max())
        return self._max_depth

    def schedule(self, block: int, window: int | None = None) -> BlockSchedule:
        """The block pairs at block size ``block`` under a sliding ``window`` (None: none), cached."""
        key = (block, window)
        if key not in self._schedules:
            depth = None if window is None else self.depth()
            self._schedules[key] = _block_schedule(self.kv_end, depth, block, window)
        return self._schedules[key]

    def host_lists(self, block: int, window: int | None = None) -> tuple[list[int], list[int], list[bool]]:
        """(kv_ptr, kv_idx, kv_full) of ``schedule(block, window)`` as Python lists (the CPU path
        loops over them)."""
        key = (block, window)
        if key not in self._host:
            s = self.schedule(block, window)
            self._host[key] = (s.kv_ptr.tolist(), s.kv_idx.tolist(), s.kv_full.tolist())
        return self._host[key]

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the mask allows: the sum over rows of (ancestors + 1)."""
        # row j is seen by kv_end[j] - j + 1 queries
        rows = torch.arange(self.num_rows, device=self.device)
        return int((self.kv_end.long() - rows + 1).sum())

    def mask_mod(self, window: int | None = None, sink_key: bool = False):
        """The predicate in FlexAttention's ``mask_mod`` signature; with `sink_key`, key row N (the
        sinks' virtual key, one past the last row) is seen by every query."""
        kv_end, last = self.kv_end, self.num_rows - 1
        depth = None if window is None else self.depth()

        def tree_mask_mod(b, h, q_idx, kv_idx):
            # flex may evaluate padding positions of a partial last block: keep the indices in range
            return (kv_idx <= q_idx) & (kv_end[torch.clamp(kv_idx, max=last)] >= q_idx)

        def windowed_tree_mask_mod(b, h, q_idx, kv_idx):
            in_window = depth[torch.clamp(q_idx, max=last)] - depth[torch.clamp(kv_idx, max=last)] < window
            return tree_mask_mod(b, h, q_idx, kv_idx) & in_window

        visible = tree_mask_mod if depth is None else windowed_tree_mask_mod
        if not sink_key:
            return visible

        def sink_key_mask_mod(b, h, q_idx, kv_idx):
            return visible(b, h, q_idx, kv_idx) | (kv_idx == last + 1)

        return sink_key_mask_mod

    def flex_block_mask(self, window: int | None = None, sink_key: bool = False):
        """``schedule(128, window)`` as a FlexAttention ``BlockMask`` (partial and full blocks), cached.
        With `sink_key` the keys are N + 1 rows: the sinks' virtual key N joins every query block's
        list (as a partial block, unless the block holding it is listed already)."""
        if (window, sink_key) not in self._flex:
            from torch.nn.attention.flex_attention import BlockMask

            s = self.schedule(_FLEX_BLOCK, window)
            nb = s.num_blocks
            num_keys = self.num_rows + sink_key
            key_blocks = -(-num_keys // _FLEX_BLOCK)
            qb, kb = _pairs(s)
            full = s.kv_full
            if sink_key:
                sink_block = self.num_rows // _FLEX_BLOCK
                listed = torch.zeros(nb, key_blocks, dtype=torch.bool, device=self.device)
                listed[qb, kb] = True
                extra = torch.nonzero(~listed[:, sink_block])[:, 0]
                order = torch.argsort(torch.cat([qb, extra]), stable=True)
                qb = torch.cat([qb, extra])[order]
                kb = torch.cat([kb, torch.full_like(extra, sink_block)])[order]
                full = torch.cat([full, torch.zeros_like(extra, dtype=torch.bool)])[order]
            parts = []
            for sel in (~full, full):
                q_sel, k_sel = qb[sel], kb[sel]
                counts = torch.bincount(q_sel, minlength=nb)
                start = torch.cumsum(counts, 0) - counts
                rank = torch.arange(q_sel.shape[0], device=self.device) - start[q_sel]
                idx = torch.zeros(nb, key_blocks, dtype=torch.int32, device=self.device)
                idx[q_sel, rank] = k_sel.to(torch.int32)
                parts += [counts.to(torch.int32)[None, None], idx[None, None]]
            self._flex[(window, sink_key)] = BlockMask.from_kv_blocks(
                *parts, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=self.mask_mod(window, sink_key),
                seq_lengths=(self.num_rows, num_keys))
        return self._flex[(window, sink_key)]


def _pairs(s: BlockSchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """(query block, key block) of every listed pair, sorted by query block."""
    counts = (s.kv_ptr[1:] - s.kv_ptr[:-1]).long()
    qb = torch.repeat_interleave(torch.arange(s.num_blocks, device=counts.device), counts)
    return qb, s.kv_idx.long()


@dataclass(frozen=True)
class Scores:
    """How a layer turns q.k into attention weights: the ``scale``; an optional sliding ``window``
    (keys fewer than ``window`` rows up the query's path); an optional ``softcap`` (``softcap *
    tanh(score / softcap)``, Gemma 2); attention dropout with probability ``dropout_p``, its mask a
    function of ``seed`` and the entry (`dropout_keep`)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    dropout_p: float = 0.0
    seed: int = 0


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


def _query_blocks(mask: TreeMask, block: int, heads: int, window: int | None, device):
    """Per query block: (start, end, its rows, chunks), chunks yielding (rows, take, hidden) for each chunk
    of its listed key rows: ``rows`` are their indices, ``take`` selects them (`_take`), ``hidden``
    is bool [query rows, keys] where a key is not visible to a row, or None for a chunk of full
    blocks (every row sees every key: most ancestor blocks), which then needs no mask at all."""
    n = mask.num_rows
    kv_end = mask.kv_end.long()
    depth = None if window is None else mask.depth().long()
    ptr, idx, kv_full = mask.host_lists(block, window)
    per_chunk = max(1, _CPU_CHUNK_ELEMS // (heads * block * block))

    def chunks(qb: int, rows_i: torch.Tensor):
        pairs = range(ptr[qb], ptr[qb + 1])
        for rows_j, take in _key_chunks([idx[t] for t in pairs if kv_full[t]], block, n, per_chunk, device):
            yield rows_j, take, None
        partial = [idx[t] for t in pairs if not kv_full[t]]
        for rows_j, take in _key_chunks(partial, block, n, per_chunk, device):
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


def _forward_torch(q, k, v, sinks, mask: TreeMask, rule: Scores, block: int):
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


def _backward_torch(q, k, v, lse, delta, dout, mask: TreeMask, rule: Scores, block: int):
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


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _dot(a, b, TF32X3: tl.constexpr):
        if TF32X3:
            # float32 operands: three TF32 products on tensor cores keep float32 accuracy (one TF32
            # product would round the operands to 10 mantissa bits; "ieee" runs on the FMA units,
            # spills registers at these tiles and compiles ~10x slower)
            return tl.dot(a, b, input_precision="tf32x3")
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
    def _rows(b, N, BLOCK: tl.constexpr):
        """Rows of block b, with their in-range mask."""
        rows = b * BLOCK + tl.arange(0, BLOCK)
        return rows, rows < N

    @triton.jit
    def _block(b, N, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows of block b and the head dimension's lanes, with their in-range masks."""
        rows, row_ok = _rows(b, N, BLOCK)
        ds = tl.arange(0, BLOCK_D)
        return rows, row_ok, ds, ds < D

    @triton.jit
    def _key_block(k_ptr, v_ptr, kv_end_ptr, depth_ptr, kb, hk, ds, d_ok, N, skn, skh, svn, svh,
                   BLOCK: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr):
        """Key block kb (of BLOCK rows) of kv head hk: (cols, k, v, kv_end of the cols, depth of the cols)."""
        cols = kb * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < N
        k = _load_rows(k_ptr + hk * skh, cols, col_ok, ds, d_ok, skn, UPCAST)
        v = _load_rows(v_ptr + hk * svh, cols, col_ok, ds, d_ok, svn, UPCAST)
        kve = tl.load(kv_end_ptr + cols, mask=col_ok, other=-1)  # padding keys are seen by no row
        return cols, k, v, kve, _depths(depth_ptr, cols, col_ok, WINDOW)

    @triton.jit
    def _depths(depth_ptr, rows, row_ok, WINDOW: tl.constexpr):
        if WINDOW:
            return tl.load(depth_ptr + rows, mask=row_ok, other=0)
        return rows  # unused without a window

    @triton.jit
    def _visible(rows, cols, kve, drow, dcol, window, WINDOW: tl.constexpr):
        """[rows, cols]: query row i sees key j."""
        visible = (cols[None, :] <= rows[:, None]) & (kve[None, :] >= rows[:, None])
        if WINDOW:
            visible = visible & (drow[:, None] - dcol[None, :] < window)
        return visible

    @triton.jit
    def _visible_t(rows, cols, kve, drow, dcol, window, WINDOW: tl.constexpr):
        """`_visible` as [cols, rows]."""
        visible = (cols[:, None] <= rows[None, :]) & (kve[:, None] >= rows[None, :])
        if WINDOW:
            visible = visible & (drow[None, :] - dcol[:, None] < window)
        return visible

    @triton.jit
    def _logits(a, b, scale, cap, TF32X3: tl.constexpr, SOFTCAP: tl.constexpr):
        """(logits, tanh): a.b^T * scale (q.k^T, or k.q^T for the transposed tile), soft-capped to
        ``cap * tanh(x / cap)`` under SOFTCAP (the tanh is kept for the backward; without SOFTCAP
        the second value is unused)."""
        x = _dot(a, tl.trans(b), TF32X3).to(tl.float32) * scale
        if SOFTCAP:
            # tanh from exp, which saturates to +-1 instead of overflowing
            t = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)
            return cap * t, t
        return x, x

    @triton.jit
    def _mix32(x):
        """`clawfast.kernels._common.mix32` on uint32: products wrap modulo 2**32 and shifts are
        logical, which is the reference's int64 arithmetic masked to 32 bits, in half the registers."""
        x = (x ^ (x >> 16)) * 0x45D9F3B
        x = (x ^ (x >> 16)) * 0x45D9F3B
        return x ^ (x >> 16)

    @triton.jit
    def _row_hash(seed, h, rows):
        """The per-(head, query row) half of `_common.dropout_keep`'s hash."""
        return _mix32(_mix32((seed ^ h).to(tl.uint32)) ^ rows.to(tl.uint32))

    @triton.jit
    def _keep_scale(x, threshold, inv_keep):
        """1 / (1 - p) where the entry whose hash input is x survives dropout, else 0."""
        return tl.where((_mix32(x) >> 8) >= threshold, inv_keep, 0.0)

    @triton.jit
    def _tile_grads(q, k, v, do, lse, delta, visible, scale, cap, seed, h, rows, cols, threshold, inv_keep,
                    TF32X3: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr):
        """dS w.r.t. the scaled, uncapped scores of one [query rows, key cols] tile, recomputed from
        the saved log-sum-exp. With dropout O = (P * Z) V, so dP = (dO V^T) * Z and delta =
        rowsum(dO * O) stays the row term."""
        s, t = _logits(q, k, scale, cap, TF32X3, SOFTCAP)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), TF32X3).to(tl.float32)
        if DROPOUT:
            dp = dp * _keep_scale(_row_hash(seed, h, rows)[:, None] ^ cols.to(tl.uint32)[None, :], threshold,
                                     inv_keep)
        dsc = p * (dp - delta[:, None])
        if SOFTCAP:
            dsc = dsc * (1.0 - t * t)
        return dsc

    @triton.jit
    def _tile_grads_t(q, k, v, do, lse, delta, visible_t, scale, cap, seed, h, rows, cols, threshold, inv_keep,
                      TF32X3: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr):
        """`_tile_grads` as [key cols, query rows], with P after dropout: (P^T Z, dS^T). dV += (P Z)^T dO
        and dK += dS^T Q then multiply these tiles as they are, never a transposed register tile."""
        s, t = _logits(k, q, scale, cap, TF32X3, SOFTCAP)
        p = tl.where(visible_t, tl.exp(s - lse[None, :]), 0.0)
        dp = _dot(v, tl.trans(do), TF32X3).to(tl.float32)
        pz = p
        if DROPOUT:
            z = _keep_scale(_row_hash(seed, h, rows)[None, :] ^ cols.to(tl.uint32)[:, None], threshold, inv_keep)
            dp = dp * z
            pz = p * z
        dsc = p * (dp - delta[None, :])
        if SOFTCAP:
            dsc = dsc * (1.0 - t * t)
        return pz, dsc

    @triton.jit
    def _query_block(depth_ptr, q_ptr, qb, h, N, D, sqn, sqh, BLOCK: tl.constexpr,
                     BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr):
        """What a (query block, head) program starts from: the block's rows, lanes and depths, and its
        q tile."""
        rows, row_ok, ds, d_ok = _block(qb, N, D, BLOCK, BLOCK_D)
        q = _load_rows(q_ptr + h * sqh, rows, row_ok, ds, d_ok, sqn, UPCAST)
        return rows, row_ok, ds, d_ok, _depths(depth_ptr, rows, row_ok, WINDOW), q

    # Sizes and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would only
    # compile more variants for nothing: they bound masks and loops, they are never strides.
    @triton.jit(do_not_specialize=['N', 'G', 'window', 'seed', 'threshold'])
    def _tree_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kv_end_ptr, depth_ptr, sink_ptr, kv_ptr_ptr,
                              kv_idx_ptr, N, D, G, window, seed, threshold, scale, cap, inv_keep, sqn, sqh, skn, skh, svn, svh,
                              son, soh, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                              TF32X3: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                              SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, SINKS: tl.constexpr):
        qb = tl.program_id(0)
        h = tl.program_id(1)
        rows, row_ok, ds, d_ok, drow, q = _query_block(depth_ptr, q_ptr, qb, h, N, D, sqn, sqh, BLOCK, BLOCK_D,
                                                       UPCAST, WINDOW)
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        for t in range(tl.load(kv_ptr_ptr + qb), tl.load(kv_ptr_ptr + qb + 1)):
            cols, k, v, kve, dcol = _key_block(k_ptr, v_ptr, kv_end_ptr, depth_ptr, tl.load(kv_idx_ptr + t), h // G,
                                               ds, d_ok, N, skn, skh, svn, svh, BLOCK, UPCAST, WINDOW)
            s, _ = _logits(q, k, scale, cap, TF32X3, SOFTCAP)
            s = tl.where(_visible(rows, cols, kve, drow, dcol, window, WINDOW), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # a block can hide every key from a row (another branch): keep -inf - -inf out
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m - shift)
            l = l * alpha + tl.sum(p, 1)
            if DROPOUT:  # the normaliser counts every key; the weighted sum only the kept ones
                p = p * _keep_scale(_row_hash(seed, h, rows)[:, None] ^ cols.to(tl.uint32)[None, :], threshold,
                                       inv_keep)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, TF32X3).to(tl.float32)
            m = m_new
        l_safe = tl.where(l > 0, l, 1.0)  # padding rows only: every real row sees itself
        out = acc / l_safe[:, None]
        lse = m + tl.log(l_safe)
        if SINKS:  # the head's sink logit joins the denominator (see _with_sinks)
            sink = tl.load(sink_ptr + h).to(tl.float32)
            top = tl.maximum(lse, sink)
            total = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
            out = out * tl.exp(lse - total)[:, None]
            lse = total
        _store_rows(o_ptr + h * soh, rows, row_ok, ds, d_ok, son, out)
        tl.store(lse_ptr + h * N + rows, lse, mask=row_ok)

    @triton.jit(do_not_specialize=['N', 'G', 'window', 'seed', 'threshold'])
    def _tree_attn_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, kv_end_ptr, depth_ptr,
                             kv_ptr_ptr, kv_idx_ptr, N, D, G, window, seed, threshold, scale, cap, inv_keep, sqn, sqh,
                             skn, skh, svn, svh, sdon, sdoh, sdqn, sdqh, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_D: tl.constexpr, TF32X3: tl.constexpr, UPCAST: tl.constexpr,
                             WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr):
        """One query block, one head: its listed key blocks walked BLOCK_K keys at a time (the q, dO
        tiles and the dQ accumulator stay live across the walk; smaller key tiles keep the score-sized
        tiles of each step in registers)."""
        qb = tl.program_id(0)
        h = tl.program_id(1)
        rows, row_ok, ds, d_ok, drow, q = _query_block(depth_ptr, q_ptr, qb, h, N, D, sqn, sqh, BLOCK, BLOCK_D,
                                                       UPCAST, WINDOW)
        do = _load_rows(do_ptr + h * sdoh, rows, row_ok, ds, d_ok, sdon, UPCAST)
        lse = tl.load(lse_ptr + h * N + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + h * N + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        SUBS: tl.constexpr = BLOCK // BLOCK_K
        for u in range(tl.load(kv_ptr_ptr + qb) * SUBS, tl.load(kv_ptr_ptr + qb + 1) * SUBS):
            cols, k, v, kve, dcol = _key_block(k_ptr, v_ptr, kv_end_ptr, depth_ptr,
                                               tl.load(kv_idx_ptr + u // SUBS) * SUBS + u % SUBS, h // G, ds, d_ok, N,
                                               skn, skh, svn, svh, BLOCK_K, UPCAST, WINDOW)
            visible = _visible(rows, cols, kve, drow, dcol, window, WINDOW)
            dsc = _tile_grads(q, k, v, do, lse, delta, visible, scale, cap, seed, h, rows, cols, threshold, inv_keep,
                              TF32X3, SOFTCAP, DROPOUT)
            dq += _dot(dsc.to(k.dtype), k, TF32X3).to(tl.float32)
        _store_rows(dq_ptr + h * sdqh, rows, row_ok, ds, d_ok, sdqn, dq * scale)

    @triton.jit(do_not_specialize=['N', 'G', 'window', 'seed', 'threshold'])
    def _tree_attn_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, kv_end_ptr,
                               depth_ptr, q_ptr_ptr, q_idx_ptr, N, D, G, window, seed, threshold, scale, cap, inv_keep, sqn,
                               sqh, skn, skh, svn, svh, sdon, sdoh, sdkn, sdkh, sdvn, sdvh, BLOCK: tl.constexpr,
                               BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                               TF32X3: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                               SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr):
        """One key block, one kv head: its listed query blocks walked BLOCK_Q rows at a time (the dK / dV
        accumulators and the k, v tiles stay live across the walk; smaller query tiles keep the rest
        in registers), tiles computed transposed ([keys, queries])."""
        kb = tl.program_id(0)
        hk = tl.program_id(1)
        cols, col_ok, ds, d_ok = _block(kb, N, D, BLOCK, BLOCK_D)
        _, k, v, kve, dcol = _key_block(k_ptr, v_ptr, kv_end_ptr, depth_ptr, kb, hk, ds, d_ok, N, skn, skh, svn, svh,
                                        BLOCK, UPCAST, WINDOW)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        SUBS: tl.constexpr = BLOCK // BLOCK_Q
        for gi in range(0, G):  # the group's query heads share this key head: sum them here
            h = hk * G + gi
            for u in range(tl.load(q_ptr_ptr + kb) * SUBS, tl.load(q_ptr_ptr + kb + 1) * SUBS):
                # a name bound before the loop must keep its type in it (Triton's loop-carried values),
                # so the loop rebinds none of them (`_` above included)
                rows, row_ok = _rows(tl.load(q_idx_ptr + u // SUBS) * SUBS + u % SUBS, N, BLOCK_Q)
                q = _load_rows(q_ptr + h * sqh, rows, row_ok, ds, d_ok, sqn, UPCAST)
                do = _load_rows(do_ptr + h * sdoh, rows, row_ok, ds, d_ok, sdon, UPCAST)
                lse = tl.load(lse_ptr + h * N + rows, mask=row_ok, other=0.0)
                delta = tl.load(delta_ptr + h * N + rows, mask=row_ok, other=0.0)
                visible_t = _visible_t(rows, cols, kve, _depths(depth_ptr, rows, row_ok, WINDOW), dcol, window, WINDOW)
                pz_t, dsc_t = _tile_grads_t(q, k, v, do, lse, delta, visible_t, scale, cap, seed, h, rows, cols,
                                            threshold, inv_keep, TF32X3, SOFTCAP, DROPOUT)
                dv += _dot(pz_t.to(do.dtype), do, TF32X3).to(tl.float32)
                dk += _dot(dsc_t.to(q.dtype), q, TF32X3).to(tl.float32)
        _store_rows(dk_ptr + hk * sdkh, cols, col_ok, ds, d_ok, sdkn, dk * scale)
        _store_rows(dv_ptr + hk * sdvh, cols, col_ok, ds, d_ok, sdvn, dv)


def _triton_flags(q: torch.Tensor, rule: Scores, tiles: TritonTiles) -> dict:
    upcast = triton_interpret() and q.dtype in (torch.float16, torch.bfloat16)
    return dict(BLOCK=tiles.block, BLOCK_D=tiles.block_d, TF32X3=q.dtype == torch.float32, UPCAST=upcast,
                WINDOW=rule.window is not None, SOFTCAP=rule.softcap is not None, DROPOUT=rule.dropout_p > 0)


def _triton_scalars(mask: TreeMask, rule: Scores):
    """(depth, scalars): the depths (kv_end stands in, unread, without a window); the window, the
    dropout seed and threshold, the scale, the softcap and 1 / (1 - dropout)."""
    depth = mask.kv_end if rule.window is None else mask.depth()
    return depth, (rule.window or 0, rule.seed, dropout_threshold(rule.dropout_p), rule.scale, rule.softcap or 1.0,
                   1.0 / (1.0 - rule.dropout_p))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any row and head strides but need each head's vector contiguous."""
    return t if t.stride(2) == 1 else t.contiguous()


def _forward_triton(q, k, v, sinks, mask: TreeMask, rule: Scores, tiles: TritonTiles):
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    n, hq, d = q.shape
    s = mask.schedule(tiles.block, rule.window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, n, dtype=acc_dtype(q.dtype), device=q.device)
    depth, scalars = _triton_scalars(mask, rule)
    _tree_attn_fwd_kernel[(s.num_blocks, hq)](
        # the sinks in the accumulation dtype: one variant per kernel, whatever dtype the caller's are
        q, k, v, out, lse, mask.kv_end, depth, sinks.to(lse.dtype) if sinks is not None else lse, s.kv_ptr,
        s.kv_idx, n, d, hq // k.shape[1], *scalars, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), SINKS=sinks is not None, num_warps=tiles.fwd[0],
        num_stages=tiles.fwd[1], **_triton_flags(q, rule, tiles))
    return out, lse


def _backward_triton(q, k, v, lse, delta, dout, mask: TreeMask, rule: Scores, tiles: TritonTiles):
    n, hq, d = q.shape
    hkv = k.shape[1]
    s = mask.schedule(tiles.block, rule.window)
    q, k, v, dout = (_unit_last_stride(t) for t in (q, k, v, dout))
    dq = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(n, hkv, d, dtype=k.dtype, device=q.device)
    dv = torch.empty(n, hkv, d, dtype=v.dtype, device=q.device)
    flags = _triton_flags(q, rule, tiles)
    depth, scalars = _triton_scalars(mask, rule)
    common = (n, d, hq // hkv, *scalars, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
              v.stride(1), dout.stride(0), dout.stride(1))
    _tree_attn_dq_kernel[(s.num_blocks, hq)](
        q, k, v, dout, dq, lse, delta, mask.kv_end, depth, s.kv_ptr, s.kv_idx, *common, dq.stride(0), dq.stride(1),
        BLOCK_K=tiles.dq_cols, num_warps=tiles.dq[0], num_stages=tiles.dq[1], **flags)
    _tree_attn_dkdv_kernel[(s.num_blocks, hkv)](
        q, k, v, dout, dk, dv, lse, delta, mask.kv_end, depth, s.q_ptr, s.q_idx, *common, dk.stride(0),
        dk.stride(1), dv.stride(0), dv.stride(1), BLOCK_Q=tiles.dkdv_rows, num_warps=tiles.dkdv[0],
        num_stages=tiles.dkdv[1], **flags)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# FlexAttention
# ----------------------------------------------------------------------------------------------

_compiled_flex = None


def _forward_flex(q, k, v, sinks, mask: TreeMask, rule: Scores) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sinks)):
        raise NotImplementedError("FlexAttention has no backward on CPU (torch "
                                  f"{torch.__version__}): use backend='torch' to train on CPU")
    if _compiled_flex is None:
        # torch.compile's default: the second row count recompiles with a dynamic N, later ones reuse it
        _compiled_flex = torch.compile(flex_attention)
    n = q.shape[0]
    cap = rule.softcap
    if sinks is not None:
        # The sinks as one more key (row N, value 0, seen by every query) whose score is the head's
        # sink logit: the softmax over N + 1 keys is the sink-corrected one, with no log-sum-exp needed.
        zero = k.new_zeros(1, k.shape[1], k.shape[2])
        k, v = torch.cat([k, zero]), torch.cat([v, zero])
        sink_logits = sinks.float()

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if sinks is not None:
            score = torch.where(kv_idx == n, sink_logits[h].to(score.dtype), score)
        return score

    # flex takes [B, H, N, D]; enable_gqa maps query head h to key head h // G as the other paths do
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    out = _compiled_flex(*args, score_mod=score_mod if cap is not None or sinks is not None else None,
                         block_mask=mask.flex_block_mask(rule.window, sink_key=sinks is not None),
                         scale=rule.scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# Autograd and entry point
# ----------------------------------------------------------------------------------------------


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask: TreeMask, rule: Scores, backend: str):
        if backend == "triton":
            launch = _triton_tiles(q.dtype, q.shape[2])
            out, lse = _forward_triton(q, k, v, sinks, mask, rule, launch)
        else:
            launch = _CPU_BLOCK  # the torch path's query block
            out, lse = _forward_torch(q, k, v, sinks, mask, rule, launch)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.rule, ctx.backend, ctx.launch = mask, rule, backend, launch
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        hq, n = q.shape[1], q.shape[0]
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).t().contiguous()  # rowsum(dO * O), [Hq, N]
        run = _backward_triton if ctx.backend == "triton" else _backward_torch
        dq, dk, dv = run(q, k, v, lse, delta, dout, ctx.mask, ctx.rule, ctx.launch)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # the sink's probability exp(sink - lse) takes part in dS = P (dP - delta) with dP = 0
            p_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse.reshape(hq, n))
            dsinks = -(p_sink * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None


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


def _check_options(q, window, softcap, sinks, dropout_p, seed, backend) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys fewer than window rows up the path) or None, "
                         f"got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],) or not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be a floating-point tensor [Hq] = [{q.shape[1]}] (one logit per query "
                             f"head), got {tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31):
        raise ValueError(f"seed must be an int in [0, 2**31) or None, got {seed!r}")
    if dropout_p and backend == "flex":
        raise ValueError("FlexAttention has no attention dropout (a score_mod cannot drop normalised weights): "
                         "use backend 'torch', 'triton' or 'auto'")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_end: torch.Tensor | TreeMask, *,
                   scale: float | None = None, window: int | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """Softmax attention of the rows of a packed forest: query i attends to key j iff
    ``j <= i <= kv_end[j]`` (its ancestors and itself).

    q ``[N, Hq, D]``, k and v ``[N, Hkv, D]`` (Hq a multiple of Hkv), kv_end ``[N]`` integers or a
    `TreeMask` built from them (reuse one across layers); returns ``[N, Hq, D]`` in q's dtype,
    differentiable w.r.t. q, k, v and sinks. ``scale`` defaults to ``1 / sqrt(D)``.
    The options of HF decoders, with their semantics along each path:
    ``window``: sliding window, query i keeps key j only if ``depth[i] - depth[j] < window``
    (Mistral, Qwen2, Gemma 2/3 local layers); ``softcap``: logits ``softcap * tanh(x / softcap)``
    (Gemma 2); ``sinks`` ``[Hq]``: a per-head logit added to each softmax's denominator with no value
    (gpt-oss); ``dropout_p``: attention dropout (HF's ``attention_dropout`` while training), its mask
    a function of ``seed`` and of (head, query row, key row) (`_common.dropout_keep`), so forward,
    backward and a recomputation under gradient checkpointing agree without storing it; ``seed``
    None draws one from torch's default generator (checkpointing restores that generator, so the
    recomputation draws the same). ``backend``: "auto" (Triton for CUDA tensors, the torch fast path otherwise), "torch",
    "triton" (CPU tensors need TRITON_INTERPRET=1) or "flex" (compiled FlexAttention; no gradients
    on CPU).
    """
    mask = kv_end if isinstance(kv_end, TreeMask) else TreeMask(kv_end)
    _check(q, k, v, mask)
    _check_options(q, window, softcap, sinks, dropout_p, seed, backend)
    backend = pick_backend(backend, q, backends=BACKENDS, triton_refuses=_triton_refuses(q.dtype, q.shape[2]))
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if window is not None and window > mask.max_depth():
        window = None  # every path is shorter than the window: it hides nothing
    rule = Scores(scale, window, None if softcap is None else float(softcap), float(dropout_p), seed or 0)
    if backend == "flex":
        return _forward_flex(q, k, v, sinks, mask, rule)
    return TreeAttentionFunction.apply(q, k, v, sinks, mask, rule, backend)

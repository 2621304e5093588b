"""Tree attention's Triton kernels, their launchers, and the tables of their launch tiles.

``_tree_attn_fwd_kernel``: one program per (query block, head) walking its key-block list with an
online softmax, ``walk`` keys at a time. ``_tree_attn_dq_kernel``: the same walk.
``_tree_attn_dkdv_kernel``: one program per (key block, kv head) walking its pairs by key block
``walk`` query rows at a time, computed transposed (no atomics: dK / dV sum the group's query heads in
one program). Each kernel has its own `KernelTiles` and walks the schedule of its own block size,
its full pairs in one loop (no mask) and its partial pairs in a second. Scores run in base 2.
The backward recomputes the scores from the saved log-sum-exp.
Launch tiles per (target, dtype, head dim): ``_SM90_TILES`` and ``_SM80_TILES``, every variant
compiled for its target by ``clawfast.kernels.aot``; `triton_refuses` names the inputs no tile takes
(the torch path runs them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import HAS_TRITON, acc_dtype, dropout_threshold, refuses_dtype, triton_interpret
from .tree_attention_schedule import Scores, TreeMask

if HAS_TRITON:
    import triton
    import triton.language as tl

    LOG2E = tl.constexpr(1.4426950408889634)  # scores run in base 2: exp2 is one instruction


@dataclass(frozen=True)
class KernelTiles:
    """How one kernel is launched: each program owns a ``block`` of rows (query rows for the forward
    and dQ, key rows for dK / dV; the block size of the schedule it walks) and walks its listed partner
    blocks ``walk`` rows at a time (a divisor of ``block``), on ``warps`` warps with ``stages``
    software-pipeline stages."""

    block: int
    walk: int
    warps: int
    stages: int


@dataclass(frozen=True)
class TritonTiles:
    """How the three Triton kernels are launched for one (dtype, head dim): the head-dim tile and each
    kernel's `KernelTiles` (each kernel walks the schedule of its own block size)."""

    block_d: int
    fwd: KernelTiles
    dq: KernelTiles
    dkdv: KernelTiles


def _tiles(block_d: int, fwd: tuple, dq: tuple, dkdv: tuple) -> TritonTiles:
    return TritonTiles(block_d, KernelTiles(*fwd), KernelTiles(*dq), KernelTiles(*dkdv))


# GPU launches by (bytes per element, head-dim tile): the head dim rounded up to a power of two,
# at least 64 (a smaller head pads its lanes); per kernel (block, walk, warps, stages). Chosen so
# that, with the latest Triton and with the GPU image's (3.6), for each table's target
# (`clawfast.kernels.aot` compiles every variant; its tables: bench/results/kernel_compile*.md):
# - no variant spills registers or exceeds the target's shared memory per block;
# - in half precision up to head dim 128, no warp repeats another's tensor-core work: each kernel's
#   first product (q.k^T, or k.q^T for dK / dV) feeds a second, and Triton then stacks every warp
#   along the block's rows, 16 rows each, so a block of fewer than 16 x warps rows is computed
#   several times over (`aot.dot_replication`). float32 and head dim 256 are register-bound: there
#   every tile that repeats nothing spills, and these repeat their first product 2-4x.
# Register allocation differs between Triton releases, so a config at the edge in one spills in the
# other. dQ keeps q, dO and its accumulator live across its walk and dK / dV two accumulators and k,
# v: their walk tiles are small. float32 operands run as three TF32 products, which hold twice the
# operand registers: smaller blocks, and at head dim 256 every tile spills (such inputs take the
# torch path, `triton_refuses`).
_SM90_TILES = {  # Hopper (sm_90) and later: wgmma reads its operands from shared memory
    (2, 64): _tiles(64, (128, 64, 8, 3), (128, 32, 8, 3), (128, 16, 8, 3)),
    (2, 128): _tiles(128, (128, 64, 8, 3), (128, 32, 8, 3), (128, 16, 8, 3)),
    (2, 256): _tiles(256, (32, 32, 4, 3), (32, 16, 4, 4), (32, 16, 8, 2)),
    (4, 64): _tiles(64, (32, 32, 8, 2), (32, 16, 8, 2), (16, 16, 8, 2)),
    (4, 128): _tiles(128, (16, 16, 2, 2), (16, 16, 8, 1), (16, 16, 8, 2)),
}
# Ampere (sm_80) and earlier: mma.sync holds both operands and the accumulator in registers, so the
# sm_90 tiles at the register edge spill here (the forward at head dim 128 walks 32 keys at a time,
# dQ at head dim 256 takes 16-row blocks).
_SM80_TILES = {
    **_SM90_TILES,
    (2, 128): _tiles(128, (128, 32, 8, 3), (128, 32, 8, 3), (128, 16, 8, 3)),
    (2, 256): _tiles(256, (32, 32, 4, 3), (16, 16, 4, 4), (32, 16, 8, 2)),
}


def _gpu_tiles_key(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """The tile tables' key: bytes per element, and the head dim as a power of two of at least 64."""
    return dtype.itemsize, max(64, 1 << (head_dim - 1).bit_length())


def triton_tiles(dtype: torch.dtype, head_dim: int, arch: int) -> TritonTiles:
    """How the kernels are launched for this dtype and head dim on compute capability ``arch``
    (`_common.target_arch`: 0 where Triton interprets, whose tiles do not depend on it)."""
    if triton_interpret():
        # the interpreter runs every program in Python: small tiles keep its per-element cost low;
        # the kernels' blocks differ and each walks its partner blocks in parts, as on a GPU
        return _tiles(max(16, triton.next_power_of_2(head_dim)), (32, 16, 1, 1), (16, 8, 1, 1), (32, 8, 1, 1))
    return (_SM90_TILES if arch >= 90 else _SM80_TILES)[_gpu_tiles_key(dtype, head_dim)]


def triton_refuses(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton kernels cannot take this dtype and head dim (None: they can)."""
    if (reason := refuses_dtype(dtype)) is not None:
        return reason
    if _gpu_tiles_key(dtype, head_dim) not in _SM90_TILES:  # both tables hold the same keys
        return (f"the Triton tree attention has no {str(dtype).removeprefix('torch.')} kernel for head dim "
                f"{head_dim} (every tile spills registers)" if head_dim <= 256 else
                f"the Triton tree attention takes head dims up to 256, got {head_dim}")
    return None


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
    def _scores(a, b, scale, cap, TF32X3: tl.constexpr, SOFTCAP: tl.constexpr):
        """(x, t, unit): the scores of a.b^T (q.k^T, or k.q^T for the transposed tile) in base-2 units
        are ``x * unit``, so that a caller folds the multiply into its subtraction (one fused
        multiply-add before each exp2, which is one instruction where exp is five). Without SOFTCAP x
        is the raw product and unit is ``scale * log2(e)``; under SOFTCAP x is t = tanh(a.b^T * scale
        / cap) and unit is ``cap * log2(e)`` (the tanh is kept for the backward; without SOFTCAP the
        second value is unused)."""
        x = _dot(a, tl.trans(b), TF32X3).to(tl.float32)
        if SOFTCAP:
            # tanh from exp2, which saturates to +-1 instead of overflowing
            t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E * scale / cap)) + 1.0)
            return t, t, cap * LOG2E
        return x, x, scale * LOG2E

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
    def _tile_grads(q, k, v, do, lse2, delta, rows, cols, kve, drow, dcol, window, scale, cap, seed, h, threshold,
                    inv_keep, TF32X3: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
                    WINDOW: tl.constexpr, MASKED: tl.constexpr):
        """dS w.r.t. the scaled, uncapped scores of one [query rows, key cols] tile, recomputed from
        the saved log-sum-exp (``lse2``: in base-2 units). With dropout O = (P * Z) V, so dP =
        (dO V^T) * Z and delta = rowsum(dO * O) stays the row term. MASKED: the pair is partial,
        entries a row does not see are zeroed."""
        x, t, unit = _scores(q, k, scale, cap, TF32X3, SOFTCAP)
        p = tl.exp2(x * unit - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(rows, cols, kve, drow, dcol, window, WINDOW), p, 0.0)
        dp = _dot(do, tl.trans(v), TF32X3).to(tl.float32)
        if DROPOUT:
            dp = dp * _keep_scale(_row_hash(seed, h, rows)[:, None] ^ cols.to(tl.uint32)[None, :], threshold,
                                     inv_keep)
        dsc = p * (dp - delta[:, None])
        if SOFTCAP:
            dsc = dsc * (1.0 - t * t)
        return dsc

    @triton.jit
    def _tile_grads_t(q, k, v, do, lse2, delta, rows, cols, kve, drow, dcol, window, scale, cap, seed, h, threshold,
                      inv_keep, TF32X3: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
                      WINDOW: tl.constexpr, MASKED: tl.constexpr):
        """`_tile_grads` as [key cols, query rows], with P after dropout: (P^T Z, dS^T). dV += (P Z)^T dO
        and dK += dS^T Q then multiply these tiles as they are, never a transposed register tile."""
        x, t, unit = _scores(k, q, scale, cap, TF32X3, SOFTCAP)
        p = tl.exp2(x * unit - lse2[None, :])
        if MASKED:
            p = tl.where(_visible_t(rows, cols, kve, drow, dcol, window, WINDOW), p, 0.0)
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

    @triton.jit
    def _fwd_step(q, m, l, acc, u, k_ptr, v_ptr, kv_end_ptr, depth_ptr, kv_idx_ptr, h, hk, rows, drow, ds, d_ok, N,
                  window, seed, threshold, scale, cap, inv_keep, skn, skh, svn, svh, SUBS: tl.constexpr,
                  BLOCK_K: tl.constexpr, TF32X3: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr):
        """Step u of the forward's walk (part u % SUBS of listed pair u // SUBS): the online softmax's
        (m, l, acc) after its BLOCK_K keys, m in base-2 units."""
        cols, k, v, kve, dcol = _key_block(k_ptr, v_ptr, kv_end_ptr, depth_ptr,
                                           tl.load(kv_idx_ptr + u // SUBS) * SUBS + u % SUBS, hk, ds, d_ok, N,
                                           skn, skh, svn, svh, BLOCK_K, UPCAST, WINDOW)
        x, _, unit = _scores(q, k, scale, cap, TF32X3, SOFTCAP)
        if MASKED:
            x = tl.where(_visible(rows, cols, kve, drow, dcol, window, WINDOW), x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1) * unit)  # unit > 0
        shift = m_new
        if MASKED:  # a partial pair can hide every key from a row (another branch): keep -inf - -inf out
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(x * unit - shift[:, None])
        alpha = tl.exp2(m - shift)
        l = l * alpha + tl.sum(p, 1)
        if DROPOUT:  # the normaliser counts every key; the weighted sum only the kept ones
            p = p * _keep_scale(_row_hash(seed, h, rows)[:, None] ^ cols.to(tl.uint32)[None, :], threshold,
                                   inv_keep)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, TF32X3).to(tl.float32)
        return m_new, l, acc

    # Sizes and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would only
    # compile more variants for nothing: they bound masks and loops, they are never strides.
    # Each kernel walks its full pairs first, in a loop without the mask's per-entry arithmetic (most
    # pairs of a tree are full), then its partial pairs (`BlockSchedule`). A full pair of the last
    # block may hold padding rows (rows >= N): they load q = dO = 0 and lse = delta = 0, so they add
    # nothing to dK / dV, and nothing of theirs is stored.
    @triton.jit(do_not_specialize=['N', 'G', 'window', 'seed', 'threshold'])
    def _tree_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kv_end_ptr, depth_ptr, sink_ptr, kv_ptr_ptr,
                              kv_partial_ptr, kv_idx_ptr, N, D, G, window, seed, threshold, scale, cap, inv_keep, sqn,
                              sqh, skn, skh, svn, svh, son, soh, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_D: tl.constexpr, TF32X3: tl.constexpr, UPCAST: tl.constexpr,
                              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
                              SINKS: tl.constexpr):
        """One query block, one head: its listed key blocks walked BLOCK_K keys at a time with an online
        softmax."""
        qb = tl.program_id(0)
        h = tl.program_id(1)
        rows, row_ok, ds, d_ok, drow, q = _query_block(depth_ptr, q_ptr, qb, h, N, D, sqn, sqh, BLOCK, BLOCK_D,
                                                       UPCAST, WINDOW)
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        SUBS: tl.constexpr = BLOCK // BLOCK_K
        first, partial, stop = tl.load(kv_ptr_ptr + qb), tl.load(kv_partial_ptr + qb), tl.load(kv_ptr_ptr + qb + 1)
        for u in range(first * SUBS, partial * SUBS):
            m, l, acc = _fwd_step(q, m, l, acc, u, k_ptr, v_ptr, kv_end_ptr, depth_ptr, kv_idx_ptr, h, h // G, rows,
                                  drow, ds, d_ok, N, window, seed, threshold, scale, cap, inv_keep, skn, skh, svn,
                                  svh, SUBS, BLOCK_K, TF32X3, UPCAST, WINDOW, SOFTCAP, DROPOUT, MASKED=False)
        for u in range(partial * SUBS, stop * SUBS):
            m, l, acc = _fwd_step(q, m, l, acc, u, k_ptr, v_ptr, kv_end_ptr, depth_ptr, kv_idx_ptr, h, h // G, rows,
                                  drow, ds, d_ok, N, window, seed, threshold, scale, cap, inv_keep, skn, skh, svn,
                                  svh, SUBS, BLOCK_K, TF32X3, UPCAST, WINDOW, SOFTCAP, DROPOUT, MASKED=True)
        l_safe = tl.where(l > 0, l, 1.0)  # padding rows only: every real row sees itself
        out = acc / l_safe[:, None]
        lse = (m + tl.log2(l_safe)) / LOG2E
        if SINKS:  # the head's sink logit joins the denominator (see tree_attention_torch._with_sinks)
            sink = tl.load(sink_ptr + h).to(tl.float32)
            top = tl.maximum(lse, sink)
            total = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
            out = out * tl.exp(lse - total)[:, None]
            lse = total
        _store_rows(o_ptr + h * soh, rows, row_ok, ds, d_ok, son, out)
        tl.store(lse_ptr + h * N + rows, lse, mask=row_ok)

    @triton.jit
    def _dq_step(q, do, lse2, delta, dq, u, k_ptr, v_ptr, kv_end_ptr, depth_ptr, kv_idx_ptr, h, hk, rows, drow, ds,
                 d_ok, N, window, seed, threshold, scale, cap, inv_keep, skn, skh, svn, svh, SUBS: tl.constexpr,
                 BLOCK_K: tl.constexpr, TF32X3: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr):
        """Step u of dQ's walk: dq plus the contribution of its BLOCK_K keys (unscaled)."""
        cols, k, v, kve, dcol = _key_block(k_ptr, v_ptr, kv_end_ptr, depth_ptr,
                                           tl.load(kv_idx_ptr + u // SUBS) * SUBS + u % SUBS, hk, ds, d_ok, N,
                                           skn, skh, svn, svh, BLOCK_K, UPCAST, WINDOW)
        dsc = _tile_grads(q, k, v, do, lse2, delta, rows, cols, kve, drow, dcol, window, scale, cap, seed, h,
                          threshold, inv_keep, TF32X3, SOFTCAP, DROPOUT, WINDOW, MASKED)
        return dq + _dot(dsc.to(k.dtype), k, TF32X3).to(tl.float32)

    @triton.jit(do_not_specialize=['N', 'G', 'window', 'seed', 'threshold'])
    def _tree_attn_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, kv_end_ptr, depth_ptr,
                             kv_ptr_ptr, kv_partial_ptr, kv_idx_ptr, N, D, G, window, seed, threshold, scale, cap,
                             inv_keep, sqn, sqh, skn, skh, svn, svh, sdon, sdoh, sdqn, sdqh, BLOCK: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, TF32X3: tl.constexpr,
                             UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                             DROPOUT: tl.constexpr):
        """One query block, one head: its listed key blocks walked BLOCK_K keys at a time (the q, dO
        tiles and the dQ accumulator stay live across the walk; smaller key tiles keep the score-sized
        tiles of each step in registers)."""
        qb = tl.program_id(0)
        h = tl.program_id(1)
        rows, row_ok, ds, d_ok, drow, q = _query_block(depth_ptr, q_ptr, qb, h, N, D, sqn, sqh, BLOCK, BLOCK_D,
                                                       UPCAST, WINDOW)
        do = _load_rows(do_ptr + h * sdoh, rows, row_ok, ds, d_ok, sdon, UPCAST)
        lse2 = tl.load(lse_ptr + h * N + rows, mask=row_ok, other=0.0) * LOG2E
        delta = tl.load(delta_ptr + h * N + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        SUBS: tl.constexpr = BLOCK // BLOCK_K
        first, partial, stop = tl.load(kv_ptr_ptr + qb), tl.load(kv_partial_ptr + qb), tl.load(kv_ptr_ptr + qb + 1)
        for u in range(first * SUBS, partial * SUBS):
            dq = _dq_step(q, do, lse2, delta, dq, u, k_ptr, v_ptr, kv_end_ptr, depth_ptr, kv_idx_ptr, h, h // G,
                          rows, drow, ds, d_ok, N, window, seed, threshold, scale, cap, inv_keep, skn, skh, svn, svh,
                          SUBS, BLOCK_K, TF32X3, UPCAST, WINDOW, SOFTCAP, DROPOUT, MASKED=False)
        for u in range(partial * SUBS, stop * SUBS):
            dq = _dq_step(q, do, lse2, delta, dq, u, k_ptr, v_ptr, kv_end_ptr, depth_ptr, kv_idx_ptr, h, h // G,
                          rows, drow, ds, d_ok, N, window, seed, threshold, scale, cap, inv_keep, skn, skh, svn, svh,
                          SUBS, BLOCK_K, TF32X3, UPCAST, WINDOW, SOFTCAP, DROPOUT, MASKED=True)
        _store_rows(dq_ptr + h * sdqh, rows, row_ok, ds, d_ok, sdqn, dq * scale)

    @triton.jit
    def _dkdv_step(k, v, dk, dv, u, q_ptr, do_ptr, lse_ptr, delta_ptr, depth_ptr, q_idx_ptr, h, cols, kve, dcol, ds,
                   d_ok, N, window, seed, threshold, scale, cap, inv_keep, sqn, sqh, sdon, sdoh, SUBS: tl.constexpr,
                   BLOCK_Q: tl.constexpr, TF32X3: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, MASKED: tl.constexpr):
        """Step u of dK / dV's walk for query head h: (dk, dv) plus the contributions of its BLOCK_Q
        query rows (dk unscaled)."""
        rows, row_ok = _rows(tl.load(q_idx_ptr + u // SUBS) * SUBS + u % SUBS, N, BLOCK_Q)
        q = _load_rows(q_ptr + h * sqh, rows, row_ok, ds, d_ok, sqn, UPCAST)
        do = _load_rows(do_ptr + h * sdoh, rows, row_ok, ds, d_ok, sdon, UPCAST)
        lse2 = tl.load(lse_ptr + h * N + rows, mask=row_ok, other=0.0) * LOG2E
        delta = tl.load(delta_ptr + h * N + rows, mask=row_ok, other=0.0)
        pz_t, dsc_t = _tile_grads_t(q, k, v, do, lse2, delta, rows, cols, kve,
                                    _depths(depth_ptr, rows, row_ok, WINDOW), dcol, window, scale, cap,
                                    seed, h, threshold, inv_keep, TF32X3, SOFTCAP, DROPOUT, WINDOW, MASKED)
        dv += _dot(pz_t.to(do.dtype), do, TF32X3).to(tl.float32)
        dk += _dot(dsc_t.to(q.dtype), q, TF32X3).to(tl.float32)
        return dk, dv

    @triton.jit(do_not_specialize=['N', 'G', 'window', 'seed', 'threshold'])
    def _tree_attn_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, kv_end_ptr,
                               depth_ptr, q_ptr_ptr, q_partial_ptr, q_idx_ptr, N, D, G, window, seed, threshold, scale,
                               cap, inv_keep, sqn, sqh, skn, skh, svn, svh, sdon, sdoh, sdkn, sdkh, sdvn, sdvh,
                               BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
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
        first, partial, stop = tl.load(q_ptr_ptr + kb), tl.load(q_partial_ptr + kb), tl.load(q_ptr_ptr + kb + 1)
        for gi in range(0, G):  # the group's query heads share this key head: sum them here
            # a name bound before a loop must keep its type in it (Triton's loop-carried values), so
            # the loops rebind none of them but the accumulators (`_` above included)
            for u in range(first * SUBS, partial * SUBS):
                dk, dv = _dkdv_step(k, v, dk, dv, u, q_ptr, do_ptr, lse_ptr, delta_ptr, depth_ptr, q_idx_ptr,
                                    hk * G + gi, cols, kve, dcol, ds, d_ok, N, window, seed, threshold, scale, cap,
                                    inv_keep, sqn, sqh, sdon, sdoh, SUBS, BLOCK_Q, TF32X3, UPCAST, WINDOW, SOFTCAP,
                                    DROPOUT, MASKED=False)
            for u in range(partial * SUBS, stop * SUBS):
                dk, dv = _dkdv_step(k, v, dk, dv, u, q_ptr, do_ptr, lse_ptr, delta_ptr, depth_ptr, q_idx_ptr,
                                    hk * G + gi, cols, kve, dcol, ds, d_ok, N, window, seed, threshold, scale, cap,
                                    inv_keep, sqn, sqh, sdon, sdoh, SUBS, BLOCK_Q, TF32X3, UPCAST, WINDOW, SOFTCAP,
                                    DROPOUT, MASKED=True)
        _store_rows(dk_ptr + hk * sdkh, cols, col_ok, ds, d_ok, sdkn, dk * scale)
        _store_rows(dv_ptr + hk * sdvh, cols, col_ok, ds, d_ok, sdvn, dv)


def _triton_flags(q: torch.Tensor, rule: Scores, tiles: TritonTiles, kernel: KernelTiles) -> dict:
    """The constexprs and launch options of one kernel (its walk tile goes by the kernel's own name)."""
    upcast = triton_interpret() and q.dtype in (torch.float16, torch.bfloat16)
    return dict(BLOCK=kernel.block, BLOCK_D=tiles.block_d, TF32X3=q.dtype == torch.float32, UPCAST=upcast,
                WINDOW=rule.window is not None, SOFTCAP=rule.softcap is not None, DROPOUT=rule.dropout_p > 0,
                num_warps=kernel.warps, num_stages=kernel.stages)


def _triton_scalars(mask: TreeMask, rule: Scores):
    """(depth, scalars): the depths (kv_end stands in, unread, without a window); the window, the
    dropout seed and threshold, the scale, the softcap and 1 / (1 - dropout)."""
    depth = mask.kv_end if rule.window is None else mask.depth()
    return depth, (rule.window or 0, rule.seed, dropout_threshold(rule.dropout_p), rule.scale, rule.softcap or 1.0,
                   1.0 / (1.0 - rule.dropout_p))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any row and head strides but need each head's vector contiguous."""
    return t if t.stride(2) == 1 else t.contiguous()


def forward_triton(q, k, v, sinks, mask: TreeMask, rule: Scores, tiles: TritonTiles):
    """(out [N, Hq, D] in q's dtype, log-sum-exp [Hq, N] in the accumulation dtype)."""
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    n, hq, d = q.shape
    s = mask.schedule(tiles.fwd.block, rule.window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, n, dtype=acc_dtype(q.dtype), device=q.device)
    depth, scalars = _triton_scalars(mask, rule)
    _tree_attn_fwd_kernel[(s.num_blocks, hq)](
        # the sinks in the accumulation dtype: one variant per kernel, whatever dtype the caller's are
        q, k, v, out, lse, mask.kv_end, depth, sinks.to(lse.dtype) if sinks is not None else lse, s.kv_ptr,
        s.kv_partial_ptr, s.kv_idx, n, d, hq // k.shape[1], *scalars, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), SINKS=sinks is not None,
        BLOCK_K=tiles.fwd.walk,
        **_triton_flags(q, rule, tiles, tiles.fwd))
    return out, lse


def backward_triton(q, k, v, lse, delta, dout, mask: TreeMask, rule: Scores, tiles: TritonTiles):
    """(dq, dk, dv) from the saved log-sum-exp and ``delta`` = rowsum(dO * O) [Hq, N]."""
    q, k, v, dout = (_unit_last_stride(t) for t in (q, k, v, dout))
    dq = dq_triton(q, k, v, lse, delta, dout, mask, rule, tiles)
    dk, dv = dkdv_triton(q, k, v, lse, delta, dout, mask, rule, tiles)
    return dq, dk, dv


def _backward_scalars(q, k, v, dout, mask: TreeMask, rule: Scores) -> tuple:
    """(depth, the arguments both backward kernels take after their schedule)."""
    n, hq, d = q.shape
    depth, scalars = _triton_scalars(mask, rule)
    return depth, (n, d, hq // k.shape[1], *scalars, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                   v.stride(0), v.stride(1), dout.stride(0), dout.stride(1))


def dq_triton(q, k, v, lse, delta, dout, mask: TreeMask, rule: Scores, tiles: TritonTiles):
    """dq [N, Hq, D] (q, k, v and dout with unit last strides): the dQ kernel alone."""
    by_query = mask.schedule(tiles.dq.block, rule.window)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    depth, common = _backward_scalars(q, k, v, dout, mask, rule)
    _tree_attn_dq_kernel[(by_query.num_blocks, q.shape[1])](
        q, k, v, dout, dq, lse, delta, mask.kv_end, depth, by_query.kv_ptr, by_query.kv_partial_ptr,
        by_query.kv_idx, *common, dq.stride(0), dq.stride(1), BLOCK_K=tiles.dq.walk,
        **_triton_flags(q, rule, tiles, tiles.dq))
    return dq


def dkdv_triton(q, k, v, lse, delta, dout, mask: TreeMask, rule: Scores, tiles: TritonTiles):
    """(dk, dv) [N, Hkv, D] (inputs as `dq_triton`'s): the dK / dV kernel alone."""
    by_key = mask.schedule(tiles.dkdv.block, rule.window)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    depth, common = _backward_scalars(q, k, v, dout, mask, rule)
    _tree_attn_dkdv_kernel[(by_key.num_blocks, k.shape[1])](
        q, k, v, dout, dk, dv, lse, delta, mask.kv_end, depth, by_key.q_ptr, by_key.q_partial_ptr, by_key.q_idx,
        *common, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), BLOCK_Q=tiles.dkdv.walk,
        **_triton_flags(q, rule, tiles, tiles.dkdv))
    return dk, dv

"""Fused tree log-probs + entropy: ``log_softmax(hidden @ weight.T / T)`` at (row, token) pairs,
without ever materialising the [N, V] logits.

A packed tree has one row per unique token; a branch row predicts several next tokens, so the
targets are (target_rows[M], target_ids[M]) pairs and every row has ONE log-normaliser shared by all
of its targets. Returned: ``logprobs[M]`` (float32; float64 for float64 inputs) and the entropy of
every row's next-token distribution ``entropy[N]``.

Layers (one op, one name):
- The algorithm, on every path: the rows are taken a chunk at a time; a chunk's float32 logits
  [C, V] are one matmul, and a pass over them gives each row's log-normaliser ``lse[N]`` and entropy
  ``entropy[N]`` (online max, so logits of any finite size are safe); the backward recomputes a
  chunk's logits, turns them into their gradient and multiplies that by ``weight`` / ``hidden``.
- ``_logits``: the chunk matmul, torch's (cuBLAS on a GPU, writing float32 from half-precision
  operands). A fused Triton matmul ran this at 1.64x one bf16 matmul on an H200 (2026-12-04),
  cuBLAS's own speed being the point of the split.
- ``_tree_logprobs_fwd_kernel``: Triton, the pass over a forward chunk (lse, entropy).
- ``_tree_logprobs_target_kernel``: Triton, one dot product per target minus its row's ``lse``.
- ``_tree_logprobs_bwd_kernel``: Triton, the gradient of a chunk's logits (dense softmax part,
  entropy part, and each row's own targets), in the inputs' dtype for the two cuBLAS products.
- ``_forward_torch`` / ``_grad_chunk_torch``: the CPU fast path, the same algorithm in plain torch.
- ``TreeLogprobsFunction`` (autograd), ``tree_logprobs`` and ``linear_logprobs`` (entry points).

Guaranteed: accumulation in float32 (float64 for float64 inputs on the torch path) whatever the
input dtype and the caller's autocast (float32 inputs follow torch's float32 matmul precision,
``torch.backends.cuda.matmul``);
the forward does no gradient work (the backward recomputes the logits), so a no-grad pass costs one
matmul pass; NaN/inf in ``hidden`` or ``weight`` raises ValueError (detected through the N
log-normalisers, one host sync).
Not guaranteed: bitwise equality with the reference (summation order differs); determinism of the
weight gradient across chunk sizes (it is summed chunk by chunk in float32).

Memory, never [N, V]: the forward keeps one chunk of float32 logits (GPU: 2**26 = 256 MiB; CPU: two
[C, V] buffers of 2**24); the backward one float32 chunk (GPU: 2**28 = 1 GiB) and its gradient in
the inputs' dtype (written over the chunk for float32), plus a float32 [V, d] weight-gradient
accumulator when the weight is not float32 (and, on torch releases whose addmm refuses it, a float32
[V, d] temporary per chunk).
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON,
    acc_dtype,
    check_1d,
    check_int,
    check_range,
    first_derivative_only,
    pick_backend,
    refuses_dtype,
    triton_interpret,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

# CPU chunk: 2**24 logits (64 MiB in float32) per buffer. bench/bench_kernels.py at the bar shape
# (N=8192, d=512, V=32768, fp32, 2 shared cores) measured, as fused/naive ratios of time and of
# peak extra memory:   256 rows: fwd+bwd 0.99 / 0.052, no-grad 1.00 / 0.047
#                      512 rows: fwd+bwd 0.80 / 0.083, no-grad 0.40 / 0.094   <- this default
#                     1024 rows: fwd+bwd 0.78 / 0.147, no-grad 1.54 / 0.188   (misses the 1/8 bar)
# The memory ratios are deterministic; the time ratios carry the noise of a loaded machine.
_CPU_CHUNK_ELEMS = 1 << 24
# GPU chunks of float32 logits. The forward's 2**26 (256 MiB; 512 rows at V=128K) keep cuBLAS at full
# speed while a no-grad pass holds little memory. The backward's 2**28 (1 GiB, plus the gradient in
# the inputs' dtype; 2K rows at V=128K) are larger because its float32 weight-gradient accumulator
# ([V, d], 2 GiB at V=128K, d=4096) is read and written once per chunk.
_GPU_FWD_CHUNK_ELEMS = 1 << 26
_GPU_BWD_CHUNK_ELEMS = 1 << 28
# GPU chunks hold a multiple of 256 rows, a whole number of cuBLAS's row tiles (128 or 256 rows on
# large matrices): 523 rows would compute 640 or 768.
_GPU_ROW_ALIGN = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _chunk_rows(n: int, v: int, chunk_rows: int | None, elems: int, align: int = 1) -> int:
    """Rows per [rows, V] chunk: ``chunk_rows`` if given, else as many as ``elems`` logits hold,
    rounded down to a multiple of ``align`` where they hold at least that many."""
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    rows = elems // max(v, 1)
    if rows >= align:
        rows -= rows % align
    return max(1, min(max(n, 1), rows))


def _sort_targets(target_rows: torch.Tensor, n: int):
    """CSR view of the targets: (order, row_ptr[N+1], counts[N]) with targets sorted by row."""
    rows = target_rows.long()
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=n)
    row_ptr = torch.zeros(n + 1, dtype=torch.long, device=rows.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return order, row_ptr, counts


def _check_lse(lse: torch.Tensor) -> None:
    # NaN/inf in hidden or weight always reaches the row's log-normaliser, so N values suffice.
    if lse.numel() and not bool(torch.isfinite(lse).all()):
        bad = int((~torch.isfinite(lse)).sum())
        raise ValueError(
            f"hidden or weight holds non-finite values (NaN or inf): {bad} row(s) have a non-finite "
            "log-normaliser"
        )


# ----------------------------------------------------------------------------------------------
# CPU fast path (also the fallback on GPUs without Triton)
# ----------------------------------------------------------------------------------------------


def _forward_torch(hidden, weight, rows, ids, inv_temp, chunk):
    dt = acc_dtype(hidden.dtype)
    n, m = hidden.shape[0], rows.shape[0]
    w = weight.to(dt)
    lse = torch.empty(n, dtype=dt, device=hidden.device)
    ent = torch.empty(n, dtype=dt, device=hidden.device)
    order, row_ptr, _ = _sort_targets(rows, n)
    s_rows, s_ids = rows.long()[order], ids.long()[order]
    lp_sorted = torch.empty(m, dtype=dt, device=hidden.device)
    ptr = row_ptr.tolist()
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        z = torch.mm(hidden[s:e].to(dt), w.t())  # [C, V]: the only full-width buffers are z and p
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        mx = z.amax(dim=1, keepdim=True)
        z.sub_(mx)  # z - max
        p = torch.exp(z)
        tot = p.sum(dim=1)
        # sum_v p_v (z_v - max) as a batched dot: no third [C, V] temporary
        pz = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
        log_tot = torch.log(tot)
        lse[s:e] = mx.view(-1) + log_tot
        ent[s:e] = log_tot - pz / tot
        a, b = ptr[s], ptr[e]
        if b > a:
            lp_sorted[a:b] = z[s_rows[a:b] - s, s_ids[a:b]] - log_tot[s_rows[a:b] - s]
    lp = torch.empty_like(lp_sorted)
    lp[order] = lp_sorted
    return lp, ent, lse


def _grad_chunk_torch(h_chunk, w, s, lse, ent, gsum, gent, s_rows, s_ids, s_glp, inv_temp):
    """Gradient of the loss w.r.t. the logits of rows [s, s + C): a [C, V] tensor."""
    dt = w.dtype
    logp = torch.mm(h_chunk.to(dt), w.t())
    if inv_temp != 1.0:
        logp.mul_(inv_temp)
    logp.sub_(lse[s : s + h_chunk.shape[0], None])
    # dL/dz = -p * (G + gH * (log p + H)) + sum over the row's targets of g_lp * onehot(target)
    if gent is not None:
        g = torch.exp(logp)  # p
        coef = logp.add_(ent[s : s + h_chunk.shape[0], None]).mul_(gent[s : s + h_chunk.shape[0], None])
        coef.add_(gsum[s : s + h_chunk.shape[0], None])
        g.mul_(coef).neg_()
    else:  # log-probs only: one [C, V] buffer, turned into p in place
        g = logp.exp_().mul_(gsum[s : s + h_chunk.shape[0], None]).neg_()
    if s_rows.numel():
        g.index_put_((s_rows - s, s_ids), s_glp, accumulate=True)
    if inv_temp != 1.0:
        g.mul_(inv_temp)
    return g


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _lse_step(z_rows, cols, row_ok, V, scale, m, s, a, MASKED: tl.constexpr):
        """One vocabulary tile into the running (max m, sum s, sum a) of a row, all in base 2: with
        y = z * scale (scale = log2(e) / T), s = sum 2^(y - m) and a = sum 2^(y - m) (y - m).
        MASKED: the tile runs past V (the last one), its extra entries count for nothing."""
        if MASKED:
            col_ok = cols < V
            y = tl.load(z_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0) * scale
            y = tl.where(col_ok[None, :], y, float("-inf"))
        else:
            y = tl.load(z_rows + cols[None, :], mask=row_ok[:, None], other=0.0) * scale
        m_new = tl.maximum(m, tl.max(y, 1))
        # rescale to the new max: sum 2^{y-m}(y-m) -> 2^{m-m_new} (a + s (m - m_new)); the where()
        # keeps -inf * 0 out of the first tile
        alpha = tl.exp2(m - m_new)
        a = alpha * (a + s * tl.where(s > 0, m - m_new, 0.0))
        s = alpha * s
        yc = y - m_new[:, None]
        e = tl.exp2(yc)
        s += tl.sum(e, 1)
        if MASKED:
            yc = tl.where(col_ok[None, :], yc, 0.0)
        a += tl.sum(e * yc, 1)
        return m_new, s, a

    # Row counts and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would
    # only compile more variants. The vocabulary V is specialised: it is fixed for a model, and V
    # divisible by 16 (128,256; 151,936) makes the last tile's column mask constant over 16 entries,
    # so the chunk is read (and the gradient written) in 16-byte vectors, not 4-byte words.
    @triton.jit(do_not_specialize=['n_rows'])
    def _tree_logprobs_fwd_kernel(z_ptr, lse_ptr, ent_ptr, n_rows, V, stride_z, inv_temp,
                                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
        """Per row of a float32 logits chunk: the log-normaliser and the entropy of softmax(z / T),
        one pass over the vocabulary with an online max, in base 2 (one ``exp2`` instruction per
        logit), the whole tiles without a column mask and the last, partial one with it."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        z_rows = z_ptr + rows.to(tl.int64)[:, None] * stride_z
        scale = inv_temp * 1.4426950408889634  # log2(e) / T
        m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_N], dtype=tl.float32)
        a = tl.zeros([BLOCK_N], dtype=tl.float32)
        v_whole = V - V % BLOCK_V
        for v0 in range(0, v_whole, BLOCK_V):
            m, s, a = _lse_step(z_rows, v0 + tl.arange(0, BLOCK_V), row_ok, V, scale, m, s, a, MASKED=False)
        if v_whole < V:
            m, s, a = _lse_step(z_rows, v_whole + tl.arange(0, BLOCK_V), row_ok, V, scale, m, s, a, MASKED=True)
        # back to base e: lse = ln 2 (m + log2 s), entropy = ln s - sum p (z/T - lse) = ln 2 (log2 s - a / s)
        log2_s = tl.log2(s)
        tl.store(lse_ptr + rows, (m + log2_s) * 0.6931471805599453, mask=row_ok)
        tl.store(ent_ptr + rows, (log2_s - a / s) * 0.6931471805599453, mask=row_ok)

    @triton.jit(do_not_specialize=['M'])
    def _tree_logprobs_target_kernel(h_ptr, w_ptr, rows_ptr, ids_ptr, lse_ptr, out_ptr, M, D,
                                     stride_h, stride_w, inv_temp, BLOCK_M: tl.constexpr,
                                     BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = offs < M
        r = tl.load(rows_ptr + offs, mask=ok, other=0).to(tl.int64)
        t = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            msk = ok[:, None] & (ks < D)[None, :]
            h = tl.load(h_ptr + r[:, None] * stride_h + ks[None, :], mask=msk, other=0.0)
            w = tl.load(w_ptr + t[:, None] * stride_w + ks[None, :], mask=msk, other=0.0)
            acc += tl.sum(h.to(tl.float32) * w.to(tl.float32), 1)
        lse = tl.load(lse_ptr + r, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc * inv_temp - lse, mask=ok)

    @triton.jit(do_not_specialize=['row0', 'n_rows', 'max_targets'])
    def _tree_logprobs_bwd_kernel(z_ptr, lse_ptr, ent_ptr, gsum_ptr, gent_ptr, ptr_ptr, tid_ptr, tg_ptr,
                                  gz_ptr, row0, n_rows, V, stride_z, stride_gz, inv_temp, max_targets,
                                  HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
        """The gradient of the loss w.r.t. one tile of a logits chunk (rows row0 + local), written in the
        inputs' dtype; ``gz`` may be ``z`` itself (each program reads its tile before writing it)."""
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = local < n_rows
        rows = row0 + local
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        tile_ok = row_ok[:, None] & col_ok[None, :]
        z = tl.load(z_ptr + local.to(tl.int64)[:, None] * stride_z + cols[None, :], mask=tile_ok,
                    other=0.0) * inv_temp
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        logp = z - lse[:, None]
        p = tl.exp(logp)
        coef = tl.load(gsum_ptr + rows, mask=row_ok, other=0.0)[:, None] + tl.zeros_like(logp)
        if HAS_GENT:
            g_h = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
            ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
            coef += g_h[:, None] * (logp + ent[:, None])
        g = -p * coef
        # each row's own targets (CSR by row): + g_lp at its target column, in float32
        start = tl.load(ptr_ptr + rows, mask=row_ok, other=0)
        end = tl.load(ptr_ptr + rows + 1, mask=row_ok, other=0)
        for j in range(max_targets):
            has = (start + j) < end
            tid = tl.load(tid_ptr + start + j, mask=has, other=-1)
            tg = tl.load(tg_ptr + start + j, mask=has, other=0.0)
            g += tl.where(cols[None, :] == tid[:, None], tg[:, None], 0.0)
        g = g * inv_temp
        out = gz_ptr + local.to(tl.int64)[:, None] * stride_gz + cols[None, :]
        tl.store(out, g.to(gz_ptr.dtype.element_ty), mask=tile_ok)


# Tiles of the two chunk kernels (BLOCK_N rows x BLOCK_V vocabulary entries, warps). Both stream a
# float32 chunk from memory once (no tensor-core work), so they are memory-bound: the tiles keep 16
# entries per thread in flight (4 vector loads) in few registers (sm_80 / sm_90: the forward at most 63,
# the backward 72, `python -m clawfast.kernels.aot --only logprobs`), and the forward's one row per
# program gives a 512-row chunk 512 programs, about 4 per SM. The interpreter runs every program in
# Python; its tiles are small so that the tests' vocabularies take several tiles (the online max's
# rescaling).
_FWD_TILES = dict(BLOCK_N=1, BLOCK_V=4096, num_warps=8)
_BWD_TILES = dict(BLOCK_N=4, BLOCK_V=512, num_warps=4)
_INTERPRETER_TILES = dict(BLOCK_N=16, BLOCK_V=16, num_warps=1)


def _matmul_weight(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight as the chunk matmuls (`_logits`) take it: as it is on CUDA, where cuBLAS writes
    float32 logits from half-precision operands; upcast once elsewhere (the interpreter's CPU
    tensors: torch has no such CPU matmul)."""
    return weight if hidden.is_cuda else weight.float()


def _logits(h_rows: torch.Tensor, w_mm: torch.Tensor) -> torch.Tensor:
    """``h_rows @ w_mm.T`` as float32 [C, V]: products of half-precision values are exact in float32
    and cuBLAS accumulates in float32, so these are the logits a fused kernel would compute, at
    cuBLAS's speed. float32 operands follow torch's float32 matmul precision."""
    if h_rows.dtype == w_mm.dtype != torch.float32:  # half precision on CUDA
        return torch.mm(h_rows, w_mm.t(), out_dtype=torch.float32)
    return torch.mm(h_rows.float(), w_mm.t())


def _forward_triton(hidden, weight, rows, ids, inv_temp, chunk):
    n, d = hidden.shape
    v, m = weight.shape[0], rows.shape[0]
    hidden, weight = hidden.contiguous(), weight.contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
    tiles = _INTERPRETER_TILES if triton_interpret() else _FWD_TILES
    w_mm = _matmul_weight(hidden, weight)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        z = _logits(hidden[s:e], w_mm)
        _tree_logprobs_fwd_kernel[(triton.cdiv(e - s, tiles["BLOCK_N"]),)](
            z, lse[s:e], ent[s:e], e - s, v, z.stride(0), inv_temp, **tiles)
    lp = torch.empty(m, dtype=torch.float32, device=hidden.device)
    if m:
        bm, bd = (16, 16) if triton_interpret() else (64, 64)
        _tree_logprobs_target_kernel[(triton.cdiv(m, bm),)](
            hidden, weight, rows.to(torch.int32).contiguous(), ids.to(torch.int32).contiguous(), lse, lp, m, d,
            hidden.stride(0), weight.stride(0), inv_temp, BLOCK_M=bm, BLOCK_D=bd)
    return lp, ent, lse


def _grad_chunk_triton(h_rows, w_mm, s, lse, ent, gsum, gent, row_ptr, s_ids, s_glp, max_targets, inv_temp):
    """Gradient of the loss w.r.t. the logits of rows [s, s + C), in ``h_rows``' dtype: written over
    the float32 logits chunk itself for float32 inputs."""
    z = _logits(h_rows, w_mm)
    c, v = z.shape
    gz = z if h_rows.dtype == torch.float32 else torch.empty(c, v, dtype=h_rows.dtype, device=z.device)
    tiles = _INTERPRETER_TILES if triton_interpret() else _BWD_TILES
    _tree_logprobs_bwd_kernel[(triton.cdiv(c, tiles["BLOCK_N"]), triton.cdiv(v, tiles["BLOCK_V"]))](
        z, lse, ent, gsum, gent if gent is not None else gsum, row_ptr, s_ids, s_glp, gz, s, c, v,
        z.stride(0), gz.stride(0), inv_temp, max_targets, HAS_GENT=gent is not None, **tiles)
    return gz


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc float32 and a, b possibly half precision: their products are summed in
    float32, never rounded to the operands' dtype first."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif not acc.is_cuda:  # torch has no half x half -> float32 matmul on a CPU (the interpreter's tensors)
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    else:
        try:  # one cuBLAS pass that reads and writes the float32 sum
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            # releases whose addmm takes its float32 ``self`` only in the operands' dtype (2.8: "self
            # and mat2 must have the same dtype"): the same sum through a float32 temporary
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))


# ----------------------------------------------------------------------------------------------
# host launcher and autograd
# ----------------------------------------------------------------------------------------------


def _backward(hidden, weight, rows, ids, lse, ent, g_lp, g_ent, inv_temp, backend, chunk,
              need_h, need_w):
    n, m = hidden.shape[0], rows.shape[0]
    dt = lse.dtype
    rows_l = rows.long()
    g_lp = torch.zeros(m, dtype=dt, device=hidden.device) if g_lp is None else g_lp.to(dt)
    gent = None if g_ent is None else g_ent.to(dt).contiguous()
    gsum = torch.zeros(n, dtype=dt, device=hidden.device).index_add_(0, rows_l, g_lp)
    order, row_ptr, counts = _sort_targets(rows_l, n)
    s_rows, s_ids, s_glp = rows_l[order], ids.long()[order], g_lp[order].contiguous()
    g_h = torch.empty_like(hidden) if need_h else None
    # the weight gradient is a sum over chunks: accumulate it in float32 (float64 for float64)
    g_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
    if backend == "triton":
        hidden, weight = hidden.contiguous(), weight.contiguous()
        max_targets = int(counts.max()) if m else 0
        w_logits, w_mm = _matmul_weight(hidden, weight), weight
    else:
        ptr = row_ptr.tolist()
        w_mm = weight.to(dt)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        if backend == "triton":
            gz = _grad_chunk_triton(hidden[s:e], w_logits, s, lse, ent, gsum, gent, row_ptr, s_ids,
                                    s_glp, max_targets, inv_temp)
            h_mm = hidden[s:e]
        else:
            a, b = ptr[s], ptr[e]
            gz = _grad_chunk_torch(hidden[s:e], w_mm, s, lse, ent, gsum, gent, s_rows[a:b],
                                   s_ids[a:b], s_glp[a:b], inv_temp)
            h_mm = hidden[s:e].to(dt)
        if need_h:
            g_h[s:e] = torch.mm(gz, w_mm)
        if need_w:
            _accumulate_mm(g_w, gz.t(), h_mm)
    return g_h, (g_w.to(weight.dtype) if need_w else None)


class TreeLogprobsFunction(torch.autograd.Function):
    """autograd for tree_logprobs; saves only hidden, weight, the targets and two [N] vectors."""

    # Both passes run with autocast off: under it torch.mm would multiply float32 inputs in half
    # precision, and the logits must be float32 whatever the caller's autocast (the backward, usually
    # outside it, recomputes them and needs the forward's log-normalisers to match).
    @staticmethod
    def forward(ctx, hidden, weight, target_rows, target_ids, temperature, backend, chunk_rows):
        inv_temp = 1.0 / temperature
        with torch.autocast(hidden.device.type, enabled=False):
            if backend == "triton":
                chunk = _chunk_rows(hidden.shape[0], weight.shape[0], chunk_rows, _GPU_FWD_CHUNK_ELEMS, _GPU_ROW_ALIGN)
                lp, ent, lse = _forward_triton(hidden, weight, target_rows, target_ids, inv_temp, chunk)
            else:
                chunk = _chunk_rows(hidden.shape[0], weight.shape[0], chunk_rows, _CPU_CHUNK_ELEMS)
                lp, ent, lse = _forward_torch(hidden, weight, target_rows, target_ids, inv_temp, chunk)
        _check_lse(lse)
        ctx.save_for_backward(hidden, weight, target_rows, target_ids, lse, ent)
        ctx.inv_temp, ctx.backend, ctx.chunk_rows = inv_temp, backend, chunk_rows
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    @first_derivative_only("tree_logprobs")
    def backward(ctx, g_lp, g_ent):
        hidden, weight, rows, ids, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        elems, align = (_GPU_BWD_CHUNK_ELEMS, _GPU_ROW_ALIGN) if ctx.backend == "triton" else (_CPU_CHUNK_ELEMS, 1)
        chunk = _chunk_rows(hidden.shape[0], weight.shape[0], ctx.chunk_rows, elems, align)
        with torch.autocast(hidden.device.type, enabled=False):
            g_h, g_w = _backward(hidden, weight, rows, ids, lse, ent, g_lp, g_ent, ctx.inv_temp,
                                 ctx.backend, chunk, need_h, need_w)
        return g_h, g_w, None, None, None, None, None


def _check_inputs(hidden, weight, target_rows, target_ids, temperature):
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if hidden.device != weight.device:
        raise ValueError(f"hidden ({hidden.device}) and weight ({weight.device}) must share a device")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden is [N, {hidden.shape[1]}] but weight is [V, {weight.shape[1]}]")
    check_1d("target_rows", target_rows)
    check_1d("target_ids", target_ids, target_rows.shape[0])
    check_int("target_rows", target_rows)
    check_int("target_ids", target_ids)
    check_range("target_rows", target_rows, 0, hidden.shape[0])
    check_range("target_ids", target_ids, 0, weight.shape[0])
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def tree_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target_rows: torch.Tensor,
                  target_ids: torch.Tensor, *, temperature: float = 1.0, backend: str = "auto",
                  chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of (row, token) targets and per-row entropy under ``softmax(hidden @ weight.T / T)``.

    hidden [N, d] and weight [V, d] (float16/bfloat16/float32; float64 on the torch path);
    target_rows [M], target_ids [M] integers (a row may appear any number of times, or never).
    Returns ``(logprobs[M], entropy[N])`` in float32 (float64 for float64 inputs), differentiable
    w.r.t. ``hidden`` and ``weight``. ``backend``: "auto" (Triton on CUDA, torch otherwise),
    "torch" or "triton" (CPU tensors need TRITON_INTERPRET=1). ``chunk_rows`` overrides the number
    of rows per [rows, V] chunk of logits (every path).
    """
    _check_inputs(hidden, weight, target_rows, target_ids, temperature)
    backend = pick_backend(backend, hidden, weight, triton_refuses=refuses_dtype(hidden.dtype))
    return TreeLogprobsFunction.apply(hidden, weight, target_rows, target_ids, float(temperature),
                                      backend, chunk_rows)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    temperature: float = 1.0, ignore_index: int = -100, backend: str = "auto",
                    chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat-sequence form: ``hidden[..., d]`` predicts ``labels[...]`` position by position.

    Shift before calling (hidden of position t, label = token t+1), as with a fused linear
    cross-entropy. Returns ``(logprobs, entropy)`` shaped like ``labels``; logprobs are 0 where
    ``labels == ignore_index``.
    """
    if hidden.dim() < 1 or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} + [d]")
    check_int("labels", labels)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_l = labels.reshape(-1)
    rows = torch.nonzero(flat_l != ignore_index).view(-1)
    lp_t, ent = tree_logprobs(flat_h, weight, rows, flat_l[rows], temperature=temperature,
                              backend=backend, chunk_rows=chunk_rows)
    lp = lp_t.new_zeros(flat_l.shape[0]).index_put((rows,), lp_t)
    return lp.view(labels.shape), ent.view(labels.shape)

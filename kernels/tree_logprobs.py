"""Fused tree log-probs + entropy: ``log_softmax(hidden @ weight.T / T)`` at (row, token) pairs,
without ever materialising the [N, V] logits.

A packed tree has one row per unique token; a branch row predicts several next tokens, so the
targets are (target_rows[M], target_ids[M]) pairs and every row has ONE log-normaliser shared by all
of its targets. Returned: ``logprobs[M]`` (float32; float64 for float64 inputs) and the entropy of
every row's next-token distribution ``entropy[N]``.

Layers (one op, one name):
- ``_tree_logprobs_fwd_kernel``: Triton, one program per block of rows, tiles over the vocabulary
  with an online log-sum-exp; writes the log-normaliser ``lse[N]`` and ``entropy[N]``.
- ``_tree_logprobs_target_kernel``: Triton, one dot product per target minus its row's ``lse``.
- ``_tree_logprobs_bwd_kernel``: Triton, recomputes one [rows, vocab] logits tile and writes the
  gradient of the logits (dense softmax part, entropy part, and each row's own targets) for one
  chunk of rows; the host then multiplies that chunk by ``weight`` / ``hidden`` with cuBLAS.
  On a GPU the tile shapes of both tile kernels are picked by ``triton.autotune`` per (V, d,
  dtype); in the interpreter they are fixed 16 x 16 x 16.
- ``_forward_torch`` / ``_grad_chunk_torch``: the CPU fast path, the same algorithm chunked over rows
  in plain torch (a chunk of logits [C, V] lives at a time, never [N, V]).
- ``TreeLogprobsFunction`` (autograd), ``tree_logprobs`` and ``linear_logprobs`` (entry points).

Guaranteed: accumulation in float32 (float64 for float64 inputs on the torch path) whatever the
input dtype; the forward does no gradient work (the backward recomputes the logits), so a no-grad
pass costs one matmul pass; NaN/inf in ``hidden`` or ``weight`` raises ValueError (detected through
the N log-normalisers, one host sync). Logits of any finite size are safe (online max shift).
Not guaranteed: bitwise equality with the reference (summation order differs); determinism of the
weight gradient across chunk sizes (it is summed chunk by chunk in float32).

Memory: the forward keeps two [C, V] buffers (CPU) or none (Triton); the backward keeps one [C, V]
gradient chunk plus a float32 [V, d] weight-gradient accumulator when the weight is not float32.
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON,
    acc_dtype,
    check_1d,
    check_int,
    check_range,
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
# GPU backward chunk: 2**28 logits (512 MiB in bf16), i.e. ~1.7K rows at V=152K, big enough for
# cuBLAS to run at full speed on the two gradient matmuls of each chunk.
_GPU_CHUNK_ELEMS = 1 << 28
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _chunk_rows(n: int, v: int, chunk_rows: int | None, elems: int) -> int:
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    return max(1, min(max(n, 1), elems // max(v, 1)))


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
    def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                     TF32X3: tl.constexpr, UPCAST: tl.constexpr):
        """hidden[rows] @ weight[cols].T as a float32 [BLOCK_N, BLOCK_V] tile."""
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        h_base = h_ptr + rows.to(tl.int64)[:, None] * stride_h
        w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        for k0 in range(0, D, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            k_ok = ks < D
            h = tl.load(h_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # Triton 3.9's interpreter returns garbage for bf16 tl.dot; GPUs never take this
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            if TF32X3:  # float32 operands: three TF32 products keep float32 accuracy on tensor cores
                acc = tl.dot(h, tl.trans(w), acc, input_precision="tf32x3")
            else:
                acc = tl.dot(h, tl.trans(w), acc)
        return acc

    # Sizes and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would only
    # compile more variants for nothing: they bound masks and loops, they are never strides.
    @triton.jit(do_not_specialize=['N', 'V'])
    def _tree_logprobs_fwd_kernel(h_ptr, w_ptr, lse_ptr, ent_ptr, N, V, D, stride_h, stride_w,
                                  inv_temp, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                                  BLOCK_D: tl.constexpr, TF32X3: tl.constexpr,
                                  UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)  # running max
        s = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum exp(z - m)
        a = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum exp(z - m) * (z - m)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < V
            z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                             BLOCK_N, BLOCK_V, BLOCK_D, TF32X3, UPCAST) * inv_temp
            z = tl.where(col_ok[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 1))
            # rescale to the new max: sum e^{z-m}(z-m) -> e^{m-m_new} (a + s (m - m_new));
            # the where() keeps -inf * 0 out of the first tile
            alpha = tl.exp(m - m_new)
            shift = tl.where(s > 0, m - m_new, 0.0)
            a = alpha * (a + s * shift)
            s = alpha * s
            zc = z - m_new[:, None]
            e = tl.exp(zc)
            s += tl.sum(e, 1)
            a += tl.sum(e * tl.where(col_ok[None, :], zc, 0.0), 1)
            m = m_new
        log_s = tl.log(s)
        tl.store(lse_ptr + rows, m + log_s, mask=row_ok)
        tl.store(ent_ptr + rows, log_s - a / s, mask=row_ok)

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

    @triton.jit(do_not_specialize=['row0', 'n_rows', 'V', 'max_targets'])
    def _tree_logprobs_bwd_kernel(h_ptr, w_ptr, lse_ptr, ent_ptr, gsum_ptr, gent_ptr, ptr_ptr,
                                  tid_ptr, tg_ptr, gz_ptr, row0, n_rows, V, D, stride_h, stride_w,
                                  stride_gz, inv_temp, max_targets, HAS_GENT: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                                  BLOCK_D: tl.constexpr, TF32X3: tl.constexpr,
                                  UPCAST: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = local < n_rows
        rows = row0 + local
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, TF32X3, UPCAST) * inv_temp
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
        tl.store(out, g.to(gz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


    # GPU tile shapes (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages), picked per (V, D) by Triton's
    # autotuner at the first call (the benchmark's warm-up) from the list of the operands' precision;
    # every config computes the same values, only the speed differs. Each list holds only configs
    # that neither spill registers nor exceed sm_80's shared memory (`clawfast.kernels.aot` compiles
    # them all for sm_80 and sm_90): float32 operands take three TF32 products, twice the bytes. The
    # three products feed one another, so for sm_90 Triton stacks the warps along BLOCK_N, 16 rows
    # each: a float32 config has at least 16 x num_warps rows, or its warps repeat the products
    # (`aot.dot_replication`).
    _GPU_CONFIGS = {
        "half": ((64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 4)),
        "float32": ((64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (64, 128, 16, 4, 3)),
    }

    def _tuned(kernel, key, precision):
        configs = [triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_D": bd}, num_warps=w, num_stages=st)
                   for bn, bv, bd, w, st in _GPU_CONFIGS[precision]]
        return triton.autotune(configs, key=key)(kernel)

    _FWD_TUNED = {p: _tuned(_tree_logprobs_fwd_kernel, ["V", "D"], p) for p in _GPU_CONFIGS}
    _BWD_TUNED = {p: _tuned(_tree_logprobs_bwd_kernel, ["V", "D", "HAS_GENT"], p) for p in _GPU_CONFIGS}

# the interpreter runs every program in Python: smallest tiles tl.dot accepts
_INTERPRETER_TILES = dict(BLOCK_N=16, BLOCK_V=16, BLOCK_D=16, num_warps=1, num_stages=1)


def _precision(hidden: torch.Tensor) -> str:
    return "float32" if hidden.dtype == torch.float32 else "half"


def _upcast(hidden: torch.Tensor) -> bool:
    return hidden.dtype == torch.bfloat16 and triton_interpret()


def _forward_triton(hidden, weight, rows, ids, inv_temp):
    n, d = hidden.shape
    v, m = weight.shape[0], rows.shape[0]
    hidden, weight = hidden.contiguous(), weight.contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
    if n:
        kernel, tiles = ((_tree_logprobs_fwd_kernel, _INTERPRETER_TILES) if triton_interpret()
                         else (_FWD_TUNED[_precision(hidden)], {}))
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            hidden, weight, lse, ent, n, v, d, hidden.stride(0), weight.stride(0), inv_temp,
            TF32X3=hidden.dtype == torch.float32, UPCAST=_upcast(hidden), **tiles)
    lp = torch.empty(m, dtype=torch.float32, device=hidden.device)
    if m:
        bm, bd = (16, 16) if triton_interpret() else (64, 64)
        _tree_logprobs_target_kernel[(triton.cdiv(m, bm),)](
            hidden, weight, rows.to(torch.int32).contiguous(), ids.to(torch.int32).contiguous(), lse, lp, m, d,
            hidden.stride(0), weight.stride(0), inv_temp, BLOCK_M=bm, BLOCK_D=bd)
    return lp, ent, lse


def _grad_chunk_triton(hidden, weight, s, e, lse, ent, gsum, gent, row_ptr, s_ids, s_glp,
                       max_targets, inv_temp):
    v, d = weight.shape
    gz = torch.empty(e - s, v, dtype=hidden.dtype, device=hidden.device)
    kernel, tiles = ((_tree_logprobs_bwd_kernel, _INTERPRETER_TILES) if triton_interpret()
                     else (_BWD_TUNED[_precision(hidden)], {}))
    kernel[lambda meta: (triton.cdiv(e - s, meta["BLOCK_N"]), triton.cdiv(v, meta["BLOCK_V"]))](
        hidden, weight, lse, ent, gsum, gent if gent is not None else gsum, row_ptr, s_ids, s_glp,
        gz, s, e - s, v, d, hidden.stride(0), weight.stride(0), gz.stride(0), inv_temp,
        max_targets, HAS_GENT=gent is not None, TF32X3=hidden.dtype == torch.float32,
        UPCAST=_upcast(hidden), **tiles)
    return gz


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc float32 and a, b possibly half precision."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:
        # cuBLAS writes the float32 sum directly (no [V, d] half-precision temporary); older
        # torch builds lack the out_dtype overload and take the plain route below, same values
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):
            pass
    acc += torch.mm(a, b)


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
        w_mm = weight
    else:
        ptr = row_ptr.tolist()
        w_mm = weight.to(dt)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        if backend == "triton":
            gz = _grad_chunk_triton(hidden, weight, s, e, lse, ent, gsum, gent, row_ptr, s_ids,
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

    @staticmethod
    def forward(ctx, hidden, weight, target_rows, target_ids, temperature, backend, chunk_rows):
        inv_temp = 1.0 / temperature
        if backend == "triton":
            lp, ent, lse = _forward_triton(hidden, weight, target_rows, target_ids, inv_temp)
        else:
            chunk = _chunk_rows(hidden.shape[0], weight.shape[0], chunk_rows, _CPU_CHUNK_ELEMS)
            lp, ent, lse = _forward_torch(hidden, weight, target_rows, target_ids, inv_temp, chunk)
        _check_lse(lse)
        ctx.save_for_backward(hidden, weight, target_rows, target_ids, lse, ent)
        ctx.inv_temp, ctx.backend, ctx.chunk_rows = inv_temp, backend, chunk_rows
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, rows, ids, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        elems = _GPU_CHUNK_ELEMS if ctx.backend == "triton" else _CPU_CHUNK_ELEMS
        chunk = _chunk_rows(hidden.shape[0], weight.shape[0], ctx.chunk_rows, elems)
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
    of rows per [rows, V] chunk (torch forward and both backward paths).
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

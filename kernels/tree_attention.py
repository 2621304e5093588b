"""Tree attention: softmax attention over a packed prefix forest without an [N, N] tensor.

Rows are a forest in DFS order (docs/TREE.md); key j is visible to query i iff
``j <= i <= kv_end[j]``, so a query sees exactly its ancestors and itself. Inputs use the varlen
layout of flash-attention: q ``[N, Hq, D]``, k and v ``[N, Hkv, D]`` (GQA when Hq is a multiple of
Hkv, query head h reading key head ``h // (Hq // Hkv)``); the output is ``[N, Hq, D]``. A flat batch
of sequences is the special case of a forest of chains. The cost follows the visible pairs (ancestor
counts), not N^2: every backend walks the block schedule of the mask.

Options of HF decoders, along each path (`Scores`): a sliding ``window`` over depths, ``softcap``,
per-head ``sinks``, attention dropout (its mask a hash of seed and entry, `_common.dropout_keep`,
regenerated in the backward).

Layers (one op, one name, one file each):
- ``tree_attention_schedule``: ``TreeMask`` (kv_end, checked once, its depths and its block schedules,
  one per block size and window, cached, shared by every layer of a model; ``flex_block_mask()`` is
  the same schedule as a FlexAttention ``BlockMask``), ``BlockSchedule`` and ``Scores``.
- ``tree_attention_torch``: the CPU fast path, online softmax over chunks of the listed key blocks in
  plain torch, and its backward.
- ``tree_attention_triton``: the Triton kernels (forward, dQ, dK / dV), their launchers and their
  launch tiles per (dtype, head dim).
- ``tree_attention_flex``: ``torch.nn.attention.flex_attention`` (compiled) on the block mask: the
  portable GPU path and the baseline of the Triton kernels; no gradients on CPU, no dropout.
- ``tree_attention_varlen``: flash-attention's variable-length kernel (CUDA, half precision) over the
  mask's path segments (``TreeMask.path_segments``), each segment's ancestors' keys gathered; no
  softcap, sinks or dropout.
- here: the checks, ``TreeAttentionFunction`` (autograd) and ``tree_attention`` (entry point).

Guaranteed: the result of ``tree_attention_ref`` (dense softmax under the mask) up to summation
order; softmax statistics in float32 (float64 for float64 inputs); memory O(N) besides one scores
chunk; every row sees at least itself, so no row is empty.
Not guaranteed: bitwise determinism across block sizes (summation order).
"""

from __future__ import annotations

import math
import numbers

import torch

from ._common import first_derivative_only, pick_backend, target_arch
from .tree_attention_flex import forward_flex
from .tree_attention_schedule import Scores, TreeMask
from .tree_attention_torch import CPU_BLOCK, backward_torch, forward_torch
from .tree_attention_triton import backward_triton, forward_triton, triton_refuses, triton_tiles
from .tree_attention_varlen import forward_varlen, varlen_refuses

BACKENDS = ("auto", "torch", "triton", "flex", "varlen")


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask: TreeMask, rule: Scores, backend: str):
        if backend == "triton":
            launch = triton_tiles(q.dtype, q.shape[2], target_arch(q.device))
            out, lse = forward_triton(q, k, v, sinks, mask, rule, launch)
        else:
            launch = CPU_BLOCK  # the torch path's query block
            out, lse = forward_torch(q, k, v, sinks, mask, rule, launch)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.rule, ctx.backend, ctx.launch = mask, rule, backend, launch
        return out

    @staticmethod
    @first_derivative_only("tree_attention")
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        hq, n = q.shape[1], q.shape[0]
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).t().contiguous()  # rowsum(dO * O), [Hq, N]
        run = backward_triton if ctx.backend == "triton" else backward_torch
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


def _check_options(q, scale, window, softcap, sinks, dropout_p, seed, backend) -> None:
    # positive: the Triton kernels take the row maximum of the raw products, then scale it
    if scale is not None and not (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None (1 / sqrt(D)), got {scale!r}")
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
    differentiable w.r.t. q, k, v and sinks. ``scale`` (positive) defaults to ``1 / sqrt(D)``.
    The options of HF decoders, with their semantics along each path:
    ``window``: sliding window, query i keeps key j only if ``depth[i] - depth[j] < window``
    (Mistral, Qwen2, Gemma 2/3 local layers); ``softcap``: logits ``softcap * tanh(x / softcap)``
    (Gemma 2); ``sinks`` ``[Hq]``: a per-head logit added to each softmax's denominator with no value
    (gpt-oss); ``dropout_p``: attention dropout (HF's ``attention_dropout`` while training), its mask
    a function of ``seed`` and of (head, query row, key row) (`_common.dropout_keep`), so forward,
    backward and a recomputation under gradient checkpointing agree without storing it; ``seed``
    None draws one from torch's default generator (checkpointing restores that generator, so the
    recomputation draws the same). ``backend``: "auto" (Triton for CUDA tensors, the torch fast path otherwise), "torch",
    "triton" (CPU tensors need TRITON_INTERPRET=1), "flex" (compiled FlexAttention; no gradients
    on CPU) or "varlen" (flash-attention's varlen kernel over the path segments: CUDA, float16 /
    bfloat16, no softcap, sinks or dropout).
    """
    mask = kv_end if isinstance(kv_end, TreeMask) else TreeMask(kv_end)
    _check(q, k, v, mask)
    _check_options(q, scale, window, softcap, sinks, dropout_p, seed, backend)
    backend = pick_backend(backend, q, backends=BACKENDS, triton_refuses=triton_refuses(q.dtype, q.shape[2]))
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if window is not None and window > mask.max_depth():
        window = None  # every path is shorter than the window: it hides nothing
    rule = Scores(scale, window, None if softcap is None else float(softcap), float(dropout_p), seed or 0)
    if backend == "flex":
        return forward_flex(q, k, v, sinks, mask, rule)
    if backend == "varlen":
        if (why := varlen_refuses(q, rule, sinks is not None)) is not None:
            raise ValueError(why)
        return forward_varlen(q, k, v, mask, rule)
    return TreeAttentionFunction.apply(q, k, v, sinks, mask, rule, backend)

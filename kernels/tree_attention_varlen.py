"""Tree attention on flash-attention's variable-length kernel (CUDA): each path segment of the tree
(`TreeMask.path_segments`) is one sequence, its rows the queries and the path from the root down to
its last row the keys, attended causally with the mask aligned to the bottom right, as flash-attention
2 aligns it when a sequence has more keys than queries. The kernel computes exactly the visible
pairs. The keys of a segment's ancestors are gathered for it (``PathSegments.gathered_rows`` rows in
all: N plus each segment's depth; on an agent forest, the rows one sample per leaf would hold), in
the forward and again in the backward, so only the layer's own k and v are kept between the two;
the gathered keys' gradients add up at their rows. Through PyTorch's flash-attention ops
(``aten._flash_attention_forward`` / ``_backward``, what ``torch.nn.attention.varlen`` calls),
which take fewer key than query heads as they are (GQA).

What it takes: CUDA tensors of float16 or bfloat16 (flash-attention's), a head dim that is a multiple
of 8 up to 256, a sliding window (``window_size_left = window - 1``: a key's position in its sequence
is its depth); no softcap, sinks or dropout (`varlen_refuses` says which).
"""

from __future__ import annotations

import torch

from ._common import first_derivative_only
from .tree_attention_schedule import PathSegments, Scores, TreeMask

# flash-attention's varlen kernels: half precision, head dims up to 256 in multiples of 8
_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def varlen_refuses(q: torch.Tensor, rule: Scores, has_sinks: bool) -> str | None:
    """Why backend "varlen" cannot run these inputs, or None."""
    if q.dtype not in _DTYPES:
        return f"backend 'varlen' takes float16 or bfloat16 (flash-attention's dtypes), not {q.dtype}"
    d = q.shape[2]
    if d % 8 or d > _MAX_HEAD_DIM:
        return f"backend 'varlen' takes head dims that are multiples of 8 up to {_MAX_HEAD_DIM}, not {d}"
    unsupported = [name for name, on in (("softcap", rule.softcap is not None), ("sinks", has_sinks),
                                         ("dropout", rule.dropout_p > 0)) if on]
    if unsupported:
        return f"backend 'varlen' has no {', '.join(unsupported)} (flash-attention's varlen kernel takes none here)"
    if not q.is_cuda:
        return f"backend 'varlen' runs flash-attention's CUDA kernel; q is on {q.device}"
    return None


class VarlenTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg: PathSegments, rule: Scores):
        keys, values = k.index_select(0, seg.key_rows), v.index_select(0, seg.key_rows)
        causal, left, right = _window(rule)
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, keys, values, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, causal, return_debug_mask=False,
            scale=rule.scale, window_size_left=left, window_size_right=right)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seg, ctx.rule = seg, rule
        return out

    @staticmethod
    @first_derivative_only("tree_attention (varlen)")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        seg, rule = ctx.seg, ctx.rule
        keys, values = k.index_select(0, seg.key_rows), v.index_select(0, seg.key_rows)
        causal, left, right = _window(rule)
        # no dropout: the generator state is unused, zeros as torch.nn.attention.varlen passes it
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        dq, dkeys, dvalues = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, keys, values, out, lse, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, causal,
            rng_state, torch.empty(0, device=q.device), scale=rule.scale, window_size_left=left,
            window_size_right=right)
        # a key row shared by many segments (a long common prefix) sums many gradients: in float32
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device).index_add_(0, seg.key_rows, dkeys.float())
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device).index_add_(0, seg.key_rows, dvalues.float())
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def _window(rule: Scores) -> tuple[bool, int, int]:
    """(is_causal, window_size_left, window_size_right) as ``torch.nn.attention.varlen`` passes them:
    causal, or a window of W keys ending at the query's own."""
    if rule.window is None:
        return True, -1, 0
    return False, rule.window - 1, 0


def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TreeMask, rule: Scores) -> torch.Tensor:
    """[N, Hq, D]: `tree_attention` of q, k, v on flash-attention's varlen kernel (differentiable)."""
    return VarlenTreeAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), mask.path_segments(), rule)

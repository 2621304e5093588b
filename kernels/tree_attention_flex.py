"""Tree attention by ``torch.nn.attention.flex_attention`` (compiled): the portable GPU path and the
baseline of the Triton kernels.

It reads the mask as `TreeMask.flex_block_mask` (the block schedule at flex's block size, partial and
full blocks, with `TreeMask.mask_mod` reading kv_end). FlexAttention has no backward and no log-sum-exp
on CPU (torch 2.13): there it runs without gradients, uncompiled (see `forward_flex`), and it has no
dropout anywhere.
"""

from __future__ import annotations

import torch

from .tree_attention_schedule import Scores, TreeMask

_compiled_flex = None


def forward_flex(q, k, v, sinks, mask: TreeMask, rule: Scores) -> torch.Tensor:
    """The output [N, Hq, D] (differentiable on CUDA only), by FlexAttention (compiled on GPUs)."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sinks)):
        raise NotImplementedError("FlexAttention has no backward on CPU (torch "
                                  f"{torch.__version__}): use backend='torch' to train on CPU")
    # On the CPU flex runs uncompiled (its reference implementation): there the compiled kernel's
    # first call returned NaN rows on a 24-row tree batch (torch 2.13, tests/test_keystone.py), and
    # the CPU path is for checking, not training (no backward). On GPUs torch.compile's default: the
    # second row count recompiles with a dynamic N, later ones reuse it.
    global _compiled_flex
    if q.device.type != "cpu" and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    attend = flex_attention if q.device.type == "cpu" else _compiled_flex
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
    out = attend(*args, score_mod=score_mod if cap is not None or sinks is not None else None,
                 block_mask=mask.flex_block_mask(rule.window, sink_key=sinks is not None),
                 scale=rule.scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)

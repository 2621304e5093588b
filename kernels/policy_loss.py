"""PPO / GRPO policy loss over packed targets, with the IS correction and its metrics.

Per target m (all inputs are [M]; ``a_m = mask_m * weight_m`` is its loss weight, 1 per unique
trainable token in a packed tree, so shared tokens count once):

    r      = exp(logprobs - old_logprobs)                      (log-ratio clamped to +-20)
    pg     = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    pg     = min(pg, -A dual_clip)  where A < 0                (dual-clip, optional, dual_clip > 1)
    l      = is_w pg + kl_coef k3(ref || pi) - entropy_coef entropy
    k3     = exp(ref - lp) - (ref - lp) - 1                    (log-ratio clamped to +-20)

``is_w`` is the (detached) importance weight of ``old_logprobs`` against ``infer_logprobs``
(``importance.py``), or the precomputed ``is_weights`` (e.g. sequence-level weights of paths that
span several micro-batches), or 1 when neither is given. This is the decoupled PPO loss of
asynchronous RL: ``old_logprobs`` is the *proximal* policy (the one the clip is measured against),
``infer_logprobs`` the *behaviour* policy that sampled the tokens, and the IS weight corrects from
behaviour to proximal. With ``old_logprobs`` = ``infer_logprobs`` it is plain PPO against the
sampler. Aggregation of ``l`` with weights ``a``:

- ``"token-mean"``: ``sum a l / sum a``.
- ``"seq-mean-token-mean"``: mean over sequences of each sequence's ``sum a l / sum a``.
- ``"seq-mean-token-sum"``: mean over sequences of each sequence's ``sum a l``.

A sequence is ``seq_ids[m]``: in a packed tree pass ``target_rollout``, so every rollout counts once
and its shared tokens once; sequences without a valid target are not counted. With no valid target
at all the loss is 0 (still attached to the graph, so backward gives zero gradients). mask and weight
must be >= 0 (weight finite where mask > 0): a negative or NaN weight is an error, not a dropped target.

Gradients reach ``logprobs`` and ``entropy`` only, on every backend: ``old_logprobs``, ``advantages``,
``ref_logprobs``, ``mask``, ``weight`` and the IS weights are constants of the loss even if they
require grad. On the
Triton path the loss is differentiable once (its backward is hand-written; a second derivative raises).

``grpo_advantages`` turns one reward per rollout into group-relative advantages (group key: task,
or task x harness as a [R, k] key tensor).

Layers: ``_policy_loss_fwd_kernel`` (Triton: ratio, clipping, dual clip, k3 and their
derivatives in one pass) under ``PolicyLossFunction`` (autograd); the torch path writes the same
formulas with torch ops. Aggregation is a coefficient per target (``_agg_coef``), so both paths
reduce with one weighted sum.

Returns ``(loss, metrics)``; metrics (floats, ONE host transfer) are the loss parts, the clip
fractions, the mean ratio and the approximate KL to the old policy, plus the IS metrics. Entries
with mask 0 may hold anything (their terms are selected away, never multiplied by 0).
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON, acc_dtype, check_1d, check_float, check_int, first_derivative_only, pick_backend, triton_interpret,
)
from .importance import METRIC_NAMES as IS_METRIC_NAMES
from .importance import ISConfig, importance_weights_device, metrics_to_host
from .tree_paths import TreePaths

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Sizes and offsets vary from launch to launch: specialising them (== 1, divisible by 16) would only
    # compile more variants for nothing: they bound masks and loops, they are never strides.
    @triton.jit(do_not_specialize=['n'])
    def _policy_loss_fwd_kernel(lp_ptr, old_ptr, adv_ptr, isw_ptr, c_ptr, ref_ptr, pg_ptr, kl_ptr,
                                gpg_ptr, gkl_ptr, flag_ptr, params_ptr, n, HAS_DUAL: tl.constexpr,
                                HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
        """Per target: c * is_w * pg and c * k3 with their derivatives w.r.t. the log-prob, and
        flags (1 clipped, 2 dual-clipped). c = aggregation coefficient (0 where masked). params:
        (1 - clip_low, 1 + clip_high, dual clip, log clamp) in the computation's dtype, read from
        memory: Triton passes a Python float as float32, which float64 inputs would compute with."""
        ratio_lo, ratio_hi = tl.load(params_ptr), tl.load(params_ptr + 1)
        dual_clip, log_clamp = tl.load(params_ptr + 2), tl.load(params_ptr + 3)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        c = tl.load(c_ptr + offs, mask=ok, other=0.0)
        live = ok & (c != 0)
        lp = tl.load(lp_ptr + offs, mask=live, other=0.0)
        old = tl.load(old_ptr + offs, mask=live, other=0.0)
        adv = tl.load(adv_ptr + offs, mask=live, other=0.0)
        isw = tl.load(isw_ptr + offs, mask=live, other=0.0)
        d = lp - old
        inside = (d >= -log_clamp) & (d <= log_clamp)
        ratio = tl.exp(tl.minimum(tl.maximum(d, -log_clamp), log_clamp))
        pg1 = -adv * ratio
        pg2 = -adv * tl.minimum(tl.maximum(ratio, ratio_lo), ratio_hi)
        clipped = pg2 > pg1
        pg = tl.where(clipped, pg2, pg1)
        # d pg / d lp: -A r on the unclipped branch, 0 on the clipped (constant) one
        g = tl.where(clipped | (~inside), 0.0, -adv * ratio)
        flag = clipped.to(tl.int32)
        if HAS_DUAL:
            pg3 = -adv * dual_clip
            dual = (adv < 0) & (pg3 < pg)
            pg = tl.where(dual, pg3, pg)
            g = tl.where(dual, 0.0, g)
            flag += 2 * dual.to(tl.int32)
        tl.store(pg_ptr + offs, tl.where(live, c * isw * pg, 0.0), mask=ok)
        tl.store(gpg_ptr + offs, tl.where(live, c * isw * g, 0.0), mask=ok)
        tl.store(flag_ptr + offs, tl.where(live, flag, 0), mask=ok)
        if HAS_REF:
            ref = tl.load(ref_ptr + offs, mask=live, other=0.0)
            dr = ref - lp
            r_in = (dr >= -log_clamp) & (dr <= log_clamp)
            drc = tl.minimum(tl.maximum(dr, -log_clamp), log_clamp)
            e = tl.exp(drc)
            tl.store(kl_ptr + offs, tl.where(live, c * (e - drc - 1.0), 0.0), mask=ok)
            tl.store(gkl_ptr + offs, tl.where(live & r_in, c * (1.0 - e), 0.0), mask=ok)


class PolicyLossFunction(torch.autograd.Function):
    """Triton path: (pg_loss, kl_loss, flags) from one fused pass; grads only to logprobs."""

    @staticmethod
    def forward(ctx, lp, old, adv, isw, coef, ref, clip_low, clip_high, dual_clip):
        n = lp.shape[0]
        pg, kl = torch.empty_like(lp), torch.empty_like(lp)
        gpg, gkl = torch.empty_like(lp), torch.empty_like(lp)
        flags = torch.empty(n, dtype=torch.int32, device=lp.device)
        if ref is None:
            kl.zero_()
            gkl.zero_()
        if n:
            block = 64 if triton_interpret() else 1024
            params = torch.tensor([1.0 - clip_low, 1.0 + clip_high, dual_clip or 0.0, LOG_CLAMP],
                                  dtype=acc_dtype(lp.dtype), device=lp.device)
            _policy_loss_fwd_kernel[(triton.cdiv(n, block),)](
                lp, old, adv, isw, coef, ref if ref is not None else lp, pg, kl, gpg, gkl, flags, params, n,
                HAS_DUAL=dual_clip is not None, HAS_REF=ref is not None, BLOCK=block)
        ctx.save_for_backward(gpg, gkl)
        ctx.mark_non_differentiable(flags)
        return pg.sum(), kl.sum(), flags

    @staticmethod
    @first_derivative_only("policy_loss (Triton)")
    def backward(ctx, g_pg, g_kl, _g_flags):
        gpg, gkl = ctx.saved_tensors
        return g_pg * gpg + g_kl * gkl, None, None, None, None, None, None, None, None

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOSS_METRIC_NAMES = ("pg_loss", "entropy", "kl_ref", "clip_frac", "dual_clip_frac", "ratio_mean",
                     "approx_kl_old")
LOG_CLAMP = 20.0


def k3(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per target, the k3 estimate of KL(pi || ref) the loss uses: exp(d) - d - 1, d = ref - lp
    clamped to +-LOG_CLAMP."""
    d = (ref_logprobs - logprobs).clamp(-LOG_CLAMP, LOG_CLAMP)
    return torch.exp(d) - d - 1.0


def _agg_coef(a, seq, num_seqs, aggregation):
    """Coefficients c with ``aggregate(x) = sum c x`` (c = 0 where a == 0)."""
    if aggregation == "token-mean":
        return a / a.sum().clamp(min=torch.finfo(a.dtype).tiny)
    seq_a = torch.zeros(num_seqs, dtype=a.dtype, device=a.device).index_add(0, seq, a)
    n_live = (seq_a > 0).sum().clamp(min=1).to(a.dtype)
    if aggregation == "seq-mean-token-sum":
        return a / n_live
    return a / torch.where(seq_a > 0, seq_a, 1.0)[seq] / n_live


def _check(logprobs, old_logprobs, advantages, mask, weight, extra, seq_ids, aggregation,
           clip_low, clip_high, dual_clip):
    check_1d("logprobs", logprobs)
    m = logprobs.shape[0]
    check_float("logprobs", logprobs)
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask),
                    ("weight", weight), *extra):
        if t is not None:
            check_1d(name, t, m)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation != "token-mean":
        if seq_ids is None:
            raise ValueError(f"aggregation={aggregation!r} needs seq_ids (e.g. target_rollout)")
        check_1d("seq_ids", seq_ids, m)
        check_int("seq_ids", seq_ids)
        if m and int(seq_ids.min()) < 0:
            raise ValueError("seq_ids must be >= 0")
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")


def _raise_first(checks: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError with the message of the first check whose flag (a 0-d bool tensor) is set.
    The flags come back from the device in one read: a `bool()` each would wait on the device once
    per check."""
    for (message, _), bad in zip(checks, torch.stack([flag for _, flag in checks]).tolist()):
        if bad:
            raise ValueError(message)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None,
                advantages: torch.Tensor, *, mask: torch.Tensor | None = None,
                weight: torch.Tensor | None = None, infer_logprobs: torch.Tensor | None = None,
                is_config: ISConfig = ISConfig(), paths: TreePaths | None = None,
                is_weights: torch.Tensor | None = None,
                clip_low: float = 0.2, clip_high: float | None = None,
                dual_clip: float | None = None, aggregation: str = "token-mean",
                seq_ids: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                entropy_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None,
                kl_coef: float = 0.0, backend: str = "auto") -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped-surrogate loss (a 0-d tensor with grad) and its metrics (see module docstring).

    old_logprobs None means on-policy (old = logprobs detached). ``paths`` is needed only for
    sequence-level IS. ``is_weights``: detached IS weights (>= 0) to use as they are, instead of
    computing them from ``infer_logprobs`` (give one or neither; no IS metrics are then returned).
    ``entropy`` is per target (e.g. ``entropy[target_rows]``).
    """
    if clip_high is None:
        clip_high = clip_low
    if infer_logprobs is not None and is_weights is not None:
        raise ValueError("give infer_logprobs (weights computed here) or is_weights (precomputed), not both")
    extra = (("infer_logprobs", infer_logprobs), ("is_weights", is_weights), ("entropy", entropy),
             ("ref_logprobs", ref_logprobs))
    _check(logprobs, old_logprobs, advantages, mask, weight, extra, seq_ids, aggregation,
           clip_low, clip_high, dual_clip)
    backend = pick_backend(backend, logprobs)
    m = logprobs.shape[0]
    dt = acc_dtype(logprobs.dtype)
    dev = logprobs.device
    a = torch.ones(m, dtype=dt, device=dev) if mask is None else mask.detach().to(dt)
    checks = [("mask must be >= 0", (a < 0).any())]
    if weight is not None:
        w = weight.detach().to(dt)
        checks.append(("weight must be finite and >= 0 where mask > 0",
                       ((a > 0) & ~(torch.isfinite(w) & (w >= 0))).any()))
        a = a * w
    valid = a > 0
    for name, t in (("advantages", advantages), ("old_logprobs", old_logprobs), *extra):
        if t is not None:
            checks.append((f"{name} holds non-finite value(s) where mask > 0", (valid & ~torch.isfinite(t)).any()))
    if is_weights is not None:
        checks.append(("is_weights must be >= 0 where mask > 0", (valid & (is_weights < 0)).any()))
    _raise_first(checks)
    a = torch.where(valid, a, 0.0)
    lp = torch.where(valid, logprobs.to(dt), 0.0)
    # Gradients flow to logprobs (and entropy) alone, whatever else requires grad, on every backend:
    # old_logprobs, advantages and ref_logprobs are targets, not parameters of this loss.
    old = lp.detach() if old_logprobs is None else torch.where(valid, old_logprobs.detach().to(dt), 0.0)
    adv = torch.where(valid, advantages.detach().to(dt), 0.0)

    if infer_logprobs is not None:
        is_w, is_vec = importance_weights_device(old, infer_logprobs, a, config=is_config,
                                                 paths=paths, backend=backend)
    elif is_weights is not None:
        is_w, is_vec = torch.where(valid, is_weights.detach().to(dt), 0.0), None
    else:
        is_w, is_vec = torch.ones(m, dtype=dt, device=dev), None

    seq, num_seqs = None, 0
    if seq_ids is not None and aggregation != "token-mean":
        # numbered 0.. in order of id, so sparse ids (global rollout ids) cost no more than dense ones
        ids, seq = torch.unique(seq_ids, return_inverse=True)
        num_seqs = int(ids.shape[0])
    coef = _agg_coef(a, seq, num_seqs, aggregation)
    ref = None if ref_logprobs is None else torch.where(valid, ref_logprobs.detach().to(dt), 0.0)
    zero = torch.zeros((), dtype=dt, device=dev)
    if backend == "triton":
        pg_loss, kl_mean, flags = PolicyLossFunction.apply(
            lp, old.contiguous(), adv.contiguous(), is_w.detach().contiguous(),
            coef.contiguous(), ref, float(clip_low), float(clip_high), dual_clip)
        clipped, dual = (flags & 1) > 0, (flags & 2) > 0
    else:
        log_r = (lp - old).clamp(-LOG_CLAMP, LOG_CLAMP)
        ratio = torch.exp(log_r)
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        pg = torch.maximum(pg1, pg2)
        clipped = pg2 > pg1
        dual = torch.zeros_like(clipped)
        if dual_clip is not None:
            pg3 = -adv * dual_clip
            dual = (adv < 0) & (pg3 < pg)
            pg = torch.where(dual, pg3, pg)
        pg_loss = (coef * is_w.detach() * pg).sum()
        kl_mean = zero
        if ref is not None:
            kl_mean = (coef * k3(ref, lp)).sum()
    loss = pg_loss + kl_coef * kl_mean if ref is not None else pg_loss
    ent_mean = zero
    if entropy is not None:
        ent_mean = (coef * torch.where(valid, entropy.to(dt), 0.0)).sum()
        loss = loss - entropy_coef * ent_mean

    with torch.no_grad():
        den = a.sum().clamp(min=torch.finfo(dt).tiny)

        def wmean(x):
            return (a * x.to(dt)).sum() / den

        log_r = (lp.detach() - old).clamp(-LOG_CLAMP, LOG_CLAMP)
        vec = torch.stack([pg_loss.detach(), ent_mean.detach(), kl_mean.detach(),
                           wmean(clipped), wmean(dual), wmean(torch.exp(log_r)),
                           wmean(torch.exp(log_r) - 1.0 - log_r)]).double()
        names = LOSS_METRIC_NAMES
        if is_vec is not None:
            vec = torch.cat([vec, is_vec])
            names = names + IS_METRIC_NAMES
        metrics = metrics_to_host(names, vec)
    return loss, metrics


def grpo_advantages(rewards: torch.Tensor, group_keys: torch.Tensor, *,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)``.

    rewards[R] float; group_keys[R] or [R, k] integers (rows with equal keys form a group, e.g.
    task id, or (task id, harness id) for mixed-harness training). std is the unbiased sample std
    (as torch.std); a group of one has advantage 0 (there is nothing to compare it with).
    """
    check_1d("rewards", rewards)
    check_float("rewards", rewards)
    if group_keys.dim() not in (1, 2) or group_keys.shape[0] != rewards.shape[0]:
        raise ValueError(f"group_keys must be [R] or [R, k] with R={rewards.shape[0]}, "
                         f"got {tuple(group_keys.shape)}")
    check_int("group_keys", group_keys)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards hold non-finite values")
    if rewards.numel() == 0:
        return rewards.clone()
    keys = group_keys if group_keys.dim() == 2 else group_keys[:, None]
    _, inv = torch.unique(keys, dim=0, return_inverse=True)
    g = int(inv.max()) + 1
    r = rewards.to(acc_dtype(rewards.dtype))
    count = torch.bincount(inv, minlength=g).to(r.dtype)
    mean = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if not normalize_std:
        return torch.where(count[inv] > 1, centred, 0.0)
    var = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, centred * centred)
    std = (var / (count - 1).clamp(min=1)).sqrt()
    return torch.where(count[inv] > 1, centred / (std[inv] + eps), 0.0)

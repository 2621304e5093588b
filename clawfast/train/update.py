"""Step 5 of an RL step (`clawfast.train.step`) without the optimizer: forward and backward over
the micro-batches of one mini-batch under the tree mask, gradients accumulated in ``.grad`` so that
they are exactly those of the mini-batch's global loss (`accumulate_gradients`); and the clipped
gradient norm (`grad_norm`).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from clawfast.kernels import policy_loss
from clawfast.kernels.policy_loss import LOG_CLAMP, LOSS_METRIC_NAMES, k3
from clawfast.threads import KINDS
from clawfast.train.algorithms import value_loss_terms
from clawfast.train.data_parallel import rank_and_world, rank_schedule, sum_over_ranks
from clawfast.train.mismatch import mismatch
from clawfast.train.policy import Policy
from clawfast.train.prepare import StepData
from clawfast.train.proximal import FixedTargets, check_models, fix_step
from clawfast.train.step_config import StepConfig


def accumulate_gradients(policy: Policy, data: StepData, config: StepConfig, *,
                         ref_policy: Policy | None = None, fixed: FixedTargets | None = None,
                         minibatch: int = 0) -> dict[str, float]:
    """Step 5 of `clawfast.train.step`'s docstring without the optimizer: forward and backward over
    every micro-batch of mini-batch ``minibatch``; gradients accumulate in ``.grad``.

    ``fixed``: the step's `fix_step`, computed before its first update (None: computed here, which
    is right only for a step of one update). Returns the loss, the loss metrics (summed over ranks
    under torch.distributed) and the step's fixed metrics (IS / mismatch, PPO advantage and value means).
    """
    check_models(policy, config, ref_policy)
    if fixed is None:
        if config.ppo_epochs * len(data.minibatches) > 1:
            raise ValueError("a step of several updates needs fix_step(...) before its first update "
                             "(train_step does it); pass it as fixed=")
        fixed = fix_step(policy, data, config, ref_policy=ref_policy)
    rank, world = rank_and_world()
    device = policy.device
    mb = data.minibatches[minibatch]
    denominator = data.denominators[minibatch]
    if denominator <= 0:  # nothing trainable: no forward, no gradient
        return {"loss": 0.0, "num_targets": 0.0}
    schedule = [(int(mb[k]), real) for k, real in rank_schedule(len(mb), rank, world)]
    offsets = data.offsets
    metrics: dict[str, float] = {}
    t1 = time.perf_counter()
    # loss (the full objective), its policy-gradient surrogate part, its value part, the kernel's metrics
    sums = torch.zeros(3 + len(LOSS_METRIC_NAMES), dtype=torch.float64)
    collected = []  # (logprobs, infer, weights, rollout) of real targets, for the IS metrics of a one-update step
    # per thread kind: loss weight and weighted advantage, IS ratio, k3 (summed on the device: no sync per batch)
    per_kind = torch.zeros(len(KINDS), 4, dtype=torch.float64, device=device) if len(config.train_threads) > 1 else None
    for b, real in schedule:
        batch = data.batches[b]
        out = policy.run(batch)
        rows = torch.as_tensor(batch.target_rows, device=device).long()
        a = torch.as_tensor(data.weights[b], device=device)
        infer = torch.as_tensor(batch.infer_logprobs, device=device)
        sl = slice(int(offsets[b]), int(offsets[b + 1]))
        if config.name == "grpo":
            adv = torch.as_tensor(data.advantages[b], device=device)
        else:
            frows = torch.as_tensor(data.forest_rows[b], device=device)
            adv = fixed.advantages[frows]
        ref_lp = None
        if fixed.ref is not None:
            ref_lp = fixed.ref[sl]
        elif ref_policy is not None:
            with torch.no_grad():
                ref_lp = ref_policy.run(batch).logprobs
        old = is_w = infer_arg = None
        if fixed.proximal is None:  # one update at token level: old = this forward, detached
            infer_arg = None if config.is_mode == "off" else infer
        else:
            old = fixed.proximal[sl]
            is_w = None if fixed.is_weights is None else fixed.is_weights[sl]
        pg, m = policy_loss(out.logprobs, old, adv, weight=a, infer_logprobs=infer_arg, is_weights=is_w,
                            is_config=config.is_config(), clip_low=config.clip_low, clip_high=config.clip_high,
                            dual_clip=config.dual_clip, aggregation="token-mean", entropy=out.entropy,
                            entropy_coef=config.entropy_coef, ref_logprobs=ref_lp, kl_coef=config.kl_coef)
        a_sum = a.sum()
        pg_part = pg * a_sum / denominator
        v_part = torch.zeros((), dtype=pg.dtype, device=device)
        if config.name == "ppo":
            v = out.values[rows].to(pg.dtype)
            terms = value_loss_terms(v, fixed.old_values[frows].to(pg.dtype), fixed.returns[frows].to(pg.dtype),
                                     config.value_clip)
            v_part = config.value_coef * (a.to(pg.dtype) * terms).sum() / denominator
        scale = float(world) if real else 0.0  # FSDP/DDP average gradients over ranks
        ((pg_part + v_part) * scale).backward()
        if real:
            w = float(a_sum)
            # `pg` is the whole policy loss (surrogate + kl_coef * KL - entropy_coef * entropy); the
            # pg_loss metric is the surrogate alone, the kernel's own pg_loss scaled like `pg_part`,
            # so that pg_loss, kl_ref and entropy are separate parts of `loss`.
            full_f, v_f = float(pg_part.detach()), float(v_part.detach())
            surrogate_f = m["pg_loss"] * w / denominator
            sums += torch.tensor([full_f + v_f, surrogate_f, v_f]
                                 + [m[k] * w for k in LOSS_METRIC_NAMES], dtype=torch.float64)
            if per_kind is not None:
                prox = out.logprobs.detach() if old is None else old
                per_kind += _kind_sums(data.target_kind[b], a, adv, prox, infer, ref_lp, out.logprobs.detach())
            if fixed.proximal is None:
                collected.append((out.logprobs.detach().cpu(), infer.cpu(), a.cpu(),
                                  torch.as_tensor(batch.target_rollout)))
    metrics["time_fwd_bwd_s"] = time.perf_counter() - t1
    sums = sum_over_ranks(sums.to(device)).cpu()
    total_w = sum(float(data.weights[b].sum()) for b in mb)
    metrics["loss"], metrics["pg_loss"], metrics["value_loss"] = sums[0].item(), sums[1].item(), sums[2].item()
    for i, k in enumerate(LOSS_METRIC_NAMES):
        if k != "pg_loss":
            metrics[k] = sums[3 + i].item() / total_w
    if fixed.proximal is None:
        metrics.update(_is_metrics(collected, config, world))
    if per_kind is not None:
        per_kind = sum_over_ranks(per_kind).cpu()
        for i, k in enumerate(KINDS):
            w = per_kind[i, 0].item()
            if w > 0:
                metrics[f"threads/{k}/advantage_mean"] = per_kind[i, 1].item() / w
                metrics[f"threads/{k}/is_ratio_mean"] = per_kind[i, 2].item() / w
                if ref_policy is not None:
                    metrics[f"threads/{k}/kl_mean"] = per_kind[i, 3].item() / w
    metrics.update(fixed.metrics)
    return metrics


def _kind_sums(kinds, weight, adv, proximal, infer, ref_lp, logprobs) -> torch.Tensor:
    """float64[len(KINDS), 4]: per thread kind, the targets' loss weight and the weighted sums of
    the advantage, the IS ratio pi_prox / pi_behav and the k3 KL to the reference."""
    w = weight.double()
    rho = torch.exp((proximal.double() - infer.double()).clamp(-LOG_CLAMP, LOG_CLAMP))
    kl = k3(ref_lp.double(), logprobs.double()) if ref_lp is not None else torch.zeros_like(w)
    cols = torch.stack([w, w * adv.double(), w * rho, w * kl], 1)
    index = torch.as_tensor(kinds, device=w.device).long()
    return torch.zeros(len(KINDS), 4, dtype=torch.float64, device=w.device).index_add_(0, index, cols)


def _is_metrics(collected, config: StepConfig, world: int) -> dict[str, float]:
    """Mismatch/IS metrics over every target of a one-update step (gathered from all ranks)."""
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, collected)
        collected = [item for part in gathered for item in part]
    if not collected:
        return {}
    lp, infer, a, seq = (torch.cat(parts) for parts in zip(*collected))
    return mismatch(lp, infer, a, seq, config)[1]


def grad_norm(policy: torch.nn.Module, max_norm: float | None) -> float:
    """Clip the gradient norm of all parameters (None: only measure it); returns the norm before clipping."""
    params = [p for p in policy.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)

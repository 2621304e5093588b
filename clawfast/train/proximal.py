"""Step 4 of an RL step (`clawfast.train.step`): what is fixed before its first optimizer update
(`fix_step`, one no-grad pass over every micro-batch): PPO's old values and tree GAE, the proximal
log-probs (the policy at the start of the step), the reference policy's, and from them the IS weights
and the step's IS / mismatch metrics. No pass when none of it is needed: a GRPO step of one update
at token level, where that update's own forward, detached, is the proximal policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from clawfast.train.algorithms import forest_paths, ppo_advantages
from clawfast.train.data_parallel import rank_and_world, rank_schedule, sum_over_ranks
from clawfast.train.mismatch import mismatch
from clawfast.train.policy import Policy
from clawfast.train.prepare import StepData
from clawfast.train.step_config import StepConfig


def check_models(policy: Policy, config: StepConfig, ref_policy: Policy | None) -> None:
    """Refuse a policy without the value head PPO needs, or a KL term without a reference policy."""
    if config.name == "ppo" and policy.value_head is None:
        raise ValueError("algorithm='ppo' needs a policy with a value head (Policy(..., value_head=True))")
    if config.kl_coef > 0 and ref_policy is None:
        raise ValueError("kl_coef > 0 needs a ref_policy")


@dataclass(eq=False)
class FixedTargets:
    """What an RL step fixes before its first optimizer update, shared by all its updates (`fix_step`).

    Tensors are on the policy's device; per-target ones are flat over the step's targets in
    micro-batch order (slice with `StepData.offsets`).
    proximal: float64 log-probs of the policy at the start of the step; None when the step makes
    one update at token level (`StepConfig.needs_proximal`), where that update's own forward,
    detached, is the proximal policy and `policy_loss` computes the IS weights from it.
    is_weights: detached IS weights of proximal vs behaviour (None without a proximal pass, or
    with is_mode "off"). ref: the reference policy's log-probs (None without ref_policy or without
    a proximal pass: each update then runs the reference itself).
    old_values / advantages / returns: PPO, per forest row (None for GRPO).
    metrics: the step's IS / mismatch metrics (only with a proximal pass; otherwise they are
    measured at the update), PPO's advantage_mean / value_mean, and time_values_s.
    """

    proximal: torch.Tensor | None
    is_weights: torch.Tensor | None
    ref: torch.Tensor | None
    old_values: torch.Tensor | None
    advantages: torch.Tensor | None
    returns: torch.Tensor | None
    metrics: dict[str, float]


def fix_step(policy: Policy, data: StepData, config: StepConfig, *,
             ref_policy: Policy | None = None) -> FixedTargets:
    """Step 4 of `clawfast.train.step`'s docstring: one no-grad pass over every micro-batch of the step (rank r
    its share under torch.distributed; the results are summed over ranks), when PPO's old values or
    the proximal log-probs are needed; then GAE, IS weights and the step's mismatch metrics."""
    check_models(policy, config, ref_policy)
    t0 = time.perf_counter()
    device = policy.device
    ppo = config.name == "ppo"
    proximal = config.needs_proximal(len(data.minibatches))
    if data.denominator <= 0 or not (ppo or proximal):  # nothing trainable, or nothing to fix
        return FixedTargets(None, None, None, None, None, None, {"time_values_s": 0.0})
    rank, world = rank_and_world()
    offsets = data.offsets
    with_ref = proximal and ref_policy is not None
    # one vector [proximal | ref | values], so that one collective sums the ranks' shares
    n_lp = int(offsets[-1]) if proximal else 0
    n_ref = n_lp if with_ref else 0
    flat = torch.zeros(n_lp + n_ref + (data.forest.num_rows if ppo else 0), dtype=torch.float64, device=device)
    with torch.no_grad():
        for b, real in rank_schedule(len(data.batches), rank, world):
            batch = data.batches[b]
            out = policy.run(batch)
            ref_out = ref_policy.run(batch) if with_ref else None
            if not real:
                continue
            lo, hi = int(offsets[b]), int(offsets[b + 1])
            if proximal:
                flat[lo:hi] = out.logprobs.double()
            if with_ref:
                flat[n_lp + lo:n_lp + hi] = ref_out.logprobs.double()
            if ppo:
                rows = torch.as_tensor(data.forest_rows[b], device=device)
                target_rows = torch.as_tensor(batch.target_rows, device=device).long()
                flat[n_lp + n_ref + rows] = out.values[target_rows].double()
    flat = sum_over_ranks(flat)
    lp, ref, values = flat[:n_lp], flat[n_lp:n_lp + n_ref], flat[n_lp + n_ref:]
    metrics: dict[str, float] = {}
    adv = ret = None
    if ppo:
        adv, ret = ppo_advantages(data.forest, values, data.rewards, gamma=config.gamma, lam=config.lam,
                                  mode=config.gae_mode)
        train = torch.as_tensor(data.forest.trainable, device=device)
        metrics["advantage_mean"] = adv[train].mean().item() if bool(train.any()) else 0.0
        metrics["value_mean"] = values[train].mean().item() if bool(train.any()) else 0.0
    is_w = None
    if proximal:
        infer = torch.as_tensor(np.concatenate([b.infer_logprobs for b in data.batches]), device=device)
        a = torch.as_tensor(np.concatenate(data.weights), device=device)
        seq = torch.as_tensor(np.concatenate([b.target_rollout for b in data.batches]), device=device)
        paths = (forest_paths(data.forest, np.concatenate(data.forest_rows), device)
                 if config.is_level == "sequence" else None)
        w, is_metrics = mismatch(lp, infer, a, seq, config, paths)
        metrics.update(is_metrics)
        is_w = None if config.is_mode == "off" else w
    metrics["time_values_s"] = time.perf_counter() - t0
    return FixedTargets(lp if proximal else None, is_w, ref if with_ref else None, values if ppo else None,
                        adv, ret, metrics)

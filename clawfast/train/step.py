"""One RL step's training on a batch of rollouts: tree, pack, proximal pass, PPO epochs x mini-batches.

    metrics = train_step(policy, optimizer, rollouts, groups=None, config=StepConfig(), rng=None)

1. **Filter** rollouts: status not in ``config.keep_statuses``, stale (oldest call more than
   ``max_staleness`` weight versions behind ``weight_version``), or without calls. After step 3,
   rollouts with more kept leaves than ``max_kept_leaves`` or a kept path longer than
   ``micro_batch_tokens`` are not trained either (they still count in their GRPO group's baseline),
   nor, with ``filter_groups``, the rollouts of a GRPO group whose rewards are all equal.
2. **Advantages** (GRPO): one per rollout, over its group (``groups`` or ``config.group_by``).
3. **Tree + leaf filter** (`build_tree`: dead retries, excluded calls — every call whose kind from
   `clawfast.threads.reconstruct` is not main —, ``max_kept_leaves``), split
   into ``config.updates_per_step`` **mini-batches** of whole groups (round-robin over groups in
   batch order), each **packed** into micro-batches of at most ``config.micro_batch_tokens`` rows
   (shared prefixes once). Steps 1-3 are `clawfast.train.prepare.prepare_step`, once per RL step.
4. **Fixed before any update** (`clawfast.train.proximal.fix_step`, one no-grad pass over every
   micro-batch): PPO's old values and tree GAE (`algorithms.ppo_advantages`); the *proximal*
   log-probs (the policy at the start of the step) of every target, the reference policy's, and from
   them the IS weights and the step's IS / mismatch metrics. The proximal pass is skipped when the
   step makes one update at token-level IS: the proximal policy is then the current one at that
   update's forward, so its log-probs are that forward's, detached (today's on-policy loss, bit for
   bit).
5. **Updates**: ``ppo_epochs`` passes over the mini-batches (order shuffled per epoch by ``rng``;
   none: in order). Per mini-batch (`_update`), for each of its micro-batches
   (`clawfast.train.update.accumulate_gradients`): forward under the tree mask, fused target
   log-probs (`clawfast.kernels.tree_logprobs`), `clawfast.kernels.policy_loss` plus the PPO value
   loss (clipped around the step's old values), ``backward``; then gradient clipping, the warm-up's
   lr (`clawfast.train.warmup`), ``optimizer.step()``, gradients zeroed.

**The loss (decoupled PPO).** Per target, with pi the current policy, pi_prox the proximal one and
pi_behav the sampler (``infer_logprobs``: each call's own, whatever weight version sampled it):
``w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (dual clip optional) with
``r = pi / pi_prox`` and ``w`` the detached IS weight of ``rho = pi_prox / pi_behav``: truncated
``min(rho, is_cap)`` or masked (``rho`` inside ``[is_lo, is_hi]``, else 0), per target
(``is_level="token"``) or per kept root-to-leaf path of a rollout (``"sequence"``: rho is the
product over the path's targets, over the whole tree whatever the micro-batching,
`algorithms.forest_paths`; a target on several kept paths gets the mean of their weights, which is
what the flat per-leaf copies of the tree give). ``is_mode="off"``: w = 1. Plus the k3 KL to
``ref_policy`` and the entropy bonus. The clip acts from the second update of a step on; the IS
weight corrects the engine/trainer mismatch and the staleness of asynchronous rollouts.

**Normaliser.** Each update's loss is one global average over its mini-batch, whatever the
micro-batching:

- ``"token-mean"``: ``sum_t l_t / T`` over all T trainable targets of the mini-batch (a token shared
  by several kept leaves of one rollout is ONE target: counted once).
- ``"seq-mean-token-mean"``: mean over rollouts of each rollout's mean over its targets.
- ``"seq-mean-token-sum"``: mean over rollouts of each rollout's sum over its targets.

Each micro-batch contributes ``policy_loss(token-mean over its targets) * sum(its weights) / D``
where D is the mini-batch's total weight (token-mean) or its number of rollouts with targets
(seq-mean), so the accumulated gradient is exactly that of the global loss.
tests/train/test_step_equivalence.py checks loss and gradients against the same step computed
from flat per-leaf trajectories.

**Metrics.** Per-update metrics (``loss``, the full objective: ``pg_loss``, the IS-weighted clipped
surrogate alone, plus ``kl_coef * kl_ref`` minus ``entropy_coef * entropy`` plus PPO's weighted
``value_loss``; entropy, kl_ref, clip_frac / ratio_mean / approx_kl_old against the proximal policy,
grad_norm) are averaged over the updates the step made (a mini-batch with nothing trainable makes
none and is not counted), times summed; the IS / mismatch metrics (proximal vs behaviour,
`clawfast.train.mismatch`) are the step's, under today's names and verl's ``rollout_corr/...`` names
(`clawfast.train.verl_names`; docs/DESIGN.md section 6).

**Data parallel** (`clawfast.train.data_parallel`). When ``torch.distributed`` is initialised, rank r
takes micro-batches r, r + W, ... (of the step in the proximal pass, of the mini-batch in an update);
every rank runs the same number of forward/backward calls (a rank short of batches repeats one with
zero loss weight, so FSDP's collectives stay matched), the loss is multiplied by W because FSDP/DDP average
gradients over ranks, the fixed pass's results are summed over ranks (each rank fills its own
targets), and metrics are summed over ranks. Every rank must receive the same rollouts and ``rng``
state (packing and the epoch order are deterministic).

Not supported: mini-batches re-drawn per epoch (the partition into mini-batches is fixed for the
step, only their order changes), sequence-level IS with ``is_mode="off"`` (refused by the config).
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import numpy as np
import torch

from clawfast.records import RolloutResult
from clawfast.train.checkpoint import TrainState
from clawfast.train.config import RunConfig
from clawfast.train.policy import Policy, rl_mode
from clawfast.train.prepare import StepData, prepare_step, token_counts
from clawfast.train.proximal import FixedTargets, fix_step
from clawfast.train.step_config import StepConfig, step_config
from clawfast.train.update import accumulate_gradients, grad_norm
from clawfast.train.warmup import warm_up


def train_step(policy: Policy, optimizer: torch.optim.Optimizer, rollouts: Sequence[RolloutResult],
               groups: Sequence[Hashable] | None = None, config: StepConfig = StepConfig(), *,
               weight_version: int | None = None, ref_policy: Policy | None = None,
               rng: np.random.Generator | None = None) -> dict[str, float]:
    """One RL step's training on ``rollouts`` (see the module docstring): ``config.ppo_epochs`` x
    ``config.updates_per_step`` optimizer updates on the same prepared data and proximal
    log-probs; returns the metrics.

    ``groups``: one hashable GRPO group key per rollout (None: ``config.group_by``); mini-batches
    hold whole groups. ``weight_version``: the policy's current version, for the staleness filter.
    ``ref_policy``: the frozen reference for the KL term (needed when ``config.kl_coef > 0``).
    ``rng``: shuffles the mini-batch order of each epoch (None: in order).
    Metrics: averaged over the updates made: loss (the full objective), pg_loss (its clipped surrogate
    part alone), value_loss, entropy, kl_ref, clip_frac,
    dual_clip_frac, ratio_mean, approx_kl_old (the last four against the proximal policy),
    grad_norm; summed: time_fwd_bwd_s, time_optimizer_s; the step's: the is_* / mismatch_* metrics
    and their ``rollout_corr/...`` names, advantage_mean / value_mean (PPO), num_updates (optimizer
    steps taken), stepped (1 if any), token counts (flat per call, flat per leaf, packed, dedup
    ratios), filter counts, main-thread fidelity (main_continuity, main_pairs, main_drift_tokens,
    main_divergences, side_calls) and the other timings (seconds). With nothing trainable the optimizer is
    not stepped (``stepped`` = 0).
    """
    rl_mode(policy)  # train mode (gradient checkpointing acts), no dropout (pi / pi_prox is 1 at equal weights)
    t0 = time.perf_counter()
    data = prepare_step(rollouts, groups, config, weight_version=weight_version)
    t_prep = time.perf_counter() - t0
    optimizer.zero_grad(set_to_none=True)
    fixed = fix_step(policy, data, config, ref_policy=ref_policy)
    updates = []
    for _ in range(config.ppo_epochs):
        order = rng.permutation(len(data.minibatches)) if rng is not None else range(len(data.minibatches))
        for k in order:
            updates.append(_update(policy, optimizer, data, config, fixed, int(k), ref_policy))
    metrics = _combine(updates)
    metrics.update(fixed.metrics)  # the step's own values, not means of copies
    metrics["num_updates"] = float(sum(u["stepped"] for u in updates))
    metrics["stepped"] = float(metrics["num_updates"] > 0)
    metrics["time_prepare_s"] = t_prep
    metrics["time_total_s"] = time.perf_counter() - t0
    metrics.update({k: float(v) for k, v in token_counts(data).items()})
    metrics.update({k: float(v) for k, v in data.counts.items()})
    return metrics


def _update(policy, optimizer, data: StepData, config: StepConfig, fixed: FixedTargets, minibatch: int,
            ref_policy) -> dict[str, float]:
    """One optimizer update on one mini-batch (skipped, ``stepped`` 0, when it has nothing trainable)."""
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(policy, data, config, ref_policy=ref_policy, fixed=fixed, minibatch=minibatch)
    t1 = time.perf_counter()
    stepped = data.denominators[minibatch] > 0
    metrics["grad_norm"] = grad_norm(policy, config.max_grad_norm) if stepped else 0.0
    if stepped:
        metrics["lr"] = warm_up(optimizer, config.warmup_updates)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics["stepped"] = float(stepped)
    metrics["time_optimizer_s"] = time.perf_counter() - t1
    return metrics


def _combine(updates: list[dict[str, float]]) -> dict[str, float]:
    """Per-update metrics of a step: times summed over every update, the rest averaged over the
    updates that stepped (one update: as it is). A mini-batch whose groups were all dropped makes no
    update: its zero loss and gradient norm would only dilute the means. With no update at all, the
    empty updates' zeros."""
    if len(updates) == 1:
        return dict(updates[0])
    made = [m for m in updates if m["stepped"]] or updates
    combined = {}
    for k in sorted({k for m in updates for k in m}):
        if k.startswith("time_"):
            combined[k] = float(np.sum([m[k] for m in updates if k in m]))
        elif any(k in m for m in made):
            combined[k] = float(np.mean([m[k] for m in made if k in m]))
    return combined


def train_on_rollouts(policy, optimizer, results: list[RolloutResult], config: RunConfig, state: TrainState,
                      ref_policy=None) -> dict[str, float]:
    """Shuffle the step's rollouts (seeded by seed and step) and run `train_step` on them, its
    mini-batch order seeded by seed and step too."""
    order = np.random.default_rng([config.seed, state.step, 7]).permutation(len(results))
    shuffled = [results[i] for i in order]
    return train_step(policy, optimizer, shuffled, None, step_config(config), weight_version=state.weight_version,
                      ref_policy=ref_policy, rng=np.random.default_rng([config.seed, state.step, 8]))

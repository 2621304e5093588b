"""One training step on a batch of rollouts: tree, pack, forward, loss, backward, optimizer step.

    metrics = train_step(policy, optimizer, rollouts, groups=None, config=StepConfig())

1. **Filter** rollouts: status not in ``config.keep_statuses``, stale (oldest call more than
   ``max_staleness`` weight versions behind ``weight_version``), or without calls. After step 3,
   rollouts with more kept leaves than ``max_kept_leaves`` or a kept path longer than
   ``max_tokens`` are not trained either (they still count in their GRPO group's baseline).
2. **Advantages** (GRPO): one per rollout, over its group (``groups`` or ``config.group_by``).
3. **Tree + leaf filter** (`build_tree`: dead retries, excluded calls, ``max_kept_leaves``) and
   **pack** into micro-batches of at most ``config.max_tokens`` rows (shared prefixes once).
4. PPO only: a no-grad pass for the old values of every target, then tree GAE per rollout
   (`algorithms.ppo_advantages`).
5. **Each micro-batch**: forward under the tree mask, fused target log-probs
   (`clawfast.kernels.tree_logprobs`), `clawfast.kernels.policy_loss` (clipped surrogate x
   token-level truncated/masked IS against the engine's log-probs, k3 KL to ``ref_policy``,
   entropy bonus) plus the PPO value loss, and ``backward``. Gradients accumulate.
6. Gradient clipping and ``optimizer.step()``; gradients are zeroed afterwards.

**Normaliser.** The step's loss is one global average, whatever the micro-batching:

- ``"token-mean"``: ``sum_t l_t / T`` over all T trainable targets of the step (a token shared by
  several kept leaves of one rollout is ONE target: counted once).
- ``"seq-mean-token-mean"``: mean over rollouts of each rollout's mean over its targets.
- ``"seq-mean-token-sum"``: mean over rollouts of each rollout's sum over its targets.

Each micro-batch contributes ``policy_loss(token-mean over its targets) * sum(its weights) / D``
where D is the step's total weight (token-mean) or its number of rollouts with targets
(seq-mean), so the accumulated gradient is exactly that of the global loss.
tests/train/test_step_equivalence.py checks loss and gradients against the same step computed
from flat per-leaf trajectories.

**Data parallel.** When ``torch.distributed`` is initialised, rank r takes micro-batches
r, r + W, ...; every rank runs the same number of forward/backward calls (a rank short of batches
repeats one with zero loss weight, so FSDP's collectives stay matched), the loss is multiplied by
W because FSDP/DDP average gradients over ranks, and metrics are summed over ranks. Every rank must
receive the same rollouts (packing is deterministic).

Not supported: sequence-level IS (a path's ratio needs the targets of every micro-batch before
any loss; `StepConfig` offers token-level IS only), several PPO epochs per `train_step` call
(one optimizer update per call: the old policy is the current one, so the PPO ratio is 1 and the
clip inactive at the update; the IS correction against the engine's log-probs is what acts).
`train_on_rollouts` splits an RL step's groups into ``optim.updates_per_step`` such calls.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

import numpy as np
import torch
from pydantic import Field, model_validator
import torch.distributed as dist

from clawfast.kernels import ISConfig, importance_weights, policy_loss
from clawfast.kernels.policy_loss import LOSS_METRIC_NAMES
from clawfast.pack import PackedBatch, pack, pack_stats
from clawfast.records import RolloutResult
from clawfast.train.algorithms import (
    KeptForest,
    group_ids,
    grpo_rollout_advantages,
    ppo_advantages,
    stale_rollouts,
    value_loss_terms,
)
from clawfast.train.checkpoint import TrainState
from clawfast.train.config import AlgorithmConfig, RunConfig
from clawfast.train.policy import Policy
from clawfast.tree import PrefixTree, build_tree

class StepConfig(AlgorithmConfig):
    """Everything `train_step` needs besides the policy, optimizer and rollouts: the run's
    ``[algorithm]`` section (`clawfast.train.config.AlgorithmConfig`, where each field is described;
    `name` is "grpo" or "ppo", which needs a policy with a value head) with `group_by` resolved to
    "task" or "task_harness", plus two fields of ``[optim]``: max_tokens (rows per micro-batch) and
    max_grad_norm (clip the global gradient norm; None: no clipping, the norm is still reported).
    Validated on construction like every config section (a `ValueError` naming the field)."""

    group_by: Literal["task", "task_harness"] = "task"
    max_tokens: int = Field(8192, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _is_config(self) -> "StepConfig":
        self.is_config()  # fail here, at construction, not mid-step
        return self

    def is_config(self) -> ISConfig:
        mode = "truncate" if self.is_mode == "off" else self.is_mode
        return ISConfig(level="token", mode=mode, cap=self.is_cap, lo=self.is_lo, hi=self.is_hi)


def step_config(config: RunConfig) -> StepConfig:
    """The trainer's `StepConfig` of a run: its algorithm section, group_by resolved, and the optimizer's
    micro-batch size and gradient clip."""
    return StepConfig(**{**config.algorithm.model_dump(), "group_by": config.group_by},
                      max_tokens=config.optim.max_tokens, max_grad_norm=config.optim.max_grad_norm)


@dataclass(eq=False)
class StepData:
    """A step's rollouts turned into packed micro-batches and per-target loss inputs (CPU, numpy).

    rollouts: the trained rollouts (after the filters), aligned with ``trees`` and ``rewards``.
    batches: the micro-batches. weights[b]: per-target loss weight ``loss_mask * weight`` (divided
    by its rollout's total for "seq-mean-token-mean"). denominator: D of the module docstring.
    advantages[b]: per-target GRPO advantages (None for PPO: computed in the step). forest /
    forest_rows[b]: PPO's unmerged kept trees and each target's row there. counts: filter counts.
    """

    rollouts: list[RolloutResult]
    trees: list[PrefixTree]
    rewards: np.ndarray
    batches: list[PackedBatch]
    weights: list[np.ndarray]
    denominator: float
    advantages: list[np.ndarray] | None
    forest: KeptForest | None
    forest_rows: list[np.ndarray] | None
    counts: dict[str, int] = field(default_factory=dict)


def prepare_step(rollouts: Sequence[RolloutResult], groups: Sequence[Hashable] | None, config: StepConfig, *,
                 weight_version: int | None = None) -> StepData:
    """Steps 1-3 of the module docstring (no model involved)."""
    rollouts = list(rollouts)
    if groups is not None and len(groups) != len(rollouts):
        raise ValueError(f"{len(groups)} group keys for {len(rollouts)} rollouts")
    bad_status = np.array([r.status not in config.keep_statuses for r in rollouts], dtype=bool)
    stale = stale_rollouts(rollouts, weight_version, config.max_staleness) & ~bad_status
    empty = np.array([not r.calls for r in rollouts], dtype=bool) & ~bad_status & ~stale
    keep = np.flatnonzero(~(bad_status | stale | empty))
    kept = [rollouts[i] for i in keep]
    rewards = np.array([r.reward for r in kept], dtype=np.float64)
    if config.name == "grpo":
        keys = None if groups is None else [groups[i] for i in keep]
        rollout_adv = grpo_rollout_advantages(rewards, group_ids(kept, config.group_by, keys),
                                              normalize_std=config.normalize_std)
    trees = [build_tree(r.calls, max_kept_leaves=config.max_kept_leaves, drop_dead=config.drop_dead) for r in kept]
    # A kept path longer than a micro-batch cannot be trained (pack would raise): drop its rollout
    # and count it, rather than lose the whole step to one overlong session.
    too_long = [not t.dropped and max((lf.depth for lf in t.leaves if lf.status == "kept"), default=0)
                > config.max_tokens for t in trees]
    trees = [dataclasses.replace(t, dropped=True) if long else t for t, long in zip(trees, too_long)]
    batches = pack(trees, config.max_tokens, rewards=rewards.astype(np.float32)) if trees else []

    weights = [b.loss_mask.astype(np.float64) * b.weight for b in batches]
    per_rollout = np.zeros(len(kept), dtype=np.float64)
    for b, w in zip(batches, weights):
        np.add.at(per_rollout, b.target_rollout, w)
    if config.aggregation == "token-mean":
        denominator = float(per_rollout.sum())
    else:
        denominator = float((per_rollout > 0).sum())
        if config.aggregation == "seq-mean-token-mean":
            weights = [w / per_rollout[b.target_rollout] for b, w in zip(batches, weights)]
    advantages = forest = forest_rows = None
    if config.name == "grpo":
        advantages = [rollout_adv[b.target_rollout] for b in batches]
    else:
        forest = KeptForest.build(trees)
        forest_rows = [forest.locate(b) for b in batches]
    counts = {
        "rollouts_in": len(rollouts),
        "rollouts_trained": int(sum(not t.dropped for t in trees)),
        "dropped_status": int(bad_status.sum()),
        "dropped_stale": int(stale.sum()),
        "dropped_no_calls": int(empty.sum()),
        "dropped_branching": int(sum(t.dropped for t in trees)) - int(sum(too_long)),
        "dropped_too_long": int(sum(too_long)),
    }
    return StepData(kept, trees, rewards, batches, weights, denominator, advantages, forest, forest_rows, counts)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _schedule(num_batches: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """(batch index, real) for each forward/backward of this rank; padding entries are not real."""
    mine = list(range(rank, num_batches, world))
    steps = -(-num_batches // world)
    return [(mine[k], True) if k < len(mine) else ((mine or [0])[0], False) for k in range(steps)]


def _allreduce(vec: torch.Tensor) -> torch.Tensor:
    if _world()[1] > 1:
        dist.all_reduce(vec)
    return vec


def _old_values(policy: Policy, data: StepData, schedule, device) -> torch.Tensor:
    """PPO: the current (old) value of every forest row that has a target, from a no-grad pass."""
    values = torch.zeros(data.forest.num_rows, dtype=torch.float64, device=device)
    with torch.no_grad():
        for b, real in schedule:
            batch = data.batches[b]
            out = policy.run(batch)
            if real:
                rows = torch.as_tensor(data.forest_rows[b], device=device)
                values[rows] = out.values[torch.as_tensor(batch.target_rows, device=device).long()].double()
    return _allreduce(values)


def accumulate_gradients(policy: Policy, data: StepData, config: StepConfig, *,
                         ref_policy: Policy | None = None) -> dict[str, float]:
    """Steps 4-5: forward and backward over every micro-batch; gradients accumulate in ``.grad``.

    Returns the loss and the loss metrics (summed over ranks under torch.distributed).
    """
    if config.name == "ppo" and policy.value_head is None:
        raise ValueError("algorithm='ppo' needs a policy with a value head (Policy(..., value_head=True))")
    if config.kl_coef > 0 and ref_policy is None:
        raise ValueError("kl_coef > 0 needs a ref_policy")
    rank, world = _world()
    device = policy.device
    schedule = _schedule(len(data.batches), rank, world)
    metrics: dict[str, float] = {}
    if data.denominator <= 0:  # nothing trainable: no forward, no gradient
        return {"loss": 0.0, "num_targets": 0.0}
    t0 = time.perf_counter()
    adv_rows = ret_rows = old_v = None
    if config.name == "ppo":
        old_v = _old_values(policy, data, schedule, device)
        adv_rows, ret_rows = ppo_advantages(data.forest, old_v, data.rewards, gamma=config.gamma, lam=config.lam,
                                            mode=config.gae_mode)
    metrics["time_values_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    sums = torch.zeros(3 + len(LOSS_METRIC_NAMES), dtype=torch.float64)  # loss, pg part, value part, metrics
    collected = []  # (logprobs, infer, weights) of real targets, for the step's IS metrics
    for b, real in schedule:
        batch = data.batches[b]
        out = policy.run(batch)
        rows = torch.as_tensor(batch.target_rows, device=device).long()
        a = torch.as_tensor(data.weights[b], device=device)
        infer = torch.as_tensor(batch.infer_logprobs, device=device)
        if config.name == "grpo":
            adv = torch.as_tensor(data.advantages[b], device=device)
        else:
            frows = torch.as_tensor(data.forest_rows[b], device=device)
            adv = adv_rows[frows]
        ref_lp = None
        if ref_policy is not None:
            with torch.no_grad():
                ref_lp = ref_policy.run(batch).logprobs
        pg, m = policy_loss(out.logprobs, None, adv, weight=a,
                            infer_logprobs=None if config.is_mode == "off" else infer,
                            is_config=config.is_config(), clip_low=config.clip_low, clip_high=config.clip_high,
                            dual_clip=config.dual_clip, aggregation="token-mean", entropy=out.entropy,
                            entropy_coef=config.entropy_coef, ref_logprobs=ref_lp, kl_coef=config.kl_coef)
        a_sum = a.sum()
        pg_part = pg * a_sum / data.denominator
        v_part = torch.zeros((), dtype=pg.dtype, device=device)
        if config.name == "ppo":
            v = out.values[rows].to(pg.dtype)
            terms = value_loss_terms(v, old_v[frows].to(pg.dtype), ret_rows[frows].to(pg.dtype), config.value_clip)
            v_part = config.value_coef * (a.to(pg.dtype) * terms).sum() / data.denominator
        scale = float(world) if real else 0.0  # FSDP/DDP average gradients over ranks
        ((pg_part + v_part) * scale).backward()
        if real:
            w = float(a_sum)
            pg_f, v_f = float(pg_part.detach()), float(v_part.detach())
            sums += torch.tensor([pg_f + v_f, pg_f, v_f]
                                 + [m[k] * w for k in LOSS_METRIC_NAMES], dtype=torch.float64)
            collected.append((out.logprobs.detach().cpu(), infer.cpu(), a.cpu()))
    metrics["time_fwd_bwd_s"] = time.perf_counter() - t1
    sums = _allreduce(sums.to(device)).cpu()
    total_w = sum(float(w.sum()) for w in data.weights)
    metrics["loss"], metrics["pg_loss"], metrics["value_loss"] = sums[0].item(), sums[1].item(), sums[2].item()
    for i, k in enumerate(LOSS_METRIC_NAMES):
        if k != "pg_loss":
            metrics[k] = sums[3 + i].item() / total_w
    metrics.update(_is_metrics(collected, config, world))
    if config.name == "ppo":
        train = torch.as_tensor(data.forest.trainable, device=device)
        metrics["advantage_mean"] = adv_rows[train].mean().item() if bool(train.any()) else 0.0
        metrics["value_mean"] = old_v[train].mean().item() if bool(train.any()) else 0.0
    return metrics


def _is_metrics(collected, config: StepConfig, world: int) -> dict[str, float]:
    """Mismatch/IS metrics over every target of the step (gathered from all ranks)."""
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, collected)
        collected = [item for part in gathered for item in part]
    if not collected:
        return {}
    lp, infer, a = (torch.cat(parts) for parts in zip(*collected))
    return importance_weights(lp, infer, a, config=config.is_config()).metrics


def token_counts(data: StepData) -> dict[str, float]:
    """Flat vs packed token counts of a prepared step (dedup ratio = flat per call / packed rows)."""
    live = [t for t in data.trees if not t.dropped]
    stats = pack_stats(data.batches)
    packed = stats["num_tokens"]
    per_call = sum(t.num_call_tokens for t in live)
    per_leaf = sum(t.num_flat_tokens for t in live)
    return {
        "tokens_per_call_flat": per_call,
        "tokens_per_leaf_flat": per_leaf,
        "tokens_tree_unique": sum(t.num_unique_tokens for t in live),  # incl. dead/excluded branches
        "tokens_packed": packed,
        "tokens_context_rows": stats["num_context_tokens"],
        "num_targets": stats["num_targets"],
        "num_microbatches": stats["num_batches"],
        "fill": stats["fill_total"],
        "dedup_ratio_call": per_call / packed if packed else 0.0,
        "dedup_ratio_leaf": per_leaf / packed if packed else 0.0,
    }


def grad_norm(policy: torch.nn.Module, max_norm: float | None) -> float:
    """Clip the gradient norm of all parameters (None: only measure it); returns the norm before clipping."""
    params = [p for p in policy.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def train_step(policy: Policy, optimizer: torch.optim.Optimizer, rollouts: Sequence[RolloutResult],
               groups: Sequence[Hashable] | None = None, config: StepConfig = StepConfig(), *,
               weight_version: int | None = None, ref_policy: Policy | None = None) -> dict[str, float]:
    """One optimizer step on ``rollouts`` (see the module docstring); returns the metrics.

    ``groups``: one hashable GRPO group key per rollout (None: ``config.group_by``).
    ``weight_version``: the policy's current version, for the staleness filter.
    ``ref_policy``: the frozen reference for the KL term (needed when ``config.kl_coef > 0``).
    Metrics: loss, pg_loss, value_loss, entropy, kl_ref, clip_frac, dual_clip_frac, ratio_mean,
    approx_kl_old, the is_* / mismatch_* metrics, grad_norm, token counts (flat per call, flat per
    leaf, packed, dedup ratios), filter counts and timings (seconds). With nothing trainable the
    optimizer is not stepped (``stepped`` = 0).
    """
    t0 = time.perf_counter()
    data = prepare_step(rollouts, groups, config, weight_version=weight_version)
    t_prep = time.perf_counter() - t0
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(policy, data, config, ref_policy=ref_policy)
    t1 = time.perf_counter()
    stepped = data.denominator > 0
    metrics["grad_norm"] = grad_norm(policy, config.max_grad_norm) if stepped else 0.0
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics["stepped"] = float(stepped)
    metrics["time_prepare_s"] = t_prep
    metrics["time_optimizer_s"] = time.perf_counter() - t1
    metrics["time_total_s"] = time.perf_counter() - t0
    metrics.update({k: float(v) for k, v in token_counts(data).items()})
    metrics.update({k: float(v) for k, v in data.counts.items()})
    return metrics

def split_groups(results: list[RolloutResult], group_by: str, n: int) -> list[list[RolloutResult]]:
    """Split whole GRPO groups into `n` mini-batches (round-robin over groups in batch order)."""
    keys: dict = {}
    for r in results:
        key = r.task_id if group_by == "task" else (r.task_id, r.harness)
        keys.setdefault(key, []).append(r)
    parts: list[list[RolloutResult]] = [[] for _ in range(min(n, len(keys)) or 1)]
    for i, group in enumerate(keys.values()):
        parts[i % len(parts)].extend(group)
    return [p for p in parts if p]


def mean_metrics(all_metrics: list[dict[str, float]]) -> dict[str, float]:
    if len(all_metrics) == 1:
        return all_metrics[0]
    keys = {k for m in all_metrics for k in m}
    return {k: float(np.mean([m[k] for m in all_metrics if k in m])) for k in sorted(keys)}


def train_on_rollouts(policy, optimizer, results: list[RolloutResult], config: RunConfig, state: TrainState,
                      ref_policy=None) -> dict[str, float]:
    """Shuffle the step's rollouts (seeded by seed and step) and run the trainer on them."""
    order = np.random.default_rng([config.seed, state.step, 7]).permutation(len(results))
    shuffled = [results[i] for i in order]
    step = step_config(config)
    metrics = [
        train_step(policy, optimizer, part, None, step, weight_version=state.weight_version,
                   ref_policy=ref_policy)
        for part in split_groups(shuffled, step.group_by, config.optim.updates_per_step)
    ]
    return mean_metrics(metrics)

"""One RL step's training on a batch of rollouts: tree, pack, proximal pass, PPO epochs x mini-batches.

    metrics = train_step(policy, optimizer, rollouts, groups=None, config=StepConfig(), rng=None)

1. **Filter** rollouts: status not in ``config.keep_statuses``, stale (oldest call more than
   ``max_staleness`` weight versions behind ``weight_version``), or without calls. After step 3,
   rollouts with more kept leaves than ``max_kept_leaves`` or a kept path longer than
   ``max_tokens`` are not trained either (they still count in their GRPO group's baseline), nor,
   with ``filter_groups``, the rollouts of a GRPO group whose rewards are all equal.
2. **Advantages** (GRPO): one per rollout, over its group (``groups`` or ``config.group_by``).
3. **Tree + leaf filter** (`build_tree`: dead retries, excluded calls — every call whose kind from
   `clawfast.threads.reconstruct` is not main —, ``max_kept_leaves``), split
   into ``config.updates_per_step`` **mini-batches** of whole groups (round-robin over groups in
   batch order), each **packed** into micro-batches of at most ``config.max_tokens`` rows (shared
   prefixes once). Steps 1-3 are `prepare_step`, once per RL step.
4. **Fixed before any update** (`fix_step`, one no-grad pass over every micro-batch): PPO's old
   values and tree GAE (`algorithms.ppo_advantages`); the *proximal* log-probs (the policy at the
   start of the step) of every target, the reference policy's, and from them the IS weights and the
   step's IS / mismatch metrics. The proximal pass is skipped when the step makes one update at
   token-level IS: the proximal policy is then the current one at that update's forward, so its
   log-probs are that forward's, detached (today's on-policy loss, bit for bit).
5. **Updates**: ``ppo_epochs`` passes over the mini-batches (order shuffled per epoch by ``rng``;
   none: in order). Per mini-batch, for each of its micro-batches: forward under the tree mask,
   fused target log-probs (`clawfast.kernels.tree_logprobs`), `clawfast.kernels.policy_loss` plus
   the PPO value loss (clipped around the step's old values), ``backward``; then gradient clipping,
   ``optimizer.step()``, gradients zeroed.

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

**Metrics.** Per-update metrics (loss parts, entropy, kl_ref, clip_frac / ratio_mean /
approx_kl_old against the proximal policy, grad_norm) are averaged over the step's updates, times
summed; the IS / mismatch metrics (proximal vs behaviour, `_mismatch_metrics`) are the step's, under
today's names and verl's ``rollout_corr/...`` names (`VERL_NAMES`; docs/DESIGN.md section 6).

**Data parallel.** When ``torch.distributed`` is initialised, rank r takes micro-batches
r, r + W, ... (of the step in the proximal pass, of the mini-batch in an update); every rank runs
the same number of forward/backward calls (a rank short of batches repeats one with zero loss
weight, so FSDP's collectives stay matched), the loss is multiplied by W because FSDP/DDP average
gradients over ranks, the fixed pass's results are summed over ranks (each rank fills its own
targets), and metrics are summed over ranks. Every rank must receive the same rollouts and ``rng``
state (packing and the epoch order are deterministic).

Not supported: mini-batches re-drawn per epoch (the partition into mini-batches is fixed for the
step, only their order changes), sequence-level IS with ``is_mode="off"`` (refused by the config).
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

from clawfast.kernels import ISConfig, TreePaths, importance_weights, policy_loss
from clawfast.kernels.policy_loss import LOSS_METRIC_NAMES
from clawfast.pack import PackedBatch, pack, pack_stats
from clawfast.records import RolloutResult
from clawfast.train.algorithms import (
    KeptForest,
    forest_paths,
    group_ids,
    grpo_rollout_advantages,
    ppo_advantages,
    stale_rollouts,
    value_loss_terms,
)
from clawfast.train.checkpoint import TrainState
from clawfast.train.config import AlgorithmConfig, RunConfig
from clawfast.train.policy import Policy
from clawfast.threads import fidelity_counts, reconstruct, with_kinds
from clawfast.tree import PrefixTree, build_tree

class StepConfig(AlgorithmConfig):
    """Everything `train_step` needs besides the policy, optimizer and rollouts: the run's
    ``[algorithm]`` section (`clawfast.train.config.AlgorithmConfig`, where each field is described;
    `name` is "grpo" or "ppo", which needs a policy with a value head) with `group_by` resolved to
    "task" or "task_harness", plus five fields of ``[optim]`` (`clawfast.train.config.OptimConfig`):
    max_tokens (rows per micro-batch), max_grad_norm (clip the global gradient norm; None: no
    clipping, the norm is still reported), updates_per_step (mini-batches per epoch), ppo_epochs
    and warmup_updates (`warm_up`).
    Validated on construction like every config section (a `ValueError` naming the field)."""

    group_by: Literal["task", "task_harness"] = "task"
    max_tokens: int = Field(8192, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    updates_per_step: int = Field(1, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    warmup_updates: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _is_config(self) -> "StepConfig":
        self.is_config()  # fail here, at construction, not mid-step
        return self

    def is_config(self) -> ISConfig:
        # "off" still measures the mismatch (metrics with the truncation thresholds); no weight is applied
        mode = "truncate" if self.is_mode == "off" else self.is_mode
        return ISConfig(level=self.is_level, mode=mode, cap=self.is_cap, lo=self.is_lo, hi=self.is_hi)

    def needs_proximal(self, num_minibatches: int) -> bool:
        """Whether the proximal log-probs need their own no-grad pass: not for one update at token
        level, where they are the update's own forward, detached."""
        return self.ppo_epochs * num_minibatches > 1 or self.is_level == "sequence"


def step_config(config: RunConfig) -> StepConfig:
    """The trainer's `StepConfig` of a run: its algorithm section, group_by resolved, and the optimizer's
    micro-batch size, gradient clip, mini-batches and epochs."""
    optim = config.optim
    return StepConfig(**{**config.algorithm.model_dump(), "group_by": config.group_by},
                      max_tokens=optim.max_tokens, max_grad_norm=optim.max_grad_norm,
                      updates_per_step=optim.updates_per_step, ppo_epochs=optim.ppo_epochs,
                      warmup_updates=optim.warmup_updates)


@dataclass(eq=False)
class StepData:
    """A step's rollouts turned into packed micro-batches and per-target loss inputs (CPU, numpy).

    rollouts: the trained rollouts (after the filters), aligned with ``trees`` and ``rewards``.
    batches: the micro-batches of every mini-batch. weights[b]: per-target loss weight
    ``loss_mask * weight`` (divided by its rollout's total for "seq-mean-token-mean"). denominator:
    the step's total D (module docstring), the sum of the mini-batches' ``denominators``.
    advantages[b]: per-target GRPO advantages (None for PPO: computed in the step). forest /
    forest_rows[b]: the unmerged kept trees and each target's row there (PPO and sequence-level IS;
    else None). counts: filter counts and the main-thread fidelity of the kept rollouts
    (`clawfast.threads.fidelity_counts`). minibatches[k]: the indices into ``batches`` of mini-batch k
    (whole groups); empty means one mini-batch of every micro-batch (``denominators = [denominator]``).
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
    counts: dict[str, float] = field(default_factory=dict)
    minibatches: list[np.ndarray] = field(default_factory=list)
    denominators: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.minibatches:
            self.minibatches = [np.arange(len(self.batches))]
            self.denominators = [self.denominator]
        if len(self.denominators) != len(self.minibatches):
            raise ValueError(f"{len(self.denominators)} denominators for {len(self.minibatches)} mini-batches")

    @property
    def offsets(self) -> np.ndarray:
        """int64[B + 1]: where each micro-batch's targets start in the step's concatenated targets."""
        return np.concatenate([[0], np.cumsum([len(b.target_rows) for b in self.batches], dtype=np.int64)])


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
    ids = group_ids(kept, config.group_by, None if groups is None else [groups[i] for i in keep])
    if config.name == "grpo":
        rollout_adv = grpo_rollout_advantages(rewards, ids, normalize_std=config.normalize_std)
    # A group whose rewards are all equal has advantage 0 everywhere: it adds no policy gradient,
    # only targets to the token-mean's denominator, and an update made of such groups alone would
    # still move every weight by Adam's momentum.
    uniform = uniform_groups(rewards, ids) if config.filter_groups else np.zeros(len(kept), dtype=bool)
    # Side calls are excluded by what the rollout's structure says they are, not by the proxy's hints.
    threads = [reconstruct(r.calls) for r in kept]
    trees = [build_tree(with_kinds(r.calls, t), max_kept_leaves=config.max_kept_leaves, drop_dead=config.drop_dead)
             for r, t in zip(kept, threads)]
    # A kept path longer than a micro-batch cannot be trained (pack would raise): drop its rollout
    # and count it, rather than lose the whole step to one overlong session.
    branching = np.array([t.dropped for t in trees], dtype=bool)
    too_long = np.array([not t.dropped and max((lf.depth for lf in t.leaves if lf.status == "kept"), default=0)
                         > config.max_tokens for t in trees], dtype=bool)
    uniform &= ~(branching | too_long)
    trees = [dataclasses.replace(t, dropped=True) if drop else t for t, drop in zip(trees, too_long | uniform)]
    parts = split_groups(ids, config.updates_per_step, np.flatnonzero(~uniform))
    batches: list[PackedBatch] = []
    minibatches = []
    for part in parts:
        # Pack each mini-batch on its own (micro-batches never mix mini-batches); the other trees
        # are passed as dropped so that target_rollout keeps indexing `trees`.
        mine = np.zeros(len(trees), dtype=bool)
        mine[part] = True
        view = [t if m else dataclasses.replace(t, dropped=True) for t, m in zip(trees, mine)]
        packed = pack(view, config.max_tokens, rewards=rewards.astype(np.float32)) if trees else []
        minibatches.append(np.arange(len(batches), len(batches) + len(packed)))
        batches += packed

    weights = [b.loss_mask.astype(np.float64) * b.weight for b in batches]
    per_rollout = np.zeros(len(kept), dtype=np.float64)
    for b, w in zip(batches, weights):
        np.add.at(per_rollout, b.target_rollout, w)
    if config.aggregation == "token-mean":
        denominators = [float(per_rollout[part].sum()) for part in parts]
    else:
        denominators = [float((per_rollout[part] > 0).sum()) for part in parts]
        if config.aggregation == "seq-mean-token-mean":
            weights = [w / per_rollout[b.target_rollout] for b, w in zip(batches, weights)]
    denominator = float(sum(denominators))
    advantages = forest = forest_rows = None
    if config.name == "grpo":
        advantages = [rollout_adv[b.target_rollout] for b in batches]
    if config.name == "ppo" or config.is_level == "sequence":
        forest = KeptForest.build(trees)
        forest_rows = [forest.locate(b) for b in batches]
    counts = {
        "rollouts_in": len(rollouts),
        "rollouts_trained": int(sum(not t.dropped for t in trees)),
        "dropped_status": int(bad_status.sum()),
        "dropped_stale": int(stale.sum()),
        "dropped_no_calls": int(empty.sum()),
        "dropped_branching": int(branching.sum()),
        "dropped_too_long": int(too_long.sum()),
        "dropped_uniform_group": int(uniform.sum()),
        **fidelity_counts(threads),
    }
    return StepData(kept, trees, rewards, batches, weights, denominator, advantages, forest, forest_rows, counts,
                    minibatches, denominators)


def split_groups(ids: np.ndarray, n: int, members: np.ndarray | None = None) -> list[np.ndarray]:
    """The mini-batches of a step: indices of each of min(n, #groups) parts (at least one) of the
    rollouts whose group ids (`group_ids`) are `ids`, counting only the rollouts in `members`
    (indices; None: all): the k-th group among them (in first-appearance order) goes to part
    k mod parts, so a group never straddles two parts."""
    members = np.arange(len(ids)) if members is None else np.asarray(members, dtype=np.int64)
    present = np.unique(ids[members])  # sorted: first-appearance order of the groups
    num = max(1, min(n, len(present)))
    which = np.searchsorted(present, ids[members]) % num
    return [members[which == k] for k in range(num)]


def uniform_groups(rewards: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """bool[R]: the rollout's GRPO group has one reward value for all its rollouts."""
    lo = np.full(int(ids.max()) + 1 if ids.size else 0, np.inf)
    hi = np.full_like(lo, -np.inf)
    np.minimum.at(lo, ids, rewards)
    np.maximum.at(hi, ids, rewards)
    return (lo == hi)[ids]


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


def _check_models(policy: Policy, config: StepConfig, ref_policy: Policy | None) -> None:
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
    """Step 4 of the module docstring: one no-grad pass over every micro-batch of the step (rank r
    its share under torch.distributed; the results are summed over ranks), when PPO's old values or
    the proximal log-probs are needed; then GAE, IS weights and the step's mismatch metrics."""
    _check_models(policy, config, ref_policy)
    t0 = time.perf_counter()
    device = policy.device
    ppo = config.name == "ppo"
    proximal = config.needs_proximal(len(data.minibatches))
    if data.denominator <= 0 or not (ppo or proximal):  # nothing trainable, or nothing to fix
        return FixedTargets(None, None, None, None, None, None, {"time_values_s": 0.0})
    rank, world = _world()
    offsets = data.offsets
    with_ref = proximal and ref_policy is not None
    # one vector [proximal | ref | values], so that one collective sums the ranks' shares
    n_lp = int(offsets[-1]) if proximal else 0
    n_ref = n_lp if with_ref else 0
    flat = torch.zeros(n_lp + n_ref + (data.forest.num_rows if ppo else 0), dtype=torch.float64, device=device)
    with torch.no_grad():
        for b, real in _schedule(len(data.batches), rank, world):
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
    flat = _allreduce(flat)
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
        w, is_metrics = _mismatch(lp, infer, a, seq, config, paths)
        metrics.update(is_metrics)
        is_w = None if config.is_mode == "off" else w
    metrics["time_values_s"] = time.perf_counter() - t0
    return FixedTargets(lp if proximal else None, is_w, ref if with_ref else None, values if ppo else None,
                        adv, ret, metrics)


def accumulate_gradients(policy: Policy, data: StepData, config: StepConfig, *,
                         ref_policy: Policy | None = None, fixed: FixedTargets | None = None,
                         minibatch: int = 0) -> dict[str, float]:
    """Step 5 without the optimizer: forward and backward over every micro-batch of mini-batch
    ``minibatch``; gradients accumulate in ``.grad``.

    ``fixed``: the step's `fix_step`, computed before its first update (None: computed here, which
    is right only for a step of one update). Returns the loss, the loss metrics (summed over ranks
    under torch.distributed) and the step's fixed metrics (IS / mismatch, PPO advantage and value means).
    """
    _check_models(policy, config, ref_policy)
    if fixed is None:
        if config.ppo_epochs * len(data.minibatches) > 1:
            raise ValueError("a step of several updates needs fix_step(...) before its first update "
                             "(train_step does it); pass it as fixed=")
        fixed = fix_step(policy, data, config, ref_policy=ref_policy)
    rank, world = _world()
    device = policy.device
    mb = data.minibatches[minibatch]
    denominator = data.denominators[minibatch]
    if denominator <= 0:  # nothing trainable: no forward, no gradient
        return {"loss": 0.0, "num_targets": 0.0}
    schedule = [(int(mb[k]), real) for k, real in _schedule(len(mb), rank, world)]
    offsets = data.offsets
    metrics: dict[str, float] = {}
    t1 = time.perf_counter()
    sums = torch.zeros(3 + len(LOSS_METRIC_NAMES), dtype=torch.float64)  # loss, pg part, value part, metrics
    collected = []  # (logprobs, infer, weights, rollout) of real targets, for the IS metrics of a one-update step
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
            pg_f, v_f = float(pg_part.detach()), float(v_part.detach())
            sums += torch.tensor([pg_f + v_f, pg_f, v_f]
                                 + [m[k] * w for k in LOSS_METRIC_NAMES], dtype=torch.float64)
            if fixed.proximal is None:
                collected.append((out.logprobs.detach().cpu(), infer.cpu(), a.cpu(),
                                  torch.as_tensor(batch.target_rollout)))
    metrics["time_fwd_bwd_s"] = time.perf_counter() - t1
    sums = _allreduce(sums.to(device)).cpu()
    total_w = sum(float(data.weights[b].sum()) for b in mb)
    metrics["loss"], metrics["pg_loss"], metrics["value_loss"] = sums[0].item(), sums[1].item(), sums[2].item()
    for i, k in enumerate(LOSS_METRIC_NAMES):
        if k != "pg_loss":
            metrics[k] = sums[3 + i].item() / total_w
    if fixed.proximal is None:
        metrics.update(_is_metrics(collected, config, world))
    metrics.update(fixed.metrics)
    return metrics


def _is_metrics(collected, config: StepConfig, world: int) -> dict[str, float]:
    """Mismatch/IS metrics over every target of a one-update step (gathered from all ranks)."""
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, collected)
        collected = [item for part in gathered for item in part]
    if not collected:
        return {}
    lp, infer, a, seq = (torch.cat(parts) for parts in zip(*collected))
    return _mismatch(lp, infer, a, seq, config)[1]


def _mismatch(lp: torch.Tensor, infer: torch.Tensor, a: torch.Tensor, seq: torch.Tensor, config: StepConfig,
              paths: TreePaths | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights (trainer ``lp`` vs sampler ``infer``, weights ``a``, at ``config.is_level``; paths
    for "sequence") and the metrics: `importance_weights`'s, the log-perplexity ones (sequences:
    the rollouts ``seq``) and all of them again under verl's names."""
    res = importance_weights(lp, infer, a, config=config.is_config(), paths=paths)
    metrics = {**res.metrics, **_log_ppl(lp, infer, a, seq)}
    metrics.update(verl_names(metrics, config, res.weights, a))
    return res.weights, metrics


def _log_ppl(lp: torch.Tensor, infer: torch.Tensor, a: torch.Tensor, seq: torch.Tensor) -> dict[str, float]:
    """Per rollout with weight, the weighted mean NLL of its targets under the trainer
    (``mismatch_log_ppl_train``) and the sampler (``mismatch_log_ppl_infer``), each averaged over
    rollouts, and the per-rollout difference train - infer (its mean ``mismatch_log_ppl_diff`` and
    mean absolute value ``mismatch_log_ppl_abs_diff``): verl's sequence-level perplexity diagnostics."""
    a = a.double()
    valid = a > 0
    n = int(seq.max()) + 1 if seq.numel() else 0
    seq = seq.long()

    def per_seq(x):
        return torch.zeros(n, dtype=torch.float64, device=a.device).index_add_(0, seq, x)

    total = per_seq(torch.where(valid, a, 0.0))
    live = total > 0
    if not bool(live.any()):
        return dict.fromkeys(LOG_PPL_NAMES, 0.0)
    nll_train = -per_seq(torch.where(valid, a * lp.double(), 0.0))[live] / total[live]
    nll_infer = -per_seq(torch.where(valid, a * infer.double(), 0.0))[live] / total[live]
    diff = nll_train - nll_infer
    vec = torch.stack([nll_train.mean(), nll_infer.mean(), diff.mean(), diff.abs().mean()])
    return dict(zip(LOG_PPL_NAMES, vec.tolist()))


LOG_PPL_NAMES = ("mismatch_log_ppl_train", "mismatch_log_ppl_infer", "mismatch_log_ppl_diff",
                 "mismatch_log_ppl_abs_diff")
# verl's names (verl/trainer/ppo/rollout_corr_helper.py, "rollout_corr/" metrics) for the same
# quantities, over the same items (targets, or sequences at is_level "sequence"); docs/DESIGN.md
# section 6 lists them. Not aliased: std and ESS, which verl takes of weights clamped to the thresholds.
VERL_MISMATCH_NAMES = {
    "mismatch_k1": "rollout_corr/kl",
    "mismatch_k3": "rollout_corr/k3_kl",
    "mismatch_log_ppl_train": "rollout_corr/training_log_ppl",
    "mismatch_log_ppl_infer": "rollout_corr/rollout_log_ppl",
    "mismatch_log_ppl_diff": "rollout_corr/log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
}
# verl's IS statistics (`compute_is_metrics`): the high / low fractions are of rho before truncation
# or masking; mean is of the applied weights (token-weighted); max and min of the applied weights at
# token level, of rho at sequence level.
VERL_RATIO_NAMES = {"is_frac_above": "rollout_corr/rollout_is_ratio_fraction_high",
                    "is_frac_below": "rollout_corr/rollout_is_ratio_fraction_low"}


def verl_names(metrics: dict[str, float], config: StepConfig, weights: torch.Tensor,
               a: torch.Tensor) -> dict[str, float]:
    """``metrics`` (of `_mismatch`, with its applied IS ``weights`` and target weights ``a``) under
    verl's names: truncated IS is verl's TIS and masked IS its IcePop (``rollout_is_*``), the masked
    share also its rejection-sampling ``rollout_rs_*masked_fraction``; "off" only the mismatch
    diagnostics; ``is_chi2`` is verl's ``chi2_token`` or ``chi2_seq`` by level. Checked against
    verl's own code by ``bench/peers/importance.py``."""
    token = config.is_level == "token"
    out = {verl: metrics[ours] for ours, verl in VERL_MISMATCH_NAMES.items()}
    out["rollout_corr/chi2_token" if token else "rollout_corr/chi2_seq"] = metrics["is_chi2"]
    if config.is_mode == "off":
        return out
    out.update({verl: metrics[ours] for ours, verl in VERL_RATIO_NAMES.items()})
    valid = a > 0
    applied, count = weights.double()[valid], a.double()[valid]
    out["rollout_corr/rollout_is_mean"] = float((applied * count).sum() / count.sum()) if applied.numel() else 0.0
    if token:
        out["rollout_corr/rollout_is_max"] = float(applied.max()) if applied.numel() else 0.0
        out["rollout_corr/rollout_is_min"] = float(applied.min()) if applied.numel() else 0.0
    else:
        out["rollout_corr/rollout_is_max"] = metrics["is_ratio_max"]
        out["rollout_corr/rollout_is_min"] = metrics["is_ratio_min"]
    if config.is_mode == "mask":  # rejected: outside [is_lo, is_hi], i.e. above or below
        name = "rollout_rs_masked_fraction" if token else "rollout_rs_seq_masked_fraction"
        out["rollout_corr/" + name] = metrics["is_frac_above"] + metrics["is_frac_below"]
    return out


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
               weight_version: int | None = None, ref_policy: Policy | None = None,
               rng: np.random.Generator | None = None) -> dict[str, float]:
    """One RL step's training on ``rollouts`` (see the module docstring): ``config.ppo_epochs`` x
    ``config.updates_per_step`` optimizer updates on the same prepared data and proximal
    log-probs; returns the metrics.

    ``groups``: one hashable GRPO group key per rollout (None: ``config.group_by``); mini-batches
    hold whole groups. ``weight_version``: the policy's current version, for the staleness filter.
    ``ref_policy``: the frozen reference for the KL term (needed when ``config.kl_coef > 0``).
    ``rng``: shuffles the mini-batch order of each epoch (None: in order).
    Metrics: averaged over the updates: loss, pg_loss, value_loss, entropy, kl_ref, clip_frac,
    dual_clip_frac, ratio_mean, approx_kl_old (the last four against the proximal policy),
    grad_norm; summed: time_fwd_bwd_s, time_optimizer_s; the step's: the is_* / mismatch_* metrics
    and their ``rollout_corr/...`` names, advantage_mean / value_mean (PPO), num_updates (optimizer
    steps taken), stepped (1 if any), token counts (flat per call, flat per leaf, packed, dedup
    ratios), filter counts, main-thread fidelity (main_continuity, main_pairs, main_drift_tokens,
    main_divergences, side_calls) and the other timings (seconds). With nothing trainable the optimizer is
    not stepped (``stepped`` = 0).
    """
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


def updates_done(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer updates made so far, from the optimizer's own per-parameter step counts (saved
    with its state, so a resumed run counts on)."""
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def warm_up(optimizer: torch.optim.Optimizer, warmup_updates: int) -> float:
    """Within the ramp, set each parameter group's lr for the next update to its base lr (kept under
    ``initial_lr``, the key torch's schedulers use) times ``min(1, (updates done + 1) /
    warmup_updates)``; past it (or with no ramp) leave the lr alone, so that a scheduler the caller
    drives keeps control. Returns the first group's lr."""
    done = updates_done(optimizer) if warmup_updates > 0 else None
    if done is not None and done <= warmup_updates:
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * min(1.0, (done + 1) / warmup_updates)
    return float(optimizer.param_groups[0]["lr"])


def _combine(updates: list[dict[str, float]]) -> dict[str, float]:
    """Per-update metrics of a step: times summed, the rest averaged (one update: as it is)."""
    if len(updates) == 1:
        return dict(updates[0])
    keys = sorted({k for m in updates for k in m})
    vals = {k: [m[k] for m in updates if k in m] for k in keys}
    return {k: float(np.sum(v) if k.startswith("time_") else np.mean(v)) for k, v in vals.items()}


def train_on_rollouts(policy, optimizer, results: list[RolloutResult], config: RunConfig, state: TrainState,
                      ref_policy=None) -> dict[str, float]:
    """Shuffle the step's rollouts (seeded by seed and step) and run `train_step` on them, its
    mini-batch order seeded by seed and step too."""
    order = np.random.default_rng([config.seed, state.step, 7]).permutation(len(results))
    shuffled = [results[i] for i in order]
    return train_step(policy, optimizer, shuffled, None, step_config(config), weight_version=state.weight_version,
                      ref_policy=ref_policy, rng=np.random.default_rng([config.seed, state.step, 8]))

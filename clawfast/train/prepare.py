"""Steps 1-3 of an RL step (`clawfast.train.step`): filter the rollouts, GRPO advantages, prefix trees
and the leaf filter, mini-batches of whole groups, each packed into micro-batches (`prepare_step`);
no model involved, CPU and numpy only. Deterministic: every data-parallel rank given the same
rollouts prepares the same micro-batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from clawfast.pack import PackedBatch, pack, pack_stats
from clawfast.records import RolloutResult
from clawfast.threads import KINDS, RolloutThreads, fidelity_counts, reconstruct, with_kinds
from clawfast.train.algorithms import KeptForest, group_ids, grpo_rollout_advantages, stale_rollouts
from clawfast.train.routing_rows import RoutingKeys, keyed_rollouts
from clawfast.train.step_config import StepConfig
from clawfast.tree import PrefixTree, build_tree


@dataclass(eq=False)
class StepData:
    """A step's rollouts turned into packed micro-batches and per-target loss inputs (CPU, numpy).

    rollouts: the trained rollouts (after the filters), aligned with ``trees`` and ``rewards``.
    batches: the micro-batches of every mini-batch. weights[b]: per-target loss weight
    ``loss_mask * weight`` (divided by its rollout's total for "seq-mean-token-mean"). denominator:
    the step's total D (`clawfast.train.step`, "Normaliser"), the sum of the mini-batches' ``denominators``.
    advantages[b]: per-target GRPO advantages (None for PPO: computed in the step). forest /
    forest_rows[b]: the unmerged kept trees and each target's row there (PPO and sequence-level IS;
    else None). counts: filter counts and the main-thread fidelity of the kept rollouts
    (`clawfast.threads.fidelity_counts`), and per thread kind (`thread_counts`). target_kind[b]: each
    target's thread kind (an index into `clawfast.threads.KINDS`). threads: each kept rollout's
    `clawfast.threads.RolloutThreads`. minibatches[k]: the indices into ``batches`` of mini-batch k
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
    target_kind: list[np.ndarray] = field(default_factory=list)
    threads: list[RolloutThreads] = field(default_factory=list)
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
    """Steps 1-3 of `clawfast.train.step`'s docstring (no model involved)."""
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
    # Calls are trained or excluded by what the rollout's structure says they are, not by the proxy's
    # hints: the kinds of `train_threads` are trained, every other kind is excluded.
    threads = [reconstruct(r.calls) for r in kept]
    excluded = frozenset(KINDS) - frozenset(config.train_threads)
    # Under routing replay the tree and the packer merge rows by (token, recorded routing) keys,
    # turned back into token ids once packed (`unkey_step`).
    keys = None
    tree_rollouts = kept
    if config.routing_replay != "off":
        tree_rollouts, keys = keyed_rollouts(kept, config.routing_replay)
    trees = [build_tree(with_kinds(r.calls, t), max_kept_leaves=config.max_kept_leaves, drop_dead=config.drop_dead,
                        exclude_tags=excluded) for r, t in zip(tree_rollouts, threads)]
    # A kept path longer than a micro-batch cannot be trained (pack would raise): drop its rollout
    # and count it, rather than lose the whole step to one overlong session.
    branching = np.array([t.dropped for t in trees], dtype=bool)
    too_long = np.array([not t.dropped and t.longest_kept_path > config.micro_batch_tokens for t in trees], dtype=bool)
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
        packed = pack(view, config.micro_batch_tokens, rewards=rewards.astype(np.float32)) if trees else []
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
        forest = KeptForest.build(trees, [trained_links(r, t, config.train_threads) for r, t in zip(kept, threads)])
        forest_rows = [forest.locate(b) for b in batches]
    replay = {}
    if keys is not None:
        trees, forest, replay = unkey_step(keys, trees, batches, forest)
    kind_tables = [kind_table(t) for t in threads]
    target_kind = [target_kinds(b, kind_tables) for b in batches]
    counts = {
        "rollouts_in": len(rollouts),
        "rollouts_trained": int(sum(not t.dropped for t in trees)),
        "dropped_status": int(bad_status.sum()),
        "dropped_stale": int(stale.sum()),
        "dropped_no_calls": int(empty.sum()),
        "dropped_branching": int(branching.sum()),
        "dropped_too_long": int(too_long.sum()),
        "dropped_uniform_group": int(uniform.sum()),
        **replay,
        **fidelity_counts(threads),
        **thread_counts([t for t, tree in zip(threads, trees) if not tree.dropped], target_kind,
                        config.train_threads, forest),
    }
    return StepData(kept, trees, rewards, batches, weights, denominator, advantages, forest, forest_rows, counts,
                    target_kind, threads, minibatches, denominators)


def unkey_step(keys: RoutingKeys, trees: list[PrefixTree], batches: Sequence[PackedBatch],
               forest: KeptForest | None) -> tuple[list[PrefixTree], KeptForest | None, dict[str, float]]:
    """A step packed on routing keys back to token ids (trees, batches, the PPO forest), each
    batch with its rows' recorded routing (``routing`` / ``routing_rows``); and the counts
    ``routing/rows_replayed`` and ``routing/rows_own`` (rows the trainer routes: none recorded)."""
    replayed = rows = 0
    for b in batches:
        keys.unkey(b)
        replayed += int(b.routing_rows.sum()) if b.routing_rows is not None else 0
        rows += len(b.input_ids)
    trees = [dataclasses.replace(t, tokens=keys.tokens(t.tokens)) for t in trees]
    if forest is not None:
        forest = dataclasses.replace(forest, tokens=keys.tokens(forest.tokens))
    return trees, forest, {"routing/rows_replayed": replayed, "routing/rows_own": rows - replayed}


def trained_links(rollout: RolloutResult, threads: RolloutThreads, train_threads) -> list[tuple[int, int, int]]:
    """The links of a rollout that PPO's GAE follows (those of trained side kinds), as
    (source call, target call, the target's prompt length) for `KeptForest.build`."""
    prompt_len = {int(c.call_index): len(c.prompt_ids) for c in rollout.calls}
    return [(lk.source, lk.target, prompt_len[lk.target]) for lk in threads.links if lk.thread_kind in train_threads]


def kind_table(threads: RolloutThreads) -> np.ndarray:
    """int8[max call index + 1]: each call's thread kind, as an index into `KINDS`."""
    table = np.zeros(max(c.call_index for c in threads.calls) + 1, np.int8)
    for c in threads.calls:
        table[c.call_index] = KINDS.index(c.kind)
    return table


def target_kinds(batch: PackedBatch, kind_tables: Sequence[np.ndarray]) -> np.ndarray:
    """int8[M]: the thread kind of the call that owns each target (`kind_table` per rollout)."""
    out = np.zeros(len(batch.target_call), np.int8)
    for g in np.unique(batch.target_rollout):
        at = batch.target_rollout == g
        out[at] = kind_tables[g][batch.target_call[at]]
    return out


def thread_counts(threads: Sequence[RolloutThreads], target_kind: Sequence[np.ndarray], train_threads,
                  forest: KeptForest | None) -> dict[str, float]:
    """Per thread kind found in the trained rollouts: ``threads/<kind>/calls``, and either
    ``threads/<kind>/targets`` (trained: packed targets owned by its calls) or
    ``threads/<kind>/calls_excluded`` (a kind `train_threads` leaves out, named so that nothing is
    dropped unseen); PPO: ``threads/links`` placed and ``threads/links_unused``."""
    calls = {k: 0 for k in KINDS}
    for t in threads:
        for c in t.calls:
            calls[c.kind] += 1
    targets = np.bincount(np.concatenate(target_kind) if target_kind else np.zeros(0, np.int8), minlength=len(KINDS))
    out: dict[str, float] = {}
    for i, k in enumerate(KINDS):
        if calls[k]:
            out[f"threads/{k}/calls"] = calls[k]
            if k in train_threads:
                out[f"threads/{k}/targets"] = int(targets[i])
            else:
                out[f"threads/{k}/calls_excluded"] = calls[k]
    if forest is not None:
        out["threads/links"] = int(forest.link_source.shape[0])
        out["threads/links_unused"] = forest.links_unused
    return out


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


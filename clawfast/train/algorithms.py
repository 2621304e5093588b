"""RL algorithms on packed prefix trees: GRPO and PPO advantages, value loss, rollout filters.

The loss itself (clipped surrogate x truncated/masked IS, k3 KL to a reference, entropy bonus) is
`clawfast.kernels.policy_loss`; this module supplies what it needs per target:

- **GRPO** (`grpo_rollout_advantages`): one advantage per rollout, ``(r - mean) / (std + eps)``
  over the rollouts of its group (group key: task, or task x harness for mixed-harness training;
  `group_ids`). Every trainable target of a rollout carries that rollout's advantage; in a packed
  batch each unique trainable token is one target per rollout, so shared tokens count once.
- **PPO** (`KeptForest`, `ppo_advantages`, `value_loss_terms`): GAE over each rollout's own kept
  tree (unmerged: a token of the shared system prompt belongs to every rollout's tree separately),
  in either kernel mode of `clawfast.kernels.tree_gae`: ``"path"`` (each token gets the mean over
  the kept root-to-leaf paths through it of plain per-path GAE) or ``"tree"`` (a branch point
  bootstraps from the plain mean of its children). The value of a token is the value head read at
  its *predicting* row (the state before the token), as in verl. The rollout's reward is placed on
  the last trainable token of every kept leaf's path (context tokens carry values and advantages
  across, verl's multi-turn convention). With side threads trained (`train_threads`), GAE follows the
  links between threads (`clawfast.threads.Link`): the last trainable token of a linked thread's
  leaf takes no reward of its own but bootstraps from the token its link leads to (the first token
  its target call sampled): ``delta = gamma * V(next) - V``, and its advantage goes on with
  ``gamma * lam * A(next)``, so credit reaches a subagent through the call its answer returns in
  and a summary through the thread restarted from it.
- **Sequences** (`forest_paths`): the kept root-to-leaf paths of every rollout over the unsplit
  kept forest, for sequence-level IS (a path may span several micro-batches).
- **Rollout filters**: `stale_rollouts` (weight-version lag of the oldest token, `version_lags`, above a
  limit; `token_lags` per token).

Guaranteed: `KeptForest.locate` maps every packed target to its token in its rollout's tree and
checks the token id (a mismatch is an error, never a silent misalignment). Not guaranteed: GAE
that is exact when a leaf path's last token is context but an earlier generated token on it is
followed by more generated tokens on another kept path (the reward sits on that token's row, so
it is seen by every path through the row; in captured harness traffic a kept leaf ends with its
call's own output, so this does not arise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from clawfast.kernels import TreePaths, grpo_advantages, tree_gae

GROUP_BY = ("task", "task_harness")


# ------------------------------------------------------------------------------------ GRPO


def group_ids(rollouts: Sequence, group_by: str = "task", groups: Sequence[Hashable] | None = None) -> np.ndarray:
    """int64[R] group index of each rollout: equal keys, equal index (first-appearance order).

    ``groups`` (one hashable per rollout) overrides ``group_by``; otherwise the key is the
    rollout's ``task_id`` (``"task"``) or ``(task_id, harness)`` (``"task_harness"``).
    """
    if groups is not None:
        keys = list(groups)
        if len(keys) != len(rollouts):
            raise ValueError(f"{len(keys)} group keys for {len(rollouts)} rollouts")
    elif group_by == "task":
        keys = [r.task_id for r in rollouts]
    elif group_by == "task_harness":
        keys = [(r.task_id, r.harness) for r in rollouts]
    else:
        raise ValueError(f"group_by must be one of {GROUP_BY}, got {group_by!r}")
    index: dict[Hashable, int] = {}
    return np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)


def grpo_rollout_advantages(rewards: Sequence[float], ids: np.ndarray, *, normalize_std: bool = True,
                            eps: float = 1e-6) -> np.ndarray:
    """float64[R]: group-relative advantage of each rollout (a group of one gets 0)."""
    adv = grpo_advantages(torch.as_tensor(np.asarray(rewards, dtype=np.float64)),
                          torch.as_tensor(np.asarray(ids, dtype=np.int64)),
                          normalize_std=normalize_std, eps=eps)
    return adv.numpy()


# ---------------------------------------------------------------------------------- filters


def version_lags(rollouts: Sequence, weight_version: int) -> np.ndarray:
    """int64[R]: how many weight versions before ``weight_version`` each rollout's oldest token was
    sampled (0 for a rollout without calls). A call's `weight_version` is its oldest token's: a call
    that went on decoding across a push is as old as its first piece."""
    oldest = [min((int(c.weight_version) for c in r.calls), default=weight_version) for r in rollouts]
    return np.array([weight_version - v for v in oldest], dtype=np.int64)


def token_lags(rollouts: Sequence, weight_version: int) -> np.ndarray:
    """int64[T]: how many weight versions before ``weight_version`` each output token of `rollouts`
    was sampled, every call's tokens in order."""
    versions = [c.token_versions for r in rollouts for c in r.calls]
    return weight_version - np.concatenate(versions) if versions else np.zeros(0, dtype=np.int64)


def stale_rollouts(rollouts: Sequence, weight_version: int | None, max_lag: int | None) -> np.ndarray:
    """bool[R]: True for a rollout with a token sampled more than ``max_lag`` weight versions before
    ``weight_version`` (no filter when either is None)."""
    if weight_version is None or max_lag is None:
        return np.zeros(len(rollouts), dtype=bool)
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    return version_lags(rollouts, weight_version) > max_lag


# -------------------------------------------------------------------------------------- PPO


@dataclass(eq=False)
class KeptForest:
    """The kept sets of a step's trees, unmerged: one row per (rollout, kept token).

    Rows of each tree are in its DFS order (``parent[i] < i``), trees concatenated in argument
    order (dropped trees contribute nothing). ``trainable``: the token is trainable (docs/TREE.md),
    so it has exactly one packed target. ``reward_row``: the row holds its rollout's reward.
    """

    parent: np.ndarray      # int64[R], -1 at a root
    rollout: np.ndarray     # int64[R], index into the trees
    depth: np.ndarray       # int64[R], tokens before it on its path
    tokens: np.ndarray      # int64[R]
    trainable: np.ndarray   # bool[R]
    reward_row: np.ndarray  # bool[R]
    subtree_end: np.ndarray   # int64[R], last row of the row's subtree (DFS: a subtree is a row range)
    leaf_rows: np.ndarray     # int64[L], last row of each kept leaf's path (trees, then leaves, in order)
    leaf_rollout: np.ndarray  # int64[L], its tree
    link_source: np.ndarray   # int64[K], the linked leaf's last trainable row (it bootstraps from ...)
    link_target: np.ndarray   # int64[K], ... the first token its target call sampled
    links_unused: int         # links given that could not be placed (a leaf not kept, a target not trained;
                              # not one whose source's answer a trained call goes on from)
    _keys: np.ndarray       # sorted int64 (rollout, first kept leaf below, depth) of trainable rows
    _rows: np.ndarray       # the row of each key
    _leaf_mult: int
    _depth_mult: int

    @property
    def num_rows(self) -> int:
        return int(self.parent.shape[0])

    @classmethod
    def build(cls, trees: Sequence, links: Sequence[Sequence[tuple[int, int, int]]] | None = None) -> "KeptForest":
        """``links[g]``: tree g's links as (source call, target call, the target's prompt length)."""
        parts = []
        base = 0
        for g, tree in enumerate(trees):
            if tree.dropped:
                continue
            part = _tree_part(tree, g, base, links[g] if links is not None else ())
            base += part["parent"].shape[0]
            parts.append(part)

        def cat(key, dtype):
            return np.concatenate([p[key] for p in parts]).astype(dtype) if parts else np.zeros(0, dtype)

        parent, rollout, depth = cat("parent", np.int64), cat("rollout", np.int64), cat("depth", np.int64)
        minleaf, trainable = cat("minleaf", np.int64), cat("trainable", bool)
        leaf_mult = int(max((len(t.leaves) for t in trees), default=0)) + 1
        depth_mult = int(depth.max()) + 2 if depth.size else 1
        rows = np.flatnonzero(trainable)
        keys = (rollout[rows] * leaf_mult + minleaf[rows]) * depth_mult + depth[rows]
        order = np.argsort(keys, kind="stable")
        return cls(parent, rollout, depth, cat("tokens", np.int64), trainable, cat("reward_row", bool),
                   cat("subtree_end", np.int64), cat("leaf_rows", np.int64), cat("leaf_rollout", np.int64),
                   cat("link_source", np.int64), cat("link_target", np.int64),
                   int(sum(p["links_unused"] for p in parts)), keys[order], rows[order], leaf_mult, depth_mult)

    def locate(self, batch) -> np.ndarray:
        """int64[M]: the forest row of each target of a PackedBatch (its predicted token).

        A target is (rollout, its DFS-first kept leaf, depth of the predicted token): the token on
        that leaf's path at that depth, which is unique.
        """
        depth = np.asarray(batch.position_ids, dtype=np.int64)[np.asarray(batch.target_rows)] + 1
        keys = ((np.asarray(batch.target_rollout, np.int64) * self._leaf_mult + np.asarray(batch.target_leaf))
                * self._depth_mult + depth)
        pos = np.searchsorted(self._keys, keys)
        ok = pos < self._keys.shape[0]
        ok[ok] = self._keys[pos[ok]] == keys[ok]
        if not ok.all():
            raise ValueError(f"{int((~ok).sum())} packed target(s) are not trainable tokens of their trees "
                             "(batch packed from other trees?)")
        rows = self._rows[pos]
        if not np.array_equal(self.tokens[rows], np.asarray(batch.target_ids, np.int64)):
            raise ValueError("packed targets do not match the trainable tokens of their trees "
                             "(batch packed from other trees?)")
        return rows


def _tree_part(tree, g: int, base: int, links: Sequence[tuple[int, int, int]] = ()) -> dict[str, np.ndarray]:
    """One tree's kept rows (see KeptForest), with parents offset by ``base``; its links as rows."""
    seg_parent = np.asarray(tree.seg_parent, np.int64)
    seg_start = np.asarray(tree.seg_start, np.int64)
    seg_len = np.asarray(tree.seg_len, np.int64)
    n_seg = seg_parent.shape[0]
    if n_seg and not np.array_equal(seg_start, np.concatenate([[0], np.cumsum(seg_len)[:-1]])):
        raise ValueError("tree tokens are not laid out segment by segment in DFS order")
    excluded = np.asarray(tree.call_indices)[np.asarray(tree.call_excluded, bool)]
    token_call = np.asarray(tree.token_call)
    # Segments are homogeneous in kind and owner (docs/TREE.md), so trainability is per segment.
    seg_train = ((np.asarray(tree.seg_kind) == 1) & ~np.isin(token_call[seg_start], excluded)).tolist()
    big = np.iinfo(np.int64).max
    kept, minleaf = [False] * n_seg, [big] * n_seg
    for i, leaf in enumerate(tree.leaves):
        if leaf.status == "kept":
            kept[leaf.node] = True
            minleaf[leaf.node] = min(minleaf[leaf.node], i)
    par = seg_parent.tolist()
    last = (seg_start + seg_len - 1).tolist()
    sub_end = list(last)  # last token of the kept subtree below each segment (final once visited)
    for s in range(n_seg - 1, -1, -1):  # children follow parents in DFS order: one reverse sweep
        p = par[s]
        if p >= 0 and kept[s]:
            kept[p] = True
            minleaf[p] = min(minleaf[p], minleaf[s])
            sub_end[p] = max(sub_end[p], sub_end[s])
    last_train = [-1] * n_seg  # last trainable token on the path ending with segment s
    for s in range(n_seg):
        last_train[s] = last[s] if seg_train[s] else (last_train[par[s]] if par[s] >= 0 else -1)

    n_tok = int(seg_len.sum())
    seg_of = np.repeat(np.arange(n_seg), seg_len)
    offset = np.arange(n_tok) - seg_start[seg_of]
    seg_last = np.asarray(last, np.int64)
    first_parent = np.where(seg_parent[seg_of] >= 0, seg_last[np.maximum(seg_parent[seg_of], 0)], -1)
    tok_parent = np.where(offset > 0, np.arange(n_tok) - 1, first_parent)
    keep = np.asarray(kept, bool)[seg_of]
    new = np.cumsum(keep) - 1 + base
    parent = np.where(tok_parent >= 0, new[np.maximum(tok_parent, 0)], -1)[keep]
    sources, targets, unused = _link_tokens(tree, links, last_train, seg_train, keep)
    reward_tok = np.zeros(n_tok, dtype=bool)
    for i, leaf in enumerate(tree.leaves):
        if leaf.status == "kept" and last_train[leaf.node] >= 0:
            reward_tok[last_train[leaf.node]] = True
    # A linked leaf's reward is what it leads to, not the rollout's reward (a token where an unlinked
    # kept path also ends keeps the reward; _link_tokens leaves such links out).
    reward_tok[sources] = False
    kept_leaves = [last[leaf.node] for leaf in tree.leaves if leaf.status == "kept"]
    return {
        "link_source": new[sources],
        "link_target": new[targets],
        "links_unused": unused,
        # every token of a segment has the segment's kept subtree below it (the rest of the segment first)
        "subtree_end": new[np.asarray(sub_end, np.int64)[seg_of]][keep],
        "leaf_rows": new[np.asarray(kept_leaves, np.int64)],
        "leaf_rollout": np.full(len(kept_leaves), g, np.int64),
        "parent": parent,
        "rollout": np.full(int(keep.sum()), g, np.int64),
        "depth": (np.asarray(tree.seg_depth, np.int64)[seg_of] + offset)[keep],
        "tokens": np.asarray(tree.tokens, np.int64)[keep],
        "trainable": np.asarray(seg_train, bool)[seg_of][keep],
        "reward_row": reward_tok[keep],
        "minleaf": np.asarray(minleaf, np.int64)[seg_of][keep],
    }


def _link_tokens(tree, links, last_train, seg_train, keep) -> tuple[np.ndarray, np.ndarray, int]:
    """Token indices (into the tree's tokens) of each placeable link's source and target, and the
    number of links that could not be placed. A link whose source call ends inside the tree (a
    trained call goes on from its answer, as a compaction call extends the thread it summarises) is
    neither: its path carries the credit on, and it is not counted as unused."""
    if not links:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    seg_parent, seg_depth = tree.seg_parent.tolist(), tree.seg_depth.tolist()
    seg_start, seg_len = tree.seg_start.tolist(), tree.seg_len.tolist()
    pos = {int(c): i for i, c in enumerate(tree.call_indices.tolist())}
    kept_leaf_of: dict[int, int] = {}
    reward_nodes: dict[int, int] = {}  # reward token -> kept leaves ending their path there
    for leaf in tree.leaves:
        if leaf.status == "kept":
            reward_nodes[last_train[leaf.node]] = reward_nodes.get(last_train[leaf.node], 0) + 1
            for c in leaf.calls:
                kept_leaf_of[c] = leaf.node
    leaf_nodes = {leaf.node for leaf in tree.leaves}
    sources, targets, on_path = [], [], 0
    for source, target, depth in links:
        node = kept_leaf_of.get(source)
        if node is None and source in pos and int(tree.end_node[pos[source]]) not in leaf_nodes:
            on_path += 1
            continue
        src = last_train[node] if node is not None else -1
        s = int(tree.end_node[pos[target]]) if target in pos else -1
        while s >= 0 and seg_depth[s] > depth:  # up to the segment holding the target's first output token
            s = seg_parent[s]
        ok = (src >= 0 and reward_nodes[src] == 1 and s >= 0 and depth < seg_depth[s] + seg_len[s]
              and seg_train[s])
        dst = seg_start[s] + depth - seg_depth[s] if ok else -1
        if ok and keep[src] and keep[dst]:
            sources.append(src)
            targets.append(dst)
    return np.asarray(sources, np.int64), np.asarray(targets, np.int64), len(links) - len(sources) - on_path


def forest_paths(forest: KeptForest, rows: np.ndarray, device=None) -> TreePaths:
    """The kept root-to-leaf paths of the forest as a `clawfast.kernels.TreePaths` (one path per kept
    leaf), over the targets whose tokens are the forest ``rows`` (trainable rows, in target order,
    e.g. the concatenated `KeptForest.locate` of a step's micro-batches). It sees whole trees, so a
    path's sum is exact however the micro-batches split it."""
    rows = np.asarray(rows, np.int64)

    def t(x):
        return torch.as_tensor(np.asarray(x, np.int64), device=device)

    # Each target's row is known: every row's own index stands in for its token, so the index finds
    # that very row. Under routing replay two sibling rows may hold one token (routed apart), and a
    # lookup by (parent, token) would give a target the other's path.
    own = np.arange(forest.num_rows, dtype=np.int64)
    return TreePaths.from_tree(t(forest.parent), t(own), t(forest.subtree_end), t(forest.parent[rows]), t(rows),
                               t(forest.rollout[rows]), t(forest.leaf_rows), t(forest.leaf_rollout))


def ppo_advantages(forest: KeptForest, values: torch.Tensor, rewards: Sequence[float], *, gamma: float = 1.0,
                   lam: float = 1.0, mode: str = "path") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages[R], returns[R]) of every forest row by `clawfast.kernels.tree_gae`.

    ``values[R]``: the old value of every row (only trainable rows are read); ``rewards``: one per
    tree, placed on the forest's ``reward_row`` rows.
    """
    if values.shape != (forest.num_rows,):
        raise ValueError(f"values must be [{forest.num_rows}], got {tuple(values.shape)}")
    r = np.asarray(rewards, dtype=np.float64)
    row_reward = np.where(forest.reward_row, r[forest.rollout] if r.size else 0.0, 0.0)
    dev = values.device
    reward = torch.as_tensor(row_reward, dtype=values.dtype, device=dev)
    parent = torch.as_tensor(forest.parent, device=dev)
    mask = torch.as_tensor(forest.trainable, dtype=values.dtype, device=dev)

    def gae(reward):
        return tree_gae(reward, values, parent, mask=mask, gamma=gamma, lam=lam, mode=mode)

    if not forest.link_source.size:
        return gae(reward)
    # A link's bootstrap needs the final advantage at its target, which depends on the links whose
    # sources lie below that target: one pass per level of that dependency, then the final pass.
    # Folding the bootstrap into a reward on the source row is exact: GAE is linear in the rewards
    # and the source is the last trainable token of its path.
    level = link_levels(forest)
    src = torch.as_tensor(forest.link_source, device=dev)
    dst = torch.as_tensor(forest.link_target, device=dev)
    for k in range(int(level.max()) + 1):
        adv, _ = gae(reward)
        now = torch.as_tensor(level == k, device=dev)
        reward = reward.index_put((src[now],), gamma * (values[dst[now]] + lam * adv[dst[now]]).to(reward.dtype),
                                  accumulate=True)
    return gae(reward)


def link_levels(forest: KeptForest) -> np.ndarray:
    """int64[K]: each link's level: 0 if no link's source lies in the subtree below its target, else
    one more than the highest level among those. Raises ValueError if links depend on each other in
    a cycle (not a shape threads can have: a target is sampled after its source)."""
    src, dst = forest.link_source, forest.link_target
    below = (src[None, :] >= dst[:, None]) & (src[None, :] <= forest.subtree_end[dst][:, None])  # [target, source]
    level = np.zeros(src.shape[0], np.int64)
    for _ in range(src.shape[0] + 1):
        new = np.where(below.any(1), np.max(np.where(below, level[None, :] + 1, 0), axis=1), 0)
        if np.array_equal(new, level):
            return level
        level = new
    raise ValueError("the links between threads form a cycle")


def value_loss_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                     clip: float | None) -> torch.Tensor:
    """Per-target PPO value loss ``0.5 max((v - R)^2, (clip(v, v_old +- clip) - R)^2)`` (no clip: the first)."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * err

"""Packer: the kept sets of several prefix trees as micro-batches of tree-masked rows (docs/TREE.md).

`pack(trees, micro_batch_tokens)` merges the kept sets of all non-dropped trees into one forest
trie by token content (the k samples of one task share their system prompt: it is packed once),
lays the forest out in DFS order and cuts it into micro-batches of at most ``micro_batch_tokens``
rows. Each trainable token gets exactly one target per tree it is trainable in, predicted by its
predecessor row, with that row's full ancestor context in the same batch.

Guaranteed: every trainable token of every non-dropped tree appears as exactly one target over all
batches; a batch's rows are closed under ancestors (``parent_row`` is always in the batch or -1);
``kv_end`` describes the tree mask (row j is visible to row i iff ``j <= i <= kv_end[j]``).
Not guaranteed: the fewest possible batches or rows (greedy pieces and first-fit-decreasing are
heuristics); only that the rows never exceed one sample per kept leaf (see "Splitting" below).

Decisions where docs/TREE.md leaves room (the reference in pack_ref.py must match them):
- Targets exist only for trainable tokens, so ``loss_mask`` and ``weight`` are all 1.0. A target
  belongs to the batch holding its predicting row as a non-context row. Targets are ordered by
  (target_rows, target_ids, target_rollout).
- ``target_leaf`` is the lowest leaf index, among that tree's kept leaves below the token, which is
  the DFS-first one.
- Kept leaves are reported (``leaf_rows``...) in the batch holding their last row as a non-context
  row, ordered by (leaf_rows, leaf_rollout, leaf_index).
- Splitting: an item is a root subtree of the merged forest (rows in forest DFS order) when it has
  at most ``micro_batch_tokens`` rows. A larger one is split by leaves: its childless rows in DFS
  order are grouped greedily into pieces of consecutive leaves, a piece being the union of its
  leaves' root-to-leaf paths (the next leaf joins while the union stays <= ``micro_batch_tokens``).
  A row is real in the first piece holding it and a context row (``is_context``) in later ones; so
  a piece is a run of DFS rows plus the ancestor path of its first row. The packed rows never
  exceed one sample per kept leaf. Item cost = its rows. First-fit-decreasing by cost (ties:
  forest order) into batches in creation order; within a batch, items in forest order, each adding
  the ancestors of its first real row that the batch does not hold yet (two pieces of one subtree
  may share a batch and then share those rows), so rows are in forest DFS order.
- Extra fields beyond TREE.md: ``is_context[N]`` (bool, re-included ancestor rows), and
  ``target_reward[M]`` / ``leaf_reward[L]`` (float32, ``rewards[rollout]``; NaN when ``rewards`` is
  None, so a forgotten reward cannot pass silently as 0).
- A kept root-to-leaf path longer than ``micro_batch_tokens`` is a ValueError; so is
  ``micro_batch_tokens < 1`` or ``> MAX_MICRO_BATCH_TOKENS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clawfast import _core

# The largest micro_batch_tokens: csrc/packer.hpp numbers a batch's rows with int32 (kv_end,
# parent_row, target_rows, leaf_rows are batch-local int32), so a batch holds at most 2**31 - 1 rows.
# (The binding itself takes an int64; past that pybind11 refuses the call with a TypeError that
# prints every array argument.)
MAX_MICRO_BATCH_TOKENS = 2**31 - 1

@dataclass(eq=False)
class PackedBatch:
    """One micro-batch: N rows, M targets, L kept leaves (see module docstring and TREE.md)."""

    input_ids: np.ndarray       # [N] int32
    position_ids: np.ndarray    # [N] int32, depth in its own tree
    kv_end: np.ndarray          # [N] int32, last row of the row's subtree in this batch
    parent_row: np.ndarray      # [N] int32, -1 for a root token
    is_context: np.ndarray      # [N] bool, re-included ancestor rows of a split subtree
    target_rows: np.ndarray     # [M] int32, the row that predicts
    target_ids: np.ndarray      # [M] int32
    loss_mask: np.ndarray       # [M] float32
    weight: np.ndarray          # [M] float32
    infer_logprobs: np.ndarray  # [M] float32, the sampler's logprob of the target
    target_rollout: np.ndarray  # [M] int32, index into the `trees` argument
    target_leaf: np.ndarray     # [M] int32, index into that tree's leaves
    target_call: np.ndarray     # [M] int32, owner call index
    target_reward: np.ndarray   # [M] float32
    leaf_rows: np.ndarray       # [L] int32
    leaf_rollout: np.ndarray    # [L] int32
    leaf_index: np.ndarray      # [L] int32
    leaf_reward: np.ndarray     # [L] float32
    num_tokens: int
    micro_batch_tokens: int
    fill: float
    # MoE routing replay (set by `clawfast.train.routing_rows.RoutingKeys.unkey`, not by `pack`):
    # the recorded experts of each row ([N, layers, top_k]) and which rows have them ([N] bool).
    routing: np.ndarray | None = None
    routing_rows: np.ndarray | None = None


def _tree_arrays(tree) -> dict[str, np.ndarray]:
    """The packer's view of one tree: segments, tokens, trainability and kept leaves."""
    seg_start = np.asarray(tree.seg_start)
    seg_kind = np.asarray(tree.seg_kind)
    token_call = np.asarray(tree.token_call)
    seg_len = np.asarray(tree.seg_len)
    if not (seg_start.shape == seg_kind.shape == seg_len.shape == np.asarray(tree.seg_parent).shape):
        raise ValueError("tree segment arrays differ in length")
    if seg_start.size and (seg_start.min() < 0 or seg_start.max() >= token_call.size):
        raise ValueError("tree segment starts lie outside its tokens")
    excluded_calls = np.asarray(tree.call_indices)[np.asarray(tree.call_excluded, dtype=bool)]
    # Segments are homogeneous: the owner of a segment is the owner of its first token.
    owner = token_call[seg_start] if seg_start.size else np.zeros(0, np.int32)
    seg_train = (seg_kind == 1) & ~np.isin(owner, excluded_calls)
    return {
        "seg_parent": np.asarray(tree.seg_parent),
        "seg_start": seg_start,
        "seg_len": seg_len,
        "seg_train": seg_train.astype(np.uint8),
        "tokens": np.asarray(tree.tokens),
        "infer_logprobs": np.asarray(tree.infer_logprobs),
        "token_call": token_call,
        "leaf_node": np.fromiter((leaf.node for leaf in tree.leaves), dtype=np.int32, count=len(tree.leaves)),
        "leaf_kept": np.fromiter((leaf.status == "kept" for leaf in tree.leaves), dtype=np.uint8,
                                 count=len(tree.leaves)),
    }


_EMPTY = {
    "seg_parent": np.zeros(0, np.int32), "seg_start": np.zeros(0, np.int32), "seg_len": np.zeros(0, np.int32),
    "seg_train": np.zeros(0, np.uint8), "tokens": np.zeros(0, np.int32), "infer_logprobs": np.zeros(0, np.float32),
    "token_call": np.zeros(0, np.int32), "leaf_node": np.zeros(0, np.int32), "leaf_kept": np.zeros(0, np.uint8),
}


def _concat(parts: list[dict[str, np.ndarray]], key: str, dtype: type) -> np.ndarray:
    return np.concatenate([p[key] for p in parts]).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _offsets(parts: list[dict[str, np.ndarray]], key: str) -> np.ndarray:
    off = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p[key]) for p in parts], out=off[1:])
    return off


def pack(trees: Sequence, micro_batch_tokens: int, *, rewards: Sequence[float] | None = None) -> list[PackedBatch]:
    """Pack the kept sets of ``trees`` (dropped trees are skipped) into micro-batches.

    ``target_rollout`` and ``leaf_rollout`` index ``trees`` as given. Raises ValueError for
    ``micro_batch_tokens`` < 1 or > ``MAX_MICRO_BATCH_TOKENS``, a kept path longer than
    ``micro_batch_tokens``, rewards of the wrong length or non-finite, or inconsistent tree arrays.
    """
    if (isinstance(micro_batch_tokens, bool) or not isinstance(micro_batch_tokens, (int, np.integer))
            or micro_batch_tokens < 1):
        raise ValueError(f"micro_batch_tokens must be a positive int, got {micro_batch_tokens!r}")
    if micro_batch_tokens > MAX_MICRO_BATCH_TOKENS:
        raise ValueError(f"micro_batch_tokens must be at most {MAX_MICRO_BATCH_TOKENS} (a batch's rows are "
                         f"numbered with int32), got {micro_batch_tokens}")
    trees = list(trees)
    if rewards is not None:
        reward_arr = np.asarray(rewards, dtype=np.float32)
        if reward_arr.shape != (len(trees),):
            raise ValueError(f"rewards must hold one value per tree ({len(trees)}), got shape {reward_arr.shape}")
        if not np.all(np.isfinite(reward_arr)):
            raise ValueError("rewards must be finite")
    else:
        reward_arr = np.full(len(trees), np.nan, dtype=np.float32)
    parts = [_EMPTY if tree.dropped else _tree_arrays(tree) for tree in trees]
    out = _core.pack_forest(
        _offsets(parts, "seg_parent"), _concat(parts, "seg_parent", np.int32), _concat(parts, "seg_start", np.int32),
        _concat(parts, "seg_len", np.int32), _concat(parts, "seg_train", np.uint8),
        _offsets(parts, "tokens"), _concat(parts, "tokens", np.int32), _concat(parts, "infer_logprobs", np.float32),
        _concat(parts, "token_call", np.int32),
        _offsets(parts, "leaf_node"), _concat(parts, "leaf_node", np.int32), _concat(parts, "leaf_kept", np.uint8),
        int(micro_batch_tokens),
    )
    batches = []
    row_off, tgt_off, leaf_off = out["row_off"], out["tgt_off"], out["leaf_off"]
    for b in range(len(row_off) - 1):
        rows = slice(row_off[b], row_off[b + 1])
        tgts = slice(tgt_off[b], tgt_off[b + 1])
        lvs = slice(leaf_off[b], leaf_off[b + 1])
        n_rows = int(row_off[b + 1] - row_off[b])
        n_tgts = int(tgt_off[b + 1] - tgt_off[b])
        batches.append(PackedBatch(
            input_ids=out["input_ids"][rows],
            position_ids=out["position_ids"][rows],
            kv_end=out["kv_end"][rows],
            parent_row=out["parent_row"][rows],
            is_context=out["is_context"][rows].astype(bool),
            target_rows=out["target_rows"][tgts],
            target_ids=out["target_ids"][tgts],
            loss_mask=np.ones(n_tgts, dtype=np.float32),
            weight=np.ones(n_tgts, dtype=np.float32),
            infer_logprobs=out["infer_logprobs"][tgts],
            target_rollout=out["target_rollout"][tgts],
            target_leaf=out["target_leaf"][tgts],
            target_call=out["target_call"][tgts],
            target_reward=reward_arr[out["target_rollout"][tgts]],
            leaf_rows=out["leaf_rows"][lvs],
            leaf_rollout=out["leaf_rollout"][lvs],
            leaf_index=out["leaf_index"][lvs],
            leaf_reward=reward_arr[out["leaf_rollout"][lvs]],
            num_tokens=n_rows,
            micro_batch_tokens=int(micro_batch_tokens),
            fill=n_rows / int(micro_batch_tokens),
        ))
    return batches


def pack_stats(batches: Sequence[PackedBatch]) -> dict[str, float | int]:
    """Totals and fill of a list of micro-batches (fill = rows / micro_batch_tokens, context rows included)."""
    if not batches:
        return {"num_batches": 0, "num_tokens": 0, "num_context_tokens": 0, "num_targets": 0,
                "fill_mean": 0.0, "fill_min": 0.0, "fill_total": 0.0}
    fills = [b.fill for b in batches]
    tokens = sum(b.num_tokens for b in batches)
    return {
        "num_batches": len(batches),
        "num_tokens": tokens,
        "num_context_tokens": int(sum(int(b.is_context.sum()) for b in batches)),
        "num_targets": int(sum(len(b.target_ids) for b in batches)),
        "fill_mean": float(np.mean(fills)),
        "fill_min": float(min(fills)),
        "fill_total": tokens / sum(b.micro_batch_tokens for b in batches),
    }

"""Plain-Python reference of the packer (docs/TREE.md, "Packing").

`pack_ref` computes the same function as the C++ fast path `clawfast.pack.pack`, written
independently and kept simple: a token-level trie of dicts merges the kept sets of all trees, one
DFS lays the forest out, and micro-batches are filled first-fit-decreasing. Field names and dtypes
match `clawfast.pack.PackedBatch` so tests can compare them field by field.

Choices the contract leaves open, made here as the fast path makes them:
- Items: each root subtree of the merged forest that fits `micro_batch_tokens` is one item; a
  larger one is split greedily into pieces of consecutive forest leaves (childless rows) in DFS
  order, a piece being the union of its leaves' root-to-leaf paths; the next leaf joins while the
  union stays within `micro_batch_tokens`. A row is real in the first piece holding it and a
  context row in later pieces. Items are placed first-fit-decreasing by cost (their rows), ties in forest order (of
  their first real row). A batch holds the union of its items' rows, each once, in forest DFS
  order; a row is context unless it is real in one of the batch's items.
- A target belongs to the batch where its *predicting* row is not a context row; context rows
  predict nothing. Targets are ordered by predicting row, then target token, then rollout.
- A kept leaf is listed in the batch where its last row is not a context row; ordered by row,
  rollout, leaf index.

Guaranteed: exactness against the contract. Not guaranteed: speed (pure Python, per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from clawfast.tree_ref import trainable_mask_ref

# pack.MAX_MICRO_BATCH_TOKENS (int32 batch-local rows), restated so the reference needs no C++ build;
# tests/test_tree_props.py checks that both packers refuse one more.
MAX_MICRO_BATCH_TOKENS = 2**31 - 1


@dataclass
class PackedBatchRef:
    """One micro-batch: N rows, M targets, K kept leaves (see docs/TREE.md for each field)."""

    input_ids: np.ndarray  # int32[N]
    position_ids: np.ndarray  # int32[N]
    kv_end: np.ndarray  # int32[N]
    parent_row: np.ndarray  # int32[N]
    is_context: np.ndarray  # bool[N]: re-included ancestor rows of a split subtree
    target_rows: np.ndarray  # int32[M]
    target_ids: np.ndarray  # int32[M]
    loss_mask: np.ndarray  # float32[M]
    weight: np.ndarray  # float32[M]
    infer_logprobs: np.ndarray  # float32[M]
    target_rollout: np.ndarray  # int32[M]
    target_leaf: np.ndarray  # int32[M]
    target_call: np.ndarray  # int32[M]
    target_reward: np.ndarray  # float32[M]: rewards[target_rollout], NaN without rewards
    leaf_rows: np.ndarray  # int32[K]
    leaf_rollout: np.ndarray  # int32[K]
    leaf_index: np.ndarray  # int32[K]
    leaf_reward: np.ndarray  # float32[K]
    num_tokens: int
    micro_batch_tokens: int
    fill: float


class _Row:
    """One node of the merged token trie (one row of the forest layout)."""

    __slots__ = ("token", "parent", "children", "depth", "targets", "leaves", "g", "end")

    def __init__(self, token: int, parent: "_Row | None", depth: int) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Row] = {}
        self.depth = depth
        self.targets: list[tuple[int, int, int, float]] = []  # (rollout, leaf, call, logprob)
        self.leaves: list[tuple[int, int]] = []  # (rollout, leaf index)
        self.g = -1  # global row in forest DFS order
        self.end = -1  # last global row of its subtree


def _merge(trees: Sequence) -> _Row:
    """The kept sets of all non-dropped trees as one token trie, annotated with targets and leaves."""
    root = _Row(-1, None, -1)
    for r, tree in enumerate(trees):
        if tree.dropped:
            continue
        trainable = trainable_mask_ref(tree)
        n_seg = len(tree.seg_parent)
        first_leaf = [-1] * n_seg  # DFS-first kept leaf below each segment
        for leaf in tree.kept_leaves:
            s = int(tree.leaves[leaf].node)
            while s >= 0:
                if first_leaf[s] < 0 or leaf < first_leaf[s]:
                    first_leaf[s] = leaf
                s = int(tree.seg_parent[s])
        seg_end: dict[int, _Row] = {}  # merged row holding each kept segment's last token
        for s in range(n_seg):  # pre-order: parents come first
            if first_leaf[s] < 0:
                continue
            p = int(tree.seg_parent[s])
            node = root if p < 0 else seg_end[p]
            a = int(tree.seg_start[s])
            for t in range(a, a + int(tree.seg_len[s])):
                tok = int(tree.tokens[t])
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Row(tok, node, node.depth + 1)
                node = child
                if trainable[t]:
                    node.targets.append((r, first_leaf[s], int(tree.token_call[t]), float(tree.infer_logprobs[t])))
            seg_end[s] = node
        for leaf in tree.kept_leaves:
            seg_end[int(tree.leaves[leaf].node)].leaves.append((r, leaf))
    return root


def _layout(root: _Row) -> list[_Row]:
    """Forest DFS pre-order (children by ascending token); sets each row's `g` and `end`."""
    order: list[_Row] = []
    stack = [root.children[t] for t in sorted(root.children, reverse=True)]
    while stack:
        node = stack.pop()
        node.g = len(order)
        order.append(node)
        stack.extend(node.children[t] for t in sorted(node.children, reverse=True))
    for node in reversed(order):
        node.end = max([node.g] + [c.end for c in node.children.values()])
    return order


def pack_ref(trees: Sequence, micro_batch_tokens: int, *,
             rewards: Sequence[float] | None = None) -> list[PackedBatchRef]:
    """Pack the kept sets of `trees` (reference or fast-path trees) into micro-batches.

    `rewards` (one finite value per tree) is copied to each target and leaf of that tree.
    """
    if (isinstance(micro_batch_tokens, bool) or not isinstance(micro_batch_tokens, (int, np.integer))
            or micro_batch_tokens < 1):
        raise ValueError(f"micro_batch_tokens must be a positive int, got {micro_batch_tokens!r}")
    if micro_batch_tokens > MAX_MICRO_BATCH_TOKENS:
        raise ValueError(f"micro_batch_tokens must be at most {MAX_MICRO_BATCH_TOKENS} (a batch's rows are "
                         f"numbered with int32), got {micro_batch_tokens}")
    trees = list(trees)
    if rewards is None:
        reward = [float("nan")] * len(trees)
    else:
        reward = [float(r) for r in rewards]
        if len(reward) != len(trees) or not all(np.isfinite(reward)):
            raise ValueError(f"rewards must be {len(trees)} finite values, got {list(rewards)!r}")
    order = _layout(_merge(trees))
    longest = max((node.depth + 1 for node in order), default=0)
    if longest > micro_batch_tokens:
        raise ValueError(f"a kept root-to-leaf path has {longest} tokens, "
                         f"more than micro_batch_tokens={micro_batch_tokens}")

    # Items: (global rows, the rows real in this item). A root subtree that fits is one item; a
    # larger one is split into pieces of consecutive forest leaves (childless rows, DFS order),
    # each piece the union of its leaves' root-to-leaf paths, grown while it fits. A row is real
    # in the first piece that holds it and context in later ones.
    items: list[tuple[list[int], set[int]]] = []
    for node in order:
        if node.depth != 0:
            continue
        rows = list(range(node.g, node.end + 1))
        if len(rows) <= micro_batch_tokens:
            items.append((rows, set(rows)))
            continue
        pieces: list[set[int]] = []
        current: set[int] = set()
        for g in rows:
            if order[g].children:
                continue
            path = set()
            walk = order[g]
            while walk is not None and walk.g >= 0:
                path.add(walk.g)
                walk = walk.parent
            if current and len(current | path) > micro_batch_tokens:
                pieces.append(current)
                current = set()
            current |= path
        pieces.append(current)
        seen: set[int] = set()
        for piece in pieces:
            items.append((sorted(piece), piece - seen))
            seen |= piece

    # First-fit decreasing by cost (rows of the item); sorted() is stable, so ties stay in forest
    # order (items were made in the order of their first real row).
    bins: list[list[tuple[list[int], set[int]]]] = []
    used: list[int] = []
    for item in sorted(items, key=lambda it: -len(it[0])):
        b = next((b for b in range(len(bins)) if used[b] + len(item[0]) <= micro_batch_tokens), None)
        if b is None:
            bins.append([])
            used.append(0)
            b = len(bins) - 1
        bins[b].append(item)
        used[b] += len(item[0])
    return [_emit(order, items_of, int(micro_batch_tokens), reward) for items_of in bins]


def _emit(order: list[_Row], items: list[tuple[list[int], set[int]]], micro_batch_tokens: int,
          reward: list[float]) -> PackedBatchRef:
    # The batch holds the union of its items' rows once each (two pieces of one root subtree may
    # share a batch and their ancestors); a row is context unless it is real in one of the items.
    held = sorted(set().union(*(set(rows) for rows, _ in items)))
    real = set().union(*(r for _, r in items))
    rows = [order[g] for g in held]
    context = [g not in real for g in held]
    local = {id(node): i for i, node in enumerate(rows)}
    parent_row = [local[id(n.parent)] if n.depth > 0 else -1 for n in rows]
    # kv_end: the last batch row of each row's subtree, children pushing their end up to parents.
    kv_end = list(range(len(rows)))
    for i in reversed(range(len(rows))):
        if parent_row[i] >= 0:
            kv_end[parent_row[i]] = max(kv_end[parent_row[i]], kv_end[i])
    tg: list[tuple] = []
    lf: list[tuple] = []
    for i, node in enumerate(rows):
        if context[i]:
            continue
        for tok in sorted(node.children):
            for rollout, leaf, call, lp in node.children[tok].targets:
                tg.append((i, tok, rollout, leaf, call, lp))
        for rollout, leaf in node.leaves:
            lf.append((i, rollout, leaf))
    m = len(tg)
    col = lambda k, dtype: np.array([t[k] for t in tg], dtype=dtype)  # noqa: E731
    return PackedBatchRef(
        input_ids=np.array([n.token for n in rows], dtype=np.int32),
        position_ids=np.array([n.depth for n in rows], dtype=np.int32),
        kv_end=np.array(kv_end, dtype=np.int32),
        parent_row=np.array(parent_row, dtype=np.int32),
        is_context=np.array(context, dtype=bool),
        target_rows=col(0, np.int32),
        target_ids=col(1, np.int32),
        loss_mask=np.ones(m, dtype=np.float32),
        weight=np.ones(m, dtype=np.float32),
        infer_logprobs=col(5, np.float32),
        target_rollout=col(2, np.int32),
        target_leaf=col(3, np.int32),
        target_call=col(4, np.int32),
        target_reward=np.array([reward[t[2]] for t in tg], dtype=np.float32),
        leaf_rows=np.array([x[0] for x in lf], dtype=np.int32),
        leaf_rollout=np.array([x[1] for x in lf], dtype=np.int32),
        leaf_index=np.array([x[2] for x in lf], dtype=np.int32),
        leaf_reward=np.array([reward[x[1]] for x in lf], dtype=np.float32),
        num_tokens=len(rows),
        micro_batch_tokens=micro_batch_tokens,
        fill=len(rows) / micro_batch_tokens,
    )

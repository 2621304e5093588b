"""Plain-Python reference of the prefix tree and leaf filter (docs/TREE.md).

`build_tree_ref` computes the same function as the C++ fast path `clawfast.tree.build_tree`, written
independently from the contract and kept as simple as possible: a token-by-token trie of dicts, then
one DFS that cuts it into segments. It exists to be compared against the fast path in tests and
benchmarks; it is slow (about 0.5 us per input token) and is not meant for training.

Choices the contract leaves open, made here as the fast path makes them: calls are identified by
their `call_index` values (`call_indices` ascending, `end_node` and `call_excluded` aligned with it);
leaves are listed in DFS order with `depth` = tokens on the root-to-leaf path; statuses are the
strings "kept", "dead", "excluded" (excluded checked first, then dead); the rollout's last
main-thread call is the non-excluded call with the highest index (none if all are excluded).

Guaranteed: the result follows docs/TREE.md literally (segment order, kinds, owners, statuses,
counts). Not guaranteed: speed, or memory below a few hundred bytes per unique token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from clawfast.records import EXCLUDED_TAGS, CallRecord

LEAF_STATUSES = ("kept", "dead", "excluded")


@dataclass(frozen=True)
class LeafRef:
    """A leaf (docs/TREE.md, "Leaves and statuses"): its DFS segment index, the number of tokens on
    its root-to-leaf path, the ascending call indices ending there, and its status (one of
    `LEAF_STATUSES`). A kept leaf may have excluded calls' tokens below it."""

    node: int
    depth: int
    calls: tuple[int, ...]
    status: str


@dataclass(eq=False)
class PrefixTreeRef:
    """One rollout as a radix tree; field names and dtypes match `clawfast.tree.PrefixTree`.

    Calls are identified by their `call_index` value: `call_indices` (int32, ascending) lists them
    and `end_node` / `call_excluded` are aligned with it; `token_call` holds call_index values.
    """

    rollout_id: str
    seg_parent: np.ndarray  # int32[S], -1 for children of the root
    seg_start: np.ndarray  # int32[S]
    seg_len: np.ndarray  # int32[S]
    seg_kind: np.ndarray  # int8[S]: 0 context, 1 generated
    seg_depth: np.ndarray  # int32[S]
    tokens: np.ndarray  # int32[T]
    infer_logprobs: np.ndarray  # float32[T], NaN for context
    token_call: np.ndarray  # int32[T], owner call index, -1 for context
    call_indices: np.ndarray  # int32[C], ascending
    end_node: np.ndarray  # int32[C]: segment where the call's path ends
    call_excluded: np.ndarray  # bool[C]
    leaves: list[LeafRef]  # in DFS order
    num_unique_tokens: int
    num_flat_tokens: int
    num_call_tokens: int
    dropped: bool

    @property
    def num_segments(self) -> int:
        return len(self.seg_len)

    @property
    def kept_leaves(self) -> list[int]:
        """Indices (into `leaves`) of the kept leaves."""
        return [i for i, leaf in enumerate(self.leaves) if leaf.status == "kept"]


def path_tokens(tree, seg: int) -> np.ndarray:
    """Token ids from the root to the end of segment `seg` (any tree with the PrefixTree fields)."""
    chain = []
    while seg >= 0:
        chain.append(seg)
        seg = int(tree.seg_parent[seg])
    parts = [tree.tokens[tree.seg_start[s] : tree.seg_start[s] + tree.seg_len[s]] for s in reversed(chain)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def validate_calls(calls: Sequence[CallRecord]) -> list[CallRecord]:
    """The contract's input checks; returns the calls sorted by call index."""
    calls = list(calls)
    if not calls:
        raise ValueError("build_tree: empty list of calls")
    rollout_ids = {c.rollout_id for c in calls}
    if len(rollout_ids) != 1:
        raise ValueError(f"build_tree: calls of several rollouts {sorted(rollout_ids)}")
    seen: set[int] = set()
    for c in calls:
        if not isinstance(c, CallRecord):
            raise ValueError(f"build_tree: expected CallRecord objects, got {type(c).__name__}")
        if isinstance(c.call_index, bool) or not isinstance(c.call_index, (int, np.integer)):
            raise ValueError(f"build_tree: call_index must be an int, got {c.call_index!r}")
        if not 0 <= c.call_index <= np.iinfo(np.int32).max:
            raise ValueError(f"build_tree: call index {c.call_index} outside [0, 2^31)")
        if c.call_index in seen:
            raise ValueError(f"build_tree: duplicate call index {c.call_index}")
        seen.add(c.call_index)
        # Arrays may have been replaced after construction, so check what __post_init__ checked.
        for name in ("prompt_ids", "output_ids"):
            ids = np.asarray(getattr(c, name))
            if ids.size and int(ids.min()) < 0:
                raise ValueError(f"build_tree: call {c.call_index}: negative token id in {name}")
        c.validate()
    return sorted(calls, key=lambda c: c.call_index)


class _Tok:
    """One token of the token-level trie."""

    __slots__ = ("token", "parent", "children", "depth", "owner", "logprob", "boundary", "ends")

    def __init__(self, token: int, parent: "_Tok | None", depth: int) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Tok] = {}
        self.depth = depth
        self.owner = -1  # call index owning this position (step 1 of build_tree_ref)
        self.logprob = math.nan
        self.boundary = False  # a prompt end or a path end falls after this token
        self.ends: list[int] = []  # positions k of calls whose path ends here


def build_tree_ref(
    calls: Iterable[CallRecord],
    *,
    max_kept_leaves: int | None = None,
    drop_dead: bool = True,
    exclude_tags: Iterable[str] = EXCLUDED_TAGS,
) -> PrefixTreeRef:
    """Build one rollout's prefix tree and classify its leaves, exactly as docs/TREE.md says."""
    if max_kept_leaves is not None and (
        isinstance(max_kept_leaves, bool) or not isinstance(max_kept_leaves, int) or max_kept_leaves < 0
    ):
        raise ValueError(f"max_kept_leaves must be a non-negative int or None, got {max_kept_leaves!r}")
    if isinstance(exclude_tags, str):  # frozenset("title") would be a set of letters (as build_tree refuses)
        raise ValueError(f"exclude_tags must be a collection of tags, got the string {exclude_tags!r}")
    ordered = validate_calls(list(calls))
    exclude = frozenset(exclude_tags)
    excluded = [bool(exclude.intersection(c.tags)) for c in ordered]

    # 1. Token trie. The owner of a generated position: of the calls that generated it, a
    #    non-excluded one before an excluded one, and of those the highest index (docs/TREE.md).
    #    Calls go in ascending index, so a later call takes a position unless it is excluded and
    #    the owner is not.
    excluded_call = {c.call_index: x for c, x in zip(ordered, excluded)}
    root = _Tok(-1, None, -1)
    for k, c in enumerate(ordered):
        prompt = [int(t) for t in c.prompt_ids]
        output = [int(t) for t in c.output_ids]
        node = root
        for pos, tok in enumerate(prompt + output):
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Tok(tok, node, node.depth + 1)
            node = child
            if pos >= len(prompt) and (node.owner < 0 or not excluded[k] or excluded_call[node.owner]):
                node.owner = c.call_index
                node.logprob = float(c.infer_logprobs[pos - len(prompt)])
            if pos == len(prompt) - 1:
                node.boundary = True
        node.boundary = True
        node.ends.append(k)

    # 2. One pre-order DFS, children by ascending token id. A token opens a new segment when its
    #    parent is the root, a branch point or a forced boundary.
    tokens: list[int] = []
    logprobs: list[float] = []
    owners: list[int] = []
    seg_parent: list[int] = []
    seg_start: list[int] = []
    seg_len: list[int] = []
    seg_kind: list[int] = []
    seg_depth: list[int] = []
    seg_children: list[int] = []
    end_node = [-1] * len(ordered)
    seg_of: dict[int, int] = {}  # id(_Tok) -> segment holding it (only needed for parents)
    stack = [root.children[t] for t in sorted(root.children, reverse=True)]
    while stack:
        tok = stack.pop()
        parent = tok.parent
        opens = parent is root or parent.boundary or len(parent.children) > 1
        if opens:
            p_seg = -1 if parent is root else seg_of[id(parent)]
            if p_seg >= 0:
                seg_children[p_seg] += 1
            seg_parent.append(p_seg)
            seg_start.append(len(tokens))
            seg_len.append(0)
            seg_kind.append(1 if tok.owner >= 0 else 0)
            seg_depth.append(tok.depth)
            seg_children.append(0)
        s = len(seg_parent) - 1 if opens else seg_of[id(parent)]
        assert seg_kind[s] == (1 if tok.owner >= 0 else 0), "segment with mixed kinds"
        seg_of[id(tok)] = s
        seg_len[s] += 1
        tokens.append(tok.token)
        logprobs.append(tok.logprob)
        owners.append(tok.owner)
        for k in tok.ends:
            end_node[k] = s
        stack.extend(tok.children[t] for t in sorted(tok.children, reverse=True))

    # 3. Leaves (in DFS order) and their statuses.
    ends_at: dict[int, list[int]] = {}
    for k, s in enumerate(end_node):
        ends_at.setdefault(s, []).append(k)
    main = [k for k in range(len(ordered)) if not excluded[k]]
    last_main = main[-1] if main else -1
    # A call is retried if a later call (strictly greater index) asked exactly the same prompt.
    prompts = [np.ascontiguousarray(c.prompt_ids, dtype=np.int32).tobytes() for c in ordered]
    last_asked = {p: k for k, p in enumerate(prompts)}
    retried = [last_asked[p] > k for k, p in enumerate(prompts)]

    def dead(ks: list[int]) -> bool:  # a main end node whose calls a later call retried
        return drop_dead and last_main not in ks and any(retried[k] for k in ks)

    def mark_above(s: int, below: list[bool]) -> None:
        p = seg_parent[s]
        while p >= 0 and not below[p]:
            below[p] = True
            p = seg_parent[p]

    # Segments with a main end node (of a non-excluded call) strictly below them, and those with a
    # live one (not dead) below: walk up from each such end.
    dead_at = {s: dead(ks) for s, ks in ends_at.items()}
    main_below = [False] * len(seg_parent)
    live_below = [False] * len(seg_parent)
    for s, ks in ends_at.items():
        if any(not excluded[k] for k in ks):
            mark_above(s, main_below)
            if not dead_at[s]:
                mark_above(s, live_below)
    leaves = []
    for s in range(len(seg_parent)):
        ks = ends_at.get(s)
        if ks is None:
            continue  # not an end node (every childless segment is some path's end)
        if any(not excluded[k] for k in ks):
            # A main end node is a leaf unless a main call ends below it: excluded calls below
            # (a compaction or subagent prompt extending this path) do not count, and neither do
            # dead ones below a live end (a last retry that answered a prefix of what it retried).
            if (main_below if dead_at[s] else live_below)[s]:
                continue
        elif seg_children[s]:
            continue  # an excluded end node is a leaf only with nothing below it
        if all(excluded[k] for k in ks):
            status = "excluded"
        elif dead_at[s]:
            status = "dead"
        else:
            status = "kept"
        calls_here = tuple(int(ordered[k].call_index) for k in ks)
        leaves.append(LeafRef(node=s, depth=seg_depth[s] + seg_len[s], calls=calls_here, status=status))
    kept = [leaf for leaf in leaves if leaf.status == "kept"]
    return PrefixTreeRef(
        rollout_id=ordered[0].rollout_id,
        seg_parent=np.array(seg_parent, dtype=np.int32),
        seg_start=np.array(seg_start, dtype=np.int32),
        seg_len=np.array(seg_len, dtype=np.int32),
        seg_kind=np.array(seg_kind, dtype=np.int8),
        seg_depth=np.array(seg_depth, dtype=np.int32),
        tokens=np.array(tokens, dtype=np.int32),
        infer_logprobs=np.array(logprobs, dtype=np.float32),
        token_call=np.array(owners, dtype=np.int32),
        call_indices=np.array([c.call_index for c in ordered], dtype=np.int32),
        end_node=np.array(end_node, dtype=np.int32),
        call_excluded=np.array(excluded, dtype=bool),
        leaves=leaves,
        num_unique_tokens=len(tokens),
        num_flat_tokens=sum(leaf.depth for leaf in kept),
        num_call_tokens=sum(len(c.prompt_ids) + len(c.output_ids) for c in ordered),
        dropped=max_kept_leaves is not None and len(kept) > max_kept_leaves,
    )


def trainable_mask_ref(tree) -> np.ndarray:
    """bool[T]: generated tokens on a kept root-to-leaf path whose owner call is not excluded.

    Works on any object with the PrefixTree fields (the reference's or the fast path's).
    """
    kept_seg = np.zeros(len(tree.seg_parent), dtype=bool)
    for leaf in tree.leaves:
        if leaf.status != "kept":
            continue
        s = int(leaf.node)
        while s >= 0 and not kept_seg[s]:
            kept_seg[s] = True
            s = int(tree.seg_parent[s])
    excluded_calls = {int(i) for i, e in zip(tree.call_indices, tree.call_excluded) if e}
    mask = np.zeros(len(tree.tokens), dtype=bool)
    for s in np.flatnonzero(kept_seg):
        if int(tree.seg_kind[s]) != 1:
            continue
        a, n = int(tree.seg_start[s]), int(tree.seg_len[s])
        for t in range(a, a + n):
            mask[t] = int(tree.token_call[t]) not in excluded_calls
    return mask


def kept_leaf_paths_ref(tree) -> list[np.ndarray]:
    """Token indices (into ``tree.tokens``) of every kept leaf's root-to-leaf path, in leaf order: the
    flat per-leaf trajectories a tree stands for. Works on any object with the PrefixTree fields."""
    paths = []
    for leaf in tree.leaves:
        if leaf.status != "kept":
            continue
        chain, s = [], leaf.node
        while s >= 0:
            chain.append(s)
            s = int(tree.seg_parent[s])
        paths.append(np.concatenate([np.arange(tree.seg_start[s], tree.seg_start[s] + tree.seg_len[s])
                                     for s in reversed(chain)]))
    return paths

"""Prefix tree of one rollout's model calls, built by the C++ core (contract: docs/TREE.md).

`build_tree(calls)` rebuilds the tree of every path ``prompt_ids + output_ids`` the harness sent
and the engine answered, marks each token as generated (with its owner call and sampling logprob)
or context, and classifies every leaf as kept, dead (retried/regenerated) or excluded (subagent,
compaction, title, quota calls). A main-thread call's end node is a leaf unless another main-thread
call ends below it (a live one, below a live end), so a compaction or subagent whose prompt extends
the main path, or a dead answer a last retry cut short, does not make the main path before it
untrainable.

Guaranteed: the arrays below are exactly those of docs/TREE.md (DFS pre-order, children by
ascending first token, root excluded); malformed input raises ``ValueError`` before any C++ runs or
from the binding's own checks, never a crash. Cost is one memcmp-speed run comparison per input
token plus O(segments log children); no Python work per token.
Not guaranteed: anything about calls of other rollouts (one tree per rollout).

Decisions where docs/TREE.md leaves room (the reference in tree_ref.py must match them):
- Calls are identified by their ``call_index`` value. ``call_indices`` (int32, ascending) lists them;
  ``end_node`` and ``call_excluded`` are arrays aligned with it. ``token_call`` holds call_index
  values, -1 for context, so a negative ``call_index`` is a ValueError.
- ``leaves`` are in DFS order; ``Leaf.depth`` is the number of tokens on the root-to-leaf path
  including the leaf's own tokens (so num_flat_tokens = sum of kept ``Leaf.depth``);
  ``Leaf.calls`` is the ascending tuple of call indices whose end node is the leaf; ``Leaf.status``
  is one of the strings "kept", "dead", "excluded" (checked in that order of precedence:
  excluded, then dead, then kept).
- "The rollout's last main-thread call" is the non-excluded call with the highest call index (none
  if every call is excluded). A call is excluded iff one of its tags is in ``exclude_tags``.
- dtypes: seg_* and token_call int32 except seg_kind int8; tokens int32; infer_logprobs float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from clawfast import _core
from clawfast.records import EXCLUDED_TAGS, CallRecord

LEAF_STATUSES = ("kept", "dead", "excluded")  # indexed by the C++ LeafStatus code


@dataclass(frozen=True)
class Leaf:
    """A leaf (docs/TREE.md, "Leaves and statuses"): its DFS segment index, path length, the calls
    ending there, its status. A kept leaf may have excluded calls' tokens below it."""

    node: int
    depth: int
    calls: tuple[int, ...]
    status: str


@dataclass(eq=False)
class PrefixTree:
    """One rollout's prefix tree. Arrays are numpy, in DFS pre-order (see module docstring)."""

    rollout_id: str
    seg_parent: np.ndarray
    seg_start: np.ndarray
    seg_len: np.ndarray
    seg_kind: np.ndarray
    seg_depth: np.ndarray
    tokens: np.ndarray
    infer_logprobs: np.ndarray
    token_call: np.ndarray
    call_indices: np.ndarray
    end_node: np.ndarray
    call_excluded: np.ndarray
    leaves: list[Leaf]
    num_unique_tokens: int
    num_flat_tokens: int
    num_call_tokens: int
    dropped: bool

    @property
    def num_segments(self) -> int:
        return int(len(self.seg_len))

    @property
    def kept_leaves(self) -> list[int]:
        """Indices (into ``leaves``) of the kept leaves."""
        return [i for i, leaf in enumerate(self.leaves) if leaf.status == "kept"]

    @property
    def longest_kept_path(self) -> int:
        """Tokens on the longest root-to-leaf path of a kept leaf (0 if none): the rows a micro-batch
        needs to train it, since a path is never split."""
        return max((leaf.depth for leaf in self.leaves if leaf.status == "kept"), default=0)


def _check_ids(arr: object, name: str, call: CallRecord) -> np.ndarray:
    # CallRecord converts on construction, but its fields are mutable: check again here.
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise ValueError(f"call {call.call_index}: {name} must be a one-dimensional numpy array")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"call {call.call_index}: {name} must hold integers, got {arr.dtype}")
    # int32 ids cannot overflow; their sign is checked by the C++ binding in the same pass that
    # reads them (a second scan here cost ~0.6 ms of the ~2.5 ms build of a 2M-token rollout).
    if arr.dtype != np.int32 and arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"call {call.call_index}: {name} holds token ids outside [0, 2^31)")
    return arr


def _sorted_calls(calls: Sequence[CallRecord]) -> list[CallRecord]:
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Iterable):
        raise ValueError("build_tree expects a sequence of CallRecord")
    calls = list(calls)
    if not calls:
        raise ValueError("build_tree needs at least one call")
    for call in calls:
        if not isinstance(call, CallRecord):
            raise ValueError(f"build_tree expects CallRecord objects, got {type(call).__name__}")
        if isinstance(call.call_index, bool) or not isinstance(call.call_index, (int, np.integer)):
            raise ValueError(f"call_index must be an int, got {call.call_index!r}")
        if not 0 <= call.call_index <= np.iinfo(np.int32).max:
            raise ValueError(f"call_index {call.call_index} outside [0, 2^31)")
    rollouts = {call.rollout_id for call in calls}
    if len(rollouts) > 1:
        raise ValueError(f"calls from several rollouts: {sorted(map(str, rollouts))}")
    calls.sort(key=lambda c: int(c.call_index))
    for a, b in zip(calls, calls[1:]):
        if a.call_index == b.call_index:
            raise ValueError(f"rollout {a.rollout_id!r}: duplicate call index {a.call_index}")
    for call in calls:
        _check_ids(call.prompt_ids, "prompt_ids", call)
        _check_ids(call.output_ids, "output_ids", call)
        lp = call.infer_logprobs
        if not isinstance(lp, np.ndarray) or lp.ndim != 1:
            raise ValueError(f"call {call.call_index}: infer_logprobs must be a one-dimensional numpy array")
        call.validate()
    return calls


def build_tree(
    calls: Sequence[CallRecord],
    *,
    max_kept_leaves: int | None = None,
    drop_dead: bool = True,
    exclude_tags: Iterable[str] = EXCLUDED_TAGS,
) -> PrefixTree:
    """Build the prefix tree of one rollout's calls (any arrival order). See docs/TREE.md.

    Raises ValueError on malformed input: empty list, mixed rollout ids, duplicate or negative call
    indices, negative or non-integer token ids, logprob length mismatch, anything
    ``CallRecord.validate`` rejects.
    """
    if max_kept_leaves is not None and (isinstance(max_kept_leaves, bool) or not isinstance(max_kept_leaves, int)
                                        or max_kept_leaves < 0):
        raise ValueError(f"max_kept_leaves must be a non-negative int or None, got {max_kept_leaves!r}")
    if isinstance(exclude_tags, str):  # frozenset("title") would be a set of letters
        raise ValueError(f"exclude_tags must be a collection of tags, got the string {exclude_tags!r}")
    exclude = frozenset(exclude_tags)
    calls = _sorted_calls(calls)
    n = len(calls)
    prompt_len = np.fromiter((len(c.prompt_ids) for c in calls), dtype=np.int64, count=n)
    path_len = prompt_len + np.fromiter((len(c.output_ids) for c in calls), dtype=np.int64, count=n)
    path_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(path_len, out=path_off[1:])
    parts = [a for c in calls for a in (c.prompt_ids, c.output_ids)]
    ids = np.concatenate(parts).astype(np.int32, copy=False)
    infer_logprobs = np.concatenate([c.infer_logprobs for c in calls]).astype(np.float32, copy=False)
    call_index = np.fromiter((int(c.call_index) for c in calls), dtype=np.int64, count=n)
    excluded = np.fromiter((bool(exclude.intersection(c.tags)) for c in calls), dtype=np.uint8, count=n)

    out = _core.build_tree(ids, path_off, prompt_len, infer_logprobs, call_index, excluded, bool(drop_dead))

    call_off = out["leaf_call_off"]
    leaf_calls = out["leaf_calls"].tolist()
    leaves = [
        Leaf(node=int(node), depth=int(depth), calls=tuple(leaf_calls[call_off[i]: call_off[i + 1]]),
             status=LEAF_STATUSES[status])
        for i, (node, depth, status) in enumerate(
            zip(out["leaf_node"].tolist(), out["leaf_depth"].tolist(), out["leaf_status"].tolist()))
    ]
    n_kept = sum(leaf.status == "kept" for leaf in leaves)
    return PrefixTree(
        rollout_id=calls[0].rollout_id,
        seg_parent=out["seg_parent"],
        seg_start=out["seg_start"],
        seg_len=out["seg_len"],
        seg_kind=out["seg_kind"],
        seg_depth=out["seg_depth"],
        tokens=out["tokens"],
        infer_logprobs=out["infer_logprobs"],
        token_call=out["token_call"],
        call_indices=call_index.astype(np.int32),
        end_node=out["end_node"],
        call_excluded=excluded.astype(bool),
        leaves=leaves,
        num_unique_tokens=int(out["num_unique_tokens"]),
        num_flat_tokens=int(out["num_flat_tokens"]),
        num_call_tokens=int(out["num_call_tokens"]),
        dropped=max_kept_leaves is not None and n_kept > max_kept_leaves,
    )

"""Sequences of a packed forest: sums along root-to-leaf paths without expanding the tree.

A packed batch stores each unique token once (rows in DFS order); a *sequence* is the root-to-leaf
path of one kept leaf of one rollout. Sequence-level quantities (the log importance ratio of a whole
sample, ...) are sums over the targets on that path, and must be brought back to the targets, where
a shared target lies on several paths.

``TreePaths.from_tree`` builds the index from PackedBatch arrays; ``TreePaths.from_sequences`` is
the flat-sequence form (each target belongs to exactly one sequence). Two operations:

- ``path_sum(x[M]) -> [L]``: for every leaf, the sum of ``x`` over the targets of its rollout whose
  predicted token lies on its root-to-leaf path.
- ``to_targets(y[L]) -> [M]``: for every target, the mean of ``y`` over the paths (leaves of its
  rollout) that contain its predicted token: the rule by which a shared token gets one value.

Both are O((M + L) log(M + L)): a DFS subtree is a contiguous row range [c, kv_end[c]], so "token
c is on the path to leaf l" is the interval test c <= l <= kv_end[c], answered for all pairs at
once with one sort, one prefix sum and binary searches (float64 sums). Guaranteed: exact path
membership, including merged forests where one row carries targets of several rollouts. Not
guaranteed: anything about rows whose subtree continues in another micro-batch (build the index on
the batch that holds whole subtrees, or on the unsplit forest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import check_1d, check_int, check_range


@dataclass(frozen=True)
class TreePaths:
    """Path index of a forest (fields are int64 tensors on one device).

    num_rows: N. target_child[M]: the row holding each target's predicted token.
    target_group[M] / leaf_group[L]: rollout of each target / leaf (paths never mix rollouts).
    subtree_end[N]: last row of each row's DFS subtree (PackedBatch.kv_end).
    leaf_rows[L]: last row of each kept leaf. parent_row[N]: for explicit walks (references).
    seq_ids[M]: flat form only (then the tree fields are None).
    """

    num_rows: int
    target_child: torch.Tensor | None
    target_group: torch.Tensor | None
    subtree_end: torch.Tensor | None
    leaf_rows: torch.Tensor | None
    leaf_group: torch.Tensor | None
    parent_row: torch.Tensor | None
    seq_ids: torch.Tensor | None = None
    num_seqs: int = 0

    @property
    def num_paths(self) -> int:
        return self.num_seqs if self.seq_ids is not None else int(self.leaf_rows.shape[0])

    @classmethod
    def from_sequences(cls, seq_ids: torch.Tensor, num_seqs: int | None = None) -> TreePaths:
        """Flat form: target m belongs to sequence ``seq_ids[m]`` (in [0, num_seqs))."""
        check_1d("seq_ids", seq_ids)
        check_int("seq_ids", seq_ids)
        seq = seq_ids.long()
        if num_seqs is None:
            num_seqs = int(seq.max()) + 1 if seq.numel() else 0
        check_range("seq_ids", seq, 0, max(num_seqs, 1) if seq.numel() else 1)
        return cls(0, None, None, None, None, None, None, seq, int(num_seqs))

    @classmethod
    def from_tree(cls, parent_row, input_ids, kv_end, target_rows, target_ids,
                  target_rollout=None, leaf_rows=None, leaf_rollout=None) -> TreePaths:
        """Index a packed forest (PackedBatch arrays as tensors; rollouts default to one).

        ``leaf_rows`` defaults to every row without a child. Raises ValueError when a target's
        token is not a child of its row, when a target has no leaf of its rollout below it, or
        when the arrays are inconsistent.
        """
        n = int(parent_row.shape[0])
        for name, t, ln in (("parent_row", parent_row, None), ("input_ids", input_ids, n),
                            ("kv_end", kv_end, n), ("target_rows", target_rows, None)):
            check_1d(name, t, ln)
            check_int(name, t)
        m = int(target_rows.shape[0])
        check_1d("target_ids", target_ids, m)
        check_int("target_ids", target_ids)
        for name, t in (("target_rollout", target_rollout), ("leaf_rows", leaf_rows), ("leaf_rollout", leaf_rollout)):
            if t is not None:
                check_int(name, t)
        dev = parent_row.device
        parent = parent_row.long()
        ids = input_ids.long()
        end = kv_end.long()
        rows_t = target_rows.long()
        tids = target_ids.long()
        check_range("parent_row", parent, -1, max(n, 1))
        if n and bool((parent >= torch.arange(n, device=dev)).any()):
            raise ValueError("parent_row must point to an earlier row (DFS order)")
        check_range("kv_end", end, 0, max(n, 1))
        if n and bool((end < torch.arange(n, device=dev)).any()):
            raise ValueError("kv_end[j] must be >= j")
        check_range("target_rows", rows_t, 0, max(n, 1))
        # Token ids key each child as row * width + id: a negative id (a -100 padding label) would
        # read as the previous row's child.
        all_ids = torch.cat([ids, tids])
        lo, hi = torch.stack(torch.aminmax(all_ids)).tolist() if (n + m) else (0, 0)  # one device read
        if lo < 0:
            name, t = ("input_ids", ids) if ids.numel() and int(ids.min()) < 0 else ("target_ids", tids)
            raise ValueError(f"{name} must be token ids (>= 0), got {int(t.min())}")
        group_t = (torch.zeros(m, dtype=torch.long, device=dev) if target_rollout is None
                   else target_rollout.long())
        check_1d("target_rollout", group_t, m)
        if leaf_rows is None:
            has_child = torch.zeros(n, dtype=torch.bool, device=dev)
            has_child[parent[parent >= 0]] = True
            leaf_rows = torch.nonzero(~has_child).view(-1)
        leaf = leaf_rows.long()
        check_range("leaf_rows", leaf, 0, max(n, 1))
        group_l = (torch.zeros(leaf.shape[0], dtype=torch.long, device=dev) if leaf_rollout is None
                   else leaf_rollout.long())
        check_1d("leaf_rollout", group_l, leaf.shape[0])

        # the child row of each target: the row whose (parent, token) is (target_row, target_id)
        width = int(hi) + 1
        has_parent = torch.nonzero(parent >= 0).view(-1)
        child_keys = parent[has_parent] * width + ids[has_parent]
        sorted_keys, perm = torch.sort(child_keys)
        want = rows_t * width + tids
        child = rows_t
        if m:
            if sorted_keys.numel() == 0:
                raise ValueError("targets given but no row has a parent: no token can be predicted")
            pos = torch.searchsorted(sorted_keys, want).clamp(max=sorted_keys.numel() - 1)
            found = sorted_keys[pos] == want
            if not bool(found.all()):
                bad = int(torch.nonzero(~found)[0])
                raise ValueError(f"target {bad}: row {int(rows_t[bad])} has no child with token "
                                 f"{int(tids[bad])}")
            child = has_parent[perm[pos]]

        paths = cls(n, child, group_t, end, leaf, group_l, parent)
        if m:
            counts = paths._leaf_range(child, end[child], group_t)[1]
            if bool((counts == 0).any()):
                bad = int(torch.nonzero(counts == 0)[0])
                raise ValueError(f"target {bad} (row {int(child[bad])}) has no kept leaf of its "
                                 "rollout below it")
        return paths

    # ------------------------------------------------------------------------------------------

    def _key(self, group: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # group-major position: paths of different rollouts occupy disjoint key ranges
        return group * (self.num_rows + 1) + pos

    def _leaf_range(self, lo_row, hi_row, group):
        """For each query, leaves of ``group`` with lo_row <= leaf row <= hi_row as (sorted index
        range start, count) into the leaves sorted by key."""
        lkeys, _ = torch.sort(self._key(self.leaf_group, self.leaf_rows))
        lo = torch.searchsorted(lkeys, self._key(group, lo_row), right=False)
        hi = torch.searchsorted(lkeys, self._key(group, hi_row), right=True)
        return lo, hi - lo

    def path_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[M] per-target values -> [L] sums along each path (float64 accumulation, x's dtype out)."""
        if self.seq_ids is not None:
            check_1d("x", x, self.seq_ids.shape[0])
            out = torch.zeros(self.num_seqs, dtype=torch.float64, device=x.device)
            return out.index_add_(0, self.seq_ids, x.double()).to(x.dtype)
        check_1d("x", x, self.target_child.shape[0])
        xd = x.double()
        # +x at the target's row, -x just past its subtree; a leaf inside [c, end] sees +x only
        keys = torch.cat([self._key(self.target_group, self.target_child),
                          self._key(self.target_group, self.subtree_end[self.target_child] + 1)])
        vals = torch.cat([xd, -xd])
        skeys, perm = torch.sort(keys, stable=True)
        csum = torch.cat([xd.new_zeros(1), torch.cumsum(vals[perm], 0)])
        q = torch.searchsorted(skeys, self._key(self.leaf_group, self.leaf_rows), right=True)
        return csum[q].to(x.dtype)

    def to_targets(self, y: torch.Tensor) -> torch.Tensor:
        """[L] per-path values -> [M]: each target gets the mean over the paths containing it."""
        if self.seq_ids is not None:
            check_1d("y", y, self.num_seqs)
            return y[self.seq_ids]
        check_1d("y", y, self.leaf_rows.shape[0])
        order = torch.argsort(self._key(self.leaf_group, self.leaf_rows))
        csum = torch.cat([y.new_zeros(1, dtype=torch.float64), torch.cumsum(y[order].double(), 0)])
        lo, count = self._leaf_range(self.target_child, self.subtree_end[self.target_child],
                                     self.target_group)
        return ((csum[lo + count] - csum[lo]) / count.clamp(min=1)).to(y.dtype)

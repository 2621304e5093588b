"""The tree mask of tree attention and its block schedules, and the rule that turns scores into weights.

`TreeMask` holds ``kv_end`` (checked once: key j is visible to query i iff ``j <= i <= kv_end[j]``),
the rows' depths and, per block size and sliding window, a `BlockSchedule`. Every backend of
`clawfast.kernels.tree_attention` reads the mask through these; one mask serves every layer of a model.

Block schedule: cut the rows into blocks of B. Key block kb holds a key visible to some query of query
block qb iff ``kb <= qb <= max(kv_end[kb-block]) // B`` (the key with the largest kv_end sees the
first row of every such block; no other block can see any key of kb). So each key block is seen by one
contiguous range of query blocks, and the schedule (the CSR list of key blocks per query block, and
the same pairs listed by key block) is built in O(N / B + pairs) without any [N, N] or [N/B, N/B]
tensor (only FlexAttention's ``BlockMask`` is a dense [N/128, N/128] index table, as flex requires).
A pair is *full* when every row of the query block sees every key of the key block; only the other,
*partial* pairs need the exact predicate, entry by entry. The cost follows the visible pairs (ancestor
counts), not N^2.

`Scores`: the options of HF decoders, along each path: a sliding ``window`` over depths (block pairs
out of every row's window dropped from the schedule), ``softcap``, attention dropout.

`PathSegments`: the mask as variable-length sequences (``TreeMask.path_segments``), what
flash-attention's varlen kernel takes. A *segment* is a maximal run of rows each the child of the
previous one; its queries are its rows and its keys are the path from the root down to its last row
(its first row's ancestors, then its own rows), so the queries are the keys' last rows and the
causal mask aligned to the bottom right is exactly the tree mask, a sliding window too (a key's
position in its sequence is its depth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import check_1d, check_int

# FlexAttention's default sparse block size.
_FLEX_BLOCK = 128


@dataclass(frozen=True)
class BlockSchedule:
    """The block pairs of a tree mask at one block size B and sliding window (tensors on kv_end's
    device; indices int32).

    kv_ptr[QB + 1], kv_partial_ptr[QB], kv_idx[P]: for query block qb, the key blocks
    ``kv_idx[kv_ptr[qb]:kv_ptr[qb+1]]`` that may hold a key visible to one of its rows. The *full*
    pairs (every row sees every key: every backend runs them without a mask) come first,
    ``kv_ptr[qb]:kv_partial_ptr[qb]``, then the partial ones (each part ascending, so the diagonal
    block is last): a kernel walks the two parts as two loops, the first without the mask's
    per-entry arithmetic.
    q_ptr[KB + 1], q_idx[P], q_partial_ptr[KB]: the same pairs by key block (full, then partial,
    query blocks ascending in each), for dK / dV.
    Without a window the listed pairs are exactly those with a visible key. A window drops the
    pairs where the depth ranges (of the key block, and of the query rows that can see it) keep
    every key out of every row's window; a listed pair may then still hide all its keys (the
    kernels allow that), and the full / partial split stays exact.
    """

    block: int
    window: int | None
    num_blocks: int
    kv_ptr: torch.Tensor
    kv_partial_ptr: torch.Tensor
    kv_idx: torch.Tensor
    q_ptr: torch.Tensor
    q_partial_ptr: torch.Tensor
    q_idx: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.kv_idx.shape[0])


def _ptr(owner: torch.Tensor, nb: int) -> torch.Tensor:
    """CSR row pointer of pairs sorted by ``owner`` (a block index per pair)."""
    ptr = torch.zeros(nb + 1, dtype=torch.int32, device=owner.device)
    ptr[1:] = torch.cumsum(torch.bincount(owner, minlength=nb), 0)
    return ptr


def _block_schedule(kv_end: torch.Tensor, depth: torch.Tensor | None, block: int, window: int | None) -> BlockSchedule:
    n = kv_end.shape[0]
    nb = (n + block - 1) // block
    dev = kv_end.device
    pad = nb * block - n

    def per_block(x, fill, reduce):
        return reduce(torch.nn.functional.pad(x, (0, pad), value=fill).view(nb, block), 1)

    ke = kv_end.long()
    blocks = torch.arange(nb, device=dev)
    kb_max = per_block(ke, -1, torch.amax)
    q_hi = kb_max // block
    # every row of query block qb sees every key of kb iff kb < qb <= full_hi[kb]: the smallest
    # kv_end of kb reaches the block's last row (the last block ends at row n - 1)
    last_row = torch.clamp((blocks + 1) * block, max=n) - 1
    full_hi = torch.minimum(torch.searchsorted(last_row, per_block(ke, n, torch.amin), right=True) - 1, q_hi)
    counts = q_hi - blocks + 1
    key_block = torch.repeat_interleave(blocks, counts)  # key-major, query blocks ascending
    first = torch.cumsum(counts, 0) - counts
    query_block = key_block + torch.arange(key_block.shape[0], device=dev) - first[key_block]
    full = (key_block < query_block) & (query_block <= full_hi[key_block])
    if window is not None:
        # a visible key j is in row i's window iff depth[i] - depth[j] < window (HF's
        # ``kv_idx > q_idx - sliding_window`` along the row's path). The rows of query block qb
        # that see any key of an earlier block kb are qb's first rows up to max(kv_end over kb):
        # their smallest depth is a prefix minimum within qb (tight where a block holds the end of
        # one path and the start of the next).
        d = depth.long()
        d_min, d_max = per_block(d, n, torch.amin), per_block(d, -1, torch.amax)
        prefix_min = torch.cummin(torch.nn.functional.pad(d, (0, pad), value=n).view(nb, block), 1).values.flatten()
        last_seeing = torch.minimum(kb_max[key_block], (query_block + 1) * block - 1)
        keep = prefix_min[last_seeing] - d_max[key_block] < window
        full &= d_max[query_block] - d_min[key_block] < window
        key_block, query_block, full = key_block[keep], query_block[keep], full[keep]
    # the pairs are key-major with query blocks ascending: a stable sort on (block, partial) keeps
    # each part ascending
    partial = (~full).long()
    by_query = torch.argsort(query_block * 2 + partial, stable=True)
    by_key = torch.argsort(key_block * 2 + partial, stable=True)
    kv_ptr, q_ptr = _ptr(query_block, nb), _ptr(key_block, nb)
    kv_partial_ptr = kv_ptr[:-1] + torch.bincount(query_block[full], minlength=nb)
    q_partial_ptr = q_ptr[:-1] + torch.bincount(key_block[full], minlength=nb)
    i32 = torch.int32
    return BlockSchedule(block, window, nb, kv_ptr, kv_partial_ptr.to(i32), key_block[by_query].to(i32),
                         q_ptr, q_partial_ptr.to(i32), query_block[by_key].to(i32))


class TreeMask:
    """The tree mask of one packed batch: ``kv_end`` (checked once) and its block schedules.

    Build it once per micro-batch and pass it to every layer's `tree_attention` call: the depths,
    the schedules and the FlexAttention block masks are computed on first use and cached (one per
    block size and window, so windowed and global layers of one model share a mask).
    """

    def __init__(self, kv_end: torch.Tensor):
        check_1d("kv_end", kv_end)
        check_int("kv_end", kv_end)
        n = kv_end.shape[0]
        if n == 0:
            raise ValueError("kv_end is empty: a tree batch has at least one row")
        rows = torch.arange(n, device=kv_end.device)
        bad = (kv_end < rows) | (kv_end >= n)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"kv_end[j] must lie in [j, N) for every row j (N = {n}); kv_end[{j}] = "
                             f"{int(kv_end[j])}")
        self.kv_end = kv_end.to(torch.int32).contiguous()
        self.num_rows = n
        self._depth: torch.Tensor | None = None
        self._max_depth: int | None = None
        self._schedules: dict[tuple[int, int | None], BlockSchedule] = {}
        self._host: dict[tuple[int, int | None], tuple[list[int], list[int], list[bool]]] = {}
        self._flex: dict[tuple[int | None, bool], object] = {}
        self._segments: PathSegments | None = None

    @property
    def device(self) -> torch.device:
        return self.kv_end.device

    def depth(self) -> torch.Tensor:
        """int32 [N]: each row's number of ancestors (its position in its path, from 0), cached."""
        if self._depth is None:
            n = self.num_rows
            # row j is an ancestor of rows j + 1 ..= kv_end[j]: +1 from j + 1, -1 after kv_end[j]
            diff = torch.zeros(n + 1, dtype=torch.long, device=self.device)
            ones = torch.ones(n, dtype=torch.long, device=self.device)
            diff.index_add_(0, torch.arange(1, n + 1, device=self.device), ones)
            diff.index_add_(0, self.kv_end.long() + 1, -ones)
            self._depth = torch.cumsum(diff, 0)[:n].to(torch.int32)
        return self._depth

    def max_depth(self) -> int:
        if self._max_depth is None:
            self._max_depth = int(self.depth().max())
        return self._max_depth

    def schedule(self, block: int, window: int | None = None) -> BlockSchedule:
        """The block pairs at block size ``block`` under a sliding ``window`` (None: none), cached."""
        key = (block, window)
        if key not in self._schedules:
            depth = None if window is None else self.depth()
            self._schedules[key] = _block_schedule(self.kv_end, depth, block, window)
        return self._schedules[key]

    def host_lists(self, block: int, window: int | None = None) -> tuple[list[int], list[int], list[int]]:
        """(kv_ptr, kv_partial_ptr, kv_idx) of ``schedule(block, window)`` as Python lists (the CPU
        path loops over them)."""
        key = (block, window)
        if key not in self._host:
            s = self.schedule(block, window)
            self._host[key] = (s.kv_ptr.tolist(), s.kv_partial_ptr.tolist(), s.kv_idx.tolist())
        return self._host[key]

    def path_segments(self) -> PathSegments:
        """The mask as variable-length sequences (`PathSegments`), cached; built on the host."""
        if self._segments is None:
            self._segments = _path_segments(self.kv_end, self.depth())
        return self._segments

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the mask allows: the sum over rows of (ancestors + 1)."""
        # row j is seen by kv_end[j] - j + 1 queries
        rows = torch.arange(self.num_rows, device=self.device)
        return int((self.kv_end.long() - rows + 1).sum())

    def mask_mod(self, window: int | None = None, sink_key: bool = False):
        """The predicate in FlexAttention's ``mask_mod`` signature; with `sink_key`, key row N (the
        sinks' virtual key, one past the last row) is seen by every query."""
        kv_end, last = self.kv_end, self.num_rows - 1
        depth = None if window is None else self.depth()

        def tree_mask_mod(b, h, q_idx, kv_idx):
            # flex may evaluate padding positions of a partial last block: keep the indices in range
            return (kv_idx <= q_idx) & (kv_end[torch.clamp(kv_idx, max=last)] >= q_idx)

        def windowed_tree_mask_mod(b, h, q_idx, kv_idx):
            in_window = depth[torch.clamp(q_idx, max=last)] - depth[torch.clamp(kv_idx, max=last)] < window
            return tree_mask_mod(b, h, q_idx, kv_idx) & in_window

        visible = tree_mask_mod if depth is None else windowed_tree_mask_mod
        if not sink_key:
            return visible

        def sink_key_mask_mod(b, h, q_idx, kv_idx):
            return visible(b, h, q_idx, kv_idx) | (kv_idx == last + 1)

        return sink_key_mask_mod

    def flex_block_mask(self, window: int | None = None, sink_key: bool = False):
        """``schedule(128, window)`` as a FlexAttention ``BlockMask`` (partial and full blocks), cached.
        With `sink_key` the keys are N + 1 rows: the sinks' virtual key N joins every query block's
        list (as a partial block, unless the block holding it is listed already)."""
        if (window, sink_key) not in self._flex:
            from torch.nn.attention.flex_attention import BlockMask

            s = self.schedule(_FLEX_BLOCK, window)
            nb = s.num_blocks
            num_keys = self.num_rows + sink_key
            key_blocks = -(-num_keys // _FLEX_BLOCK)
            qb, kb = _pairs(s)
            full = torch.arange(s.num_pairs, device=self.device) < s.kv_partial_ptr[qb]
            if sink_key:
                sink_block = self.num_rows // _FLEX_BLOCK
                listed = torch.zeros(nb, key_blocks, dtype=torch.bool, device=self.device)
                listed[qb, kb] = True
                extra = torch.nonzero(~listed[:, sink_block])[:, 0]
                order = torch.argsort(torch.cat([qb, extra]), stable=True)
                qb = torch.cat([qb, extra])[order]
                kb = torch.cat([kb, torch.full_like(extra, sink_block)])[order]
                full = torch.cat([full, torch.zeros_like(extra, dtype=torch.bool)])[order]
            parts = []
            for sel in (~full, full):
                q_sel, k_sel = qb[sel], kb[sel]
                counts = torch.bincount(q_sel, minlength=nb)
                start = torch.cumsum(counts, 0) - counts
                rank = torch.arange(q_sel.shape[0], device=self.device) - start[q_sel]
                idx = torch.zeros(nb, key_blocks, dtype=torch.int32, device=self.device)
                idx[q_sel, rank] = k_sel.to(torch.int32)
                parts += [counts.to(torch.int32)[None, None], idx[None, None]]
            self._flex[(window, sink_key)] = BlockMask.from_kv_blocks(
                *parts, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=self.mask_mod(window, sink_key),
                seq_lengths=(self.num_rows, num_keys))
        return self._flex[(window, sink_key)]


@dataclass(frozen=True)
class PathSegments:
    """The tree mask as variable-length sequences (module docstring), on kv_end's device.

    cu_q int32 [S + 1]: segment s holds the query rows ``cu_q[s]:cu_q[s+1]`` (in row order, so the
    queries need no gathering); key_rows int64 [K] and cu_k int32 [S + 1]: segment s's key rows are
    ``key_rows[cu_k[s]:cu_k[s+1]]``, root first; max_q / max_k: the longest of each. ``K`` is the
    rows gathered for the keys: N plus each segment's ancestors (``gathered_rows``). Only a forest
    has them: a ``kv_end`` whose intervals do not nest is a ValueError."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    key_rows: torch.Tensor
    max_q: int
    max_k: int

    @property
    def gathered_rows(self) -> int:
        return int(self.key_rows.shape[0])


def _path_segments(kv_end: torch.Tensor, depth: torch.Tensor) -> PathSegments:
    kv_end_h, depth_h = kv_end.cpu().long(), depth.cpu().long()
    n = kv_end_h.shape[0]
    rows = torch.arange(n)
    # row i continues its predecessor's segment iff row i - 1 is its ancestor (then its parent: DFS order)
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), kv_end_h[:-1] < rows[1:]]))[:, 0]
    ends = torch.cat([starts[1:], torch.tensor([n])])
    q_lengths = ends - starts
    segment = torch.repeat_interleave(torch.arange(starts.shape[0]), q_lengths)
    # A mask whose intervals do not nest is no forest (TreeMask takes it; the other backends compute
    # it as given): each row's visible keys would not be one path. Its rows' depths step by more than
    # one inside a segment, or a segment's last row does not see one of its keys (checked below).
    stepped = torch.nonzero(depth_h != depth_h[starts][segment] + rows - starts[segment])
    if stepped.numel():
        raise ValueError(_NOT_A_FOREST.format(row=int(stepped[0, 0])))
    # the path from the root to the row last visited: at a segment's first row, its first depth
    # entries are that row's ancestors (every row visited since its parent is deeper than its parent)
    path = torch.full((int(depth_h.max()) + 1,), -1, dtype=torch.long)
    keys = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        top = int(depth_h[a])
        path[top:top + b - a] = rows[a:b]
        keys.append(path[:top + b - a].clone())
    k_lengths = torch.tensor([len(k) for k in keys])
    key_rows = torch.cat(keys)
    last_row = torch.repeat_interleave(ends - 1, k_lengths)
    unseen = torch.nonzero((key_rows < 0) | (kv_end_h[key_rows.clamp(min=0)] < last_row))
    if unseen.numel():
        raise ValueError(_NOT_A_FOREST.format(row=int(last_row[unseen[0, 0]])))
    device = kv_end.device
    return PathSegments(cu_q=_offsets(q_lengths).to(device, torch.int32),
                        cu_k=_offsets(k_lengths).to(device, torch.int32), key_rows=key_rows.to(device),
                        max_q=int(q_lengths.max()), max_k=int(k_lengths.max()))


_NOT_A_FOREST = ("kv_end is not a forest in DFS order (row {row}'s visible keys are not one path from a root): "
                 "path segments need one; backends 'torch', 'triton' and 'flex' take any kv_end")


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])


def _pairs(s: BlockSchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """(query block, key block) of every listed pair, sorted by query block."""
    counts = (s.kv_ptr[1:] - s.kv_ptr[:-1]).long()
    qb = torch.repeat_interleave(torch.arange(s.num_blocks, device=counts.device), counts)
    return qb, s.kv_idx.long()


@dataclass(frozen=True)
class Scores:
    """How a layer turns q.k into attention weights: the ``scale``; an optional sliding ``window``
    (keys fewer than ``window`` rows up the query's path); an optional ``softcap`` (``softcap *
    tanh(score / softcap)``, Gemma 2); attention dropout with probability ``dropout_p``, its mask a
    function of ``seed`` and the entry (`dropout_keep`)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    dropout_p: float = 0.0
    seed: int = 0

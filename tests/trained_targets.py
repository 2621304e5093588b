"""What a step must train, read from the records, and what it packs, read from the micro-batches,
in one form: (depth, hash of the token's whole path), so the two compare exactly whatever the tree's
layout. Used by tests/train/test_train_threads.py and tests/harness/test_side_calls.py."""

from __future__ import annotations

import numpy as np

from clawfast.records import RolloutResult

_P = (1 << 61) - 1


def _path_keys(tokens) -> list[int]:
    """A rolling hash of every prefix of `tokens` (entry i: the prefix ending with token i)."""
    out, h = [], 0
    for t in np.asarray(tokens).tolist():
        h = (h * 1_000_003 + t + 1) % _P
        out.append(h)
    return out


def expected_targets(rollout: RolloutResult, kinds: list[str], trained) -> set[tuple[int, int]]:
    """(depth, prefix hash) of every output token of the calls whose kind is trained: what the packed
    targets must be, each exactly once (a token several trained calls generated at one place, once)."""
    out = set()
    for c in rollout.calls:
        if kinds[c.call_index] in trained:
            keys = _path_keys(np.concatenate([c.prompt_ids, c.output_ids]))
            out |= {(d, keys[d]) for d in range(len(c.prompt_ids), len(keys))}
    return out


def packed_targets(data, g: int) -> list[tuple[int, int]]:
    """(depth, prefix hash) of each packed target of rollout g, its prefix read from the batch's rows."""
    out = []
    for b in data.batches:
        parent, ids = b.parent_row.tolist(), b.input_ids.tolist()
        keys: list[int] = []
        for row in range(len(ids)):  # rows are in DFS order: a parent comes first
            up = keys[parent[row]] if parent[row] >= 0 else 0
            keys.append((up * 1_000_003 + ids[row] + 1) % _P)
        for m in np.flatnonzero(b.target_rollout == g):
            r = int(b.target_rows[m])
            out.append((int(b.position_ids[r]) + 1, (keys[r] * 1_000_003 + int(b.target_ids[m]) + 1) % _P))
    return out

"""`continuity`: the prefix report of `clawfast harness check`, against a plain reference on random
token sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from clawfast.rollout.check import continuity
from clawfast.records import CallRecord

ids = st.lists(st.integers(0, 5), min_size=1, max_size=12)


def call(i: int, prompt, output, tags=("main",)) -> CallRecord:
    return CallRecord("r", i, "h", np.array(prompt), np.array(output), -np.ones(len(output)), tags=tags)


def shared_ref(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def contains_ref(hay: list[int], needle: list[int]) -> bool:
    return any(hay[i : i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))


@settings(max_examples=200, deadline=None)
@given(p0=ids, o0=ids, p1=ids, o1=ids, extend=st.booleans())
def test_matches_reference(p0, o0, p1, o1, extend):
    if extend:  # the usual case: the next prompt is the previous path plus tool results
        p1 = p0 + o0 + p1
    [pair] = continuity([call(0, p0, o0), call(1, p1, o1)])
    assert pair.path == len(p0) + len(o0)
    assert pair.shared == shared_ref(p0 + o0, p1)
    assert pair.exact == (p1[: len(p0 + o0)] == p0 + o0)
    assert pair.output_kept == contains_ref(p1, o0)
    if extend:
        assert pair.exact and pair.output_kept


def test_excluded_calls_are_skipped_and_values_are_not_byte_aligned_by_accident():
    # 256 = 0x100 and 1 share bytes in int32; a match must start on a token boundary.
    main0 = call(0, [7, 8], [256])
    title = call(1, [1, 2], [3], tags=("title",))
    main2 = call(2, [0, 1, 0, 0, 0], [9])  # bytes 01 00 00 00 00 ... contain 00 01 00 00 misaligned
    pairs = continuity([main2, title, main0])
    assert [(p.first, p.second) for p in pairs] == [(0, 2)]
    assert pairs[0].shared == 0 and not pairs[0].output_kept

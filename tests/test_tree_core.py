"""Hand-built cases for the C++ prefix tree, leaf filter and packer (docs/TREE.md).

Each case spells out the expected arrays, so a wrong boundary, owner, status or row fails here
without needing the plain-Python references (those are compared on random inputs elsewhere).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from clawfast import _core
from clawfast.pack import pack, pack_stats
from clawfast.records import CallRecord
from clawfast.tree import Leaf, build_tree


def call(index, prompt, output, *, tags=("main",), rollout="r0", logprobs=None):
    if logprobs is None:  # distinct, recognisable logprobs: -(index + position / 100)
        logprobs = [-(index + (k + 1) / 100) for k in range(len(output))]
    return CallRecord(rollout, index, "test", np.array(prompt), np.array(output), np.array(logprobs), tags=tags)


def lp(index, k):
    return np.float32(-(index + (k + 1) / 100))


NAN = np.nan


def assert_tree(tree, **expected):
    for name, want in expected.items():
        got = getattr(tree, name)
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype), err_msg=name)
        else:
            assert got == want, name


# ----------------------------------------------------------------------------------------------
# Tree


def test_multi_turn_with_tool_result_gaps():
    calls = [
        call(0, [10, 11, 12], [20, 21]),
        call(1, [10, 11, 12, 20, 21, 30, 31], [22]),  # 30, 31: a tool result
        call(2, [10, 11, 12, 20, 21, 30, 31, 22, 32], [23, 24]),
    ]
    tree = build_tree(calls)
    assert_tree(
        tree,
        seg_parent=[-1, 0, 1, 2, 3, 4],
        seg_start=[0, 3, 5, 7, 8, 9],
        seg_len=[3, 2, 2, 1, 1, 2],
        seg_kind=[0, 1, 0, 1, 0, 1],
        seg_depth=[0, 3, 5, 7, 8, 9],
        tokens=[10, 11, 12, 20, 21, 30, 31, 22, 32, 23, 24],
        token_call=[-1, -1, -1, 0, 0, -1, -1, 1, -1, 2, 2],
        call_indices=[0, 1, 2],
        end_node=[1, 3, 5],
        call_excluded=[False, False, False],
        num_unique_tokens=11,
        num_flat_tokens=11,
        num_call_tokens=5 + 8 + 11,
        dropped=False,
    )
    want_lp = [NAN] * 3 + [lp(0, 0), lp(0, 1)] + [NAN] * 2 + [lp(1, 0)] + [NAN] + [lp(2, 0), lp(2, 1)]
    np.testing.assert_array_equal(tree.infer_logprobs, np.array(want_lp, np.float32))
    assert tree.leaves == [Leaf(node=5, depth=11, calls=(2,), status="kept")]
    assert tree.tokens.dtype == np.int32 and tree.infer_logprobs.dtype == np.float32
    assert tree.seg_kind.dtype == np.int8 and tree.seg_parent.dtype == np.int32


def test_retry_kills_the_older_answer():
    prompt = [1, 2, 3]
    calls = [
        call(0, prompt, [5, 6]),  # answer the harness threw away
        call(1, prompt, [7]),  # same prompt again: a retry
        call(2, prompt + [7, 40], [8]),
    ]
    tree = build_tree(calls)
    assert_tree(
        tree,
        seg_parent=[-1, 0, 0, 2, 3],
        seg_len=[3, 2, 1, 1, 1],
        seg_kind=[0, 1, 1, 0, 1],
        tokens=[1, 2, 3, 5, 6, 7, 40, 8],
        token_call=[-1, -1, -1, 0, 0, 1, -1, 2],
        end_node=[1, 2, 4],
        num_flat_tokens=6,
    )
    assert tree.leaves == [Leaf(1, 5, (0,), "dead"), Leaf(4, 6, (2,), "kept")]

    kept_all = build_tree(calls, drop_dead=False)
    assert [leaf.status for leaf in kept_all.leaves] == ["kept", "kept"]
    assert kept_all.num_flat_tokens == 5 + 6



@pytest.mark.parametrize("retry_output", [[7, 8], []], ids=["prefix", "empty"])
def test_a_last_retry_that_answered_less_keeps_its_path(retry_output):
    # The last call retries call 1 and answers a prefix of call 1's answer (cut at its token limit)
    # or nothing: its end lies inside call 1's path. That path's dead remainder must not take the
    # rollout's trainable tokens (call 0's answer, and the retry's own) with it.
    calls = [
        call(0, [1, 2], [3, 4]),
        call(1, [1, 2, 3, 4, 5], [7, 8, 9]),
        call(2, [1, 2, 3, 4, 5], retry_output),
    ]
    tree = build_tree(calls)
    retry_end = 5 + len(retry_output)
    assert [(lf.depth, lf.calls, lf.status) for lf in tree.leaves] == [(retry_end, (2,), "kept"), (8, (1,), "dead")]
    assert tree.num_flat_tokens == retry_end
    # the path to the kept leaf: call 0's answer (and the retry's, owned by call 1 which sampled
    # the same tokens first) are trainable; call 1's remainder is not
    batch, = pack([tree], 64)
    assert sorted(batch.target_ids[batch.loss_mask > 0].tolist()) == sorted([3, 4] + retry_output)
    # without dropping retries, call 1's whole answer is a kept leaf and the retry's end inside it
    assert [(lf.depth, lf.status) for lf in build_tree(calls, drop_dead=False).leaves] == [(8, "kept")]

def test_identical_regeneration_shares_one_kept_leaf():
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2], [3, 4])]
    tree = build_tree(calls)
    # Same path twice: one leaf holding both calls; the last main call keeps it alive and owns it.
    assert tree.leaves == [Leaf(1, 4, (0, 1), "kept")]
    assert_tree(tree, token_call=[-1, -1, 1, 1], end_node=[1, 1], num_call_tokens=8)
    np.testing.assert_array_equal(tree.infer_logprobs[2:], [lp(1, 0), lp(1, 1)])


def test_last_main_call_is_never_dead():
    calls = [
        call(0, [1, 2], [3]),
        call(1, [1, 2], [9, 9], tags=("title",)),  # later call, same prompt, but excluded
    ]
    tree = build_tree(calls)
    assert tree.leaves == [Leaf(1, 3, (0,), "kept"), Leaf(2, 4, (1,), "excluded")]


def test_history_edit_branch_keeps_both():
    calls = [
        call(0, [1, 2, 3], [4]),
        call(1, [1, 2, 3, 4, 50], [5]),  # tool result 50, answer 5
        call(2, [1, 2, 3, 60], [6]),  # history edited: the turn 4/50/5 is replaced by a summary 60
    ]
    tree = build_tree(calls)
    assert_tree(
        tree,
        seg_parent=[-1, 0, 1, 2, 0, 4],
        tokens=[1, 2, 3, 4, 50, 5, 60, 6],
        seg_kind=[0, 1, 0, 1, 0, 1],
        end_node=[1, 3, 5],
    )
    assert [leaf.status for leaf in tree.leaves] == ["kept", "kept"]
    assert [leaf.calls for leaf in tree.leaves] == [(1,), (2,)]
    assert tree.num_flat_tokens == 6 + 5


def test_generated_wins_and_the_latest_call_owns():
    calls = [
        call(0, [1, 2], [3, 4]),
        call(1, [1, 2, 3], [4, 9]),  # 3 is context for call 1 but call 0 generated it; both drew 4
    ]
    tree = build_tree(calls)
    # The kept path is call 1's: its 9 follows its own 4, so the 4 is trained with call 1's log-prob.
    assert_tree(
        tree,
        seg_parent=[-1, 0, 1, 2],
        seg_len=[2, 1, 1, 1],
        seg_kind=[0, 1, 1, 1],
        token_call=[-1, -1, 0, 1, 1],
        end_node=[2, 3],
    )
    np.testing.assert_array_equal(tree.infer_logprobs[2:], [lp(0, 0), lp(1, 0), lp(1, 1)])


def test_a_kept_retry_owns_what_it_drew_like_the_call_it_retried():
    """A retry (same prompt) after a weight push drew the dead call's first two tokens again, then
    others: the kept path is the retry's sample, so its tokens carry the retry's log-probs and
    call (the dead call's were the sampler's of another version: every IS weight off)."""
    calls = [call(0, [1, 2, 3], [7, 8, 9]), call(1, [1, 2, 3], [7, 8, 5, 6])]
    tree = build_tree(calls)
    assert [lf.status for lf in tree.leaves] == ["kept", "dead"]
    kept = pack([tree], 64)[0]
    assert kept.target_ids.tolist() == [7, 8, 5, 6] and kept.target_call.tolist() == [1, 1, 1, 1]
    np.testing.assert_array_equal(kept.infer_logprobs, [lp(1, k) for k in range(4)])


def test_a_main_call_trains_what_an_excluded_call_drew_alike():
    """An excluded call (a quota probe) and the main call asked the same prompt and drew the same
    first token: the main call owns it, so it is trained; owned by the excluded call it was not."""
    calls = [call(0, [1, 2, 3], [7], tags=("quota",)), call(1, [1, 2, 3], [7, 8, 9])]
    batch = pack([build_tree(calls)], 64)[0]
    assert batch.target_ids.tolist() == [7, 8, 9] and batch.target_call.tolist() == [1, 1, 1]


def test_subagent_branch_is_excluded():
    calls = [
        call(0, [1, 2, 3], [4]),
        call(1, [1, 2, 9], [5, 6], tags=("subagent",)),
        call(2, [1, 2, 3, 4, 7], [8]),
    ]
    tree = build_tree(calls)
    assert_tree(tree, tokens=[1, 2, 3, 4, 7, 8, 9, 5, 6], seg_parent=[-1, 0, 1, 2, 3, 0, 5],
                call_excluded=[False, True, False])
    assert [(leaf.calls, leaf.status) for leaf in tree.leaves] == [((2,), "kept"), ((1,), "excluded")]
    # Excluding nothing makes the subagent branch a kept leaf.
    assert [leaf.status for leaf in build_tree(calls, exclude_tags=()).leaves] == ["kept", "kept"]


def test_out_of_order_arrival_and_index_gaps():
    calls = [
        call(0, [1, 2], [3]),
        call(3, [1, 2, 3, 4], [5, 6]),
        call(7, [1, 2], [8]),
        call(9, [1, 2, 3, 4, 5, 6, 7], [2], tags=("compaction",)),
    ]
    want = build_tree(calls)
    for seed in range(5):
        shuffled = calls[:]
        random.Random(seed).shuffle(shuffled)
        got = build_tree(shuffled)
        for name in ("seg_parent", "seg_start", "seg_len", "seg_kind", "seg_depth", "tokens", "token_call",
                     "call_indices", "end_node", "call_excluded"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        np.testing.assert_array_equal(got.infer_logprobs, want.infer_logprobs)
        assert got.leaves == want.leaves
    np.testing.assert_array_equal(want.call_indices, [0, 3, 7, 9])
    assert want.token_call.tolist() == [-1, -1, 0, -1, 3, 3, -1, 9, 7]
    # Call 0 is retried by call 7 (same prompt [1, 2]), but call 3 (main) ends below it: not a leaf.
    # Call 9 (compaction) ends below call 3, but an excluded call below does not take call 3's leaf:
    # call 3's end node is a kept leaf, call 9's an excluded one below it; call 7's leaf is kept.
    assert [(leaf.calls, leaf.status) for leaf in want.leaves] == [((3,), "kept"), ((9,), "excluded"), ((7,), "kept")]
    assert [leaf.node for leaf in want.leaves] == [3, 5, 6]  # call 3's leaf [5, 6] has children


def test_compaction_after_main_calls_keeps_the_main_path_trainable():
    # Main turns, then a compaction (whole history + a "summarise" request 90, tagged compaction),
    # then the thread restarts from system prompt + summary.
    calls = [
        call(0, [1, 2], [3]),
        call(1, [1, 2, 3, 40], [4]),
        call(2, [1, 2, 3, 40, 4, 90], [70, 71], tags=("compaction",)),
        call(3, [1, 2, 70, 71], [5]),
    ]
    tree = build_tree(calls)
    assert_tree(
        tree,
        tokens=[1, 2, 3, 40, 4, 90, 70, 71, 70, 71, 5],
        seg_parent=[-1, 0, 1, 2, 3, 4, 0, 6],
        seg_kind=[0, 1, 0, 1, 0, 1, 0, 1],
        end_node=[1, 3, 5, 7],
        num_flat_tokens=5 + 5,
    )
    # Call 1's end node [4] has the compaction below it and is still a kept leaf (before this rule,
    # the compaction took the leaf and tokens 3 and 4 were not trainable).
    assert tree.leaves == [Leaf(3, 5, (1,), "kept"), Leaf(5, 8, (2,), "excluded"), Leaf(7, 5, (3,), "kept")]
    (batch,) = pack([tree], 16)
    # The compaction's own tokens (90 and its summary) stay out of the kept set.
    assert batch.input_ids.tolist() == [1, 2, 3, 40, 4, 70, 71, 5]
    assert batch.target_ids.tolist() == [3, 4, 5] and batch.target_call.tolist() == [0, 1, 3]
    check_pack([tree], [batch])


def test_subagent_extending_the_main_path_does_not_steal_the_leaf():
    main = [call(0, [1, 2], [3, 4])]
    sub = call(1, [1, 2, 3, 4, 8], [9], tags=("subagent",))  # delegated from the main thread's last turn
    tree = build_tree(main + [sub])
    assert tree.leaves == [Leaf(1, 4, (0,), "kept"), Leaf(3, 6, (1,), "excluded")]
    (batch,) = pack([tree], 8)
    assert batch.input_ids.tolist() == [1, 2, 3, 4] and batch.target_ids.tolist() == [3, 4]
    # A main call below the subagent still takes the leaf: only excluded calls are ignored.
    later = call(2, [1, 2, 3, 4, 8, 9, 6], [7])
    tree = build_tree(main + [sub, later])
    assert [(leaf.calls, leaf.status) for leaf in tree.leaves] == [((2,), "kept")]
    # An excluded call ending at an excluded call's end node with something below: not a leaf.
    tree = build_tree([call(0, [1], [2], tags=("title",)), call(1, [1, 2, 3], [4], tags=("quota",))])
    assert [(leaf.calls, leaf.status) for leaf in tree.leaves] == [((1,), "excluded")]


def test_main_and_excluded_call_ending_at_one_node():
    # A main call and a title call end at the same node; a subagent continues below it. The node
    # follows the main rule (a leaf: only an excluded call below) and is kept (not all excluded).
    calls = [
        call(0, [1, 2], [3]),
        call(1, [1, 2], [3], tags=("title",)),
        call(2, [1, 2, 3, 5], [6], tags=("subagent",)),
    ]
    tree = build_tree(calls)
    assert tree.leaves == [Leaf(1, 3, (0, 1), "kept"), Leaf(3, 5, (2,), "excluded")]
    # The same with the main call retried by a later main call: the retry's answer takes the path.
    retried = calls + [call(3, [1, 2], [7])]
    assert [(lf.calls, lf.status) for lf in build_tree(retried).leaves] == [
        ((0, 1), "dead"), ((2,), "excluded"), ((3,), "kept")]


def test_max_kept_leaves_drops_tree():
    calls = [call(0, [1], [2]), call(1, [1, 2, 3], [4]), call(2, [1, 5], [6])]
    assert not build_tree(calls, max_kept_leaves=2).dropped
    tree = build_tree(calls, max_kept_leaves=1)
    assert tree.dropped and [leaf.status for leaf in tree.leaves] == ["kept", "kept"]


def _bad(mutate):
    c = call(0, [1, 2], [3])
    mutate(c)
    return [c]


@pytest.mark.parametrize(
    "calls",
    [
        [],
        [call(0, [1], [2], rollout="a"), call(1, [1], [2], rollout="b")],
        [call(0, [1], [2]), call(0, [1, 2], [3])],
        _bad(lambda c: setattr(c, "prompt_ids", np.array([1, -2], np.int32))),
        _bad(lambda c: setattr(c, "output_ids", np.array([3.5]))),
        _bad(lambda c: setattr(c, "infer_logprobs", np.array([-0.1, -0.2], np.float32))),
        _bad(lambda c: setattr(c, "infer_logprobs", np.array([np.nan], np.float32))),
        _bad(lambda c: setattr(c, "prompt_ids", np.zeros(0, np.int32))),
        _bad(lambda c: setattr(c, "prompt_ids", np.ones((1, 2), np.int32))),
        _bad(lambda c: setattr(c, "call_index", -1)),
        _bad(lambda c: setattr(c, "call_index", "0")),
        ["not a call"],
    ],
    ids=["empty", "mixed-rollouts", "duplicate-index", "negative-id", "float-ids", "logprob-length",
         "nan-logprob", "empty-prompt", "2d-prompt", "negative-call-index", "str-call-index", "not-a-record"],
)
def test_malformed_calls_raise_value_error(calls):
    with pytest.raises(ValueError):
        build_tree(calls)


def test_bad_max_kept_leaves():
    with pytest.raises(ValueError):
        build_tree([call(0, [1], [2])], max_kept_leaves=-1)


def _core_args(**override):
    args = dict(
        ids=np.array([1, 2, 3, 1, 2, 3, 4], np.int32),
        path_off=np.array([0, 3, 7], np.int64),
        prompt_len=np.array([2, 3], np.int64),
        infer_logprobs=np.array([-0.1, -0.2], np.float32),
        call_index=np.array([0, 1], np.int64),
        excluded=np.array([0, 0], np.uint8),
        drop_dead=True,
    )
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override",
    [
        {"path_off": np.array([0, 3, 8], np.int64)},
        {"path_off": np.array([1, 3, 7], np.int64)},
        {"path_off": np.array([0, 8, 7], np.int64)},
        {"prompt_len": np.array([0, 3], np.int64)},
        {"prompt_len": np.array([4, 3], np.int64)},
        {"infer_logprobs": np.array([-0.1], np.float32)},
        {"call_index": np.array([1, 1], np.int64)},
        {"call_index": np.array([-1, 1], np.int64)},
        {"ids": np.array([1, 2, -3, 1, 2, 3, 4], np.int32)},
        {"excluded": np.array([0], np.uint8)},
        {"ids": np.ones((7, 1), np.int32)},
        {"prompt_len": np.zeros(0, np.int64), "path_off": np.zeros(1, np.int64), "call_index": np.zeros(0, np.int64),
         "excluded": np.zeros(0, np.uint8), "ids": np.zeros(0, np.int32), "infer_logprobs": np.zeros(0, np.float32)},
    ],
)
def test_core_build_rejects_inconsistent_buffers(override):
    assert _core.build_tree(**_core_args())["tokens"].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        _core.build_tree(**_core_args(**override))


# ----------------------------------------------------------------------------------------------
# Packer


def row_paths(batch):
    """Token path (root first) of every row, rebuilt from parent_row."""
    paths = []
    for i, parent in enumerate(batch.parent_row.tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (int(batch.input_ids[i]),))
    return paths


def check_batch(batch):
    """Structural invariants of one micro-batch."""
    n = batch.num_tokens
    assert len(batch.input_ids) == n <= batch.micro_batch_tokens
    assert batch.fill == n / batch.micro_batch_tokens
    parent = batch.parent_row
    for i in range(n):
        assert parent[i] < i
        want_pos = 0 if parent[i] < 0 else batch.position_ids[parent[i]] + 1
        assert batch.position_ids[i] == want_pos
    kv_end = np.arange(n)
    for i in reversed(range(n)):  # the last row of each subtree, pushed up to the parents
        if parent[i] >= 0:
            kv_end[parent[i]] = max(kv_end[parent[i]], kv_end[i])
    np.testing.assert_array_equal(batch.kv_end, kv_end)
    for i in range(n):  # DFS order: every subtree is the contiguous range [i, kv_end[i]]
        inside = [j for j in range(i, kv_end[i] + 1)]
        for j in inside[1:]:
            assert parent[j] >= i
    assert not batch.is_context[batch.target_rows].any()
    assert not batch.is_context[batch.leaf_rows].any()
    keys = list(zip(batch.target_rows.tolist(), batch.target_ids.tolist(), batch.target_rollout.tolist()))
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    np.testing.assert_array_equal(batch.loss_mask, 1.0)
    np.testing.assert_array_equal(batch.weight, 1.0)


def expected_targets(trees):
    """{(rollout, token path): (call, logprob, leaf)} for every trainable token, straight from the trees."""
    want = {}
    for r, tree in enumerate(trees):
        if tree.dropped:
            continue
        excluded = set(tree.call_indices[tree.call_excluded].tolist())
        path_of = {}
        first_leaf = {}
        for li, leaf in enumerate(tree.leaves):
            if leaf.status != "kept":
                continue
            s = leaf.node
            while s >= 0:
                first_leaf.setdefault(s, li)
                s = int(tree.seg_parent[s])
        for s in range(tree.num_segments):
            p = int(tree.seg_parent[s])
            a, n = int(tree.seg_start[s]), int(tree.seg_len[s])
            base = path_of[p] if p >= 0 else ()
            for t in range(a, a + n):
                base = base + (int(tree.tokens[t]),)
                if s in first_leaf and tree.seg_kind[s] == 1 and int(tree.token_call[t]) not in excluded:
                    want[(r, base)] = (int(tree.token_call[t]), float(tree.infer_logprobs[t]), first_leaf[s])
            path_of[s] = base
    return want


def check_pack(trees, batches):
    """Every trainable token is exactly one target, with its own tree's call, logprob and leaf; every
    kept path appears exactly once as a non-context row."""
    got = {}
    rows = []
    for batch in batches:
        check_batch(batch)
        paths = row_paths(batch)
        rows += [p for p, ctx in zip(paths, batch.is_context) if not ctx]
        for k in range(len(batch.target_ids)):
            key = (int(batch.target_rollout[k]), paths[batch.target_rows[k]] + (int(batch.target_ids[k]),))
            assert key not in got, key
            got[key] = (int(batch.target_call[k]), float(batch.infer_logprobs[k]), int(batch.target_leaf[k]))
    assert got == expected_targets(trees)
    assert len(rows) == len(set(rows))
    kept_paths = set()
    for tree in trees:
        if tree.dropped:
            continue
        for leaf in tree.leaves:
            if leaf.status == "kept":
                path = path_to(tree, leaf.node)
                kept_paths.update(path[:k] for k in range(1, len(path) + 1))
    assert set(rows) == kept_paths


def path_to(tree, seg):
    chain = []
    while seg >= 0:
        chain.append(seg)
        seg = int(tree.seg_parent[seg])
    return tuple(t for s in reversed(chain) for t in tree.tokens[tree.seg_start[s]: tree.seg_start[s] + tree.seg_len[s]].tolist())


def test_pack_single_tree_rows_and_targets():
    tree = build_tree([
        call(0, [10, 11, 12], [20, 21]),
        call(1, [10, 11, 12, 20, 21, 30, 31], [22]),
        call(2, [10, 11, 12, 20, 21, 30, 31, 22, 32], [23, 24]),
    ])
    (batch,) = pack([tree], 16, rewards=[0.5])
    np.testing.assert_array_equal(batch.input_ids, tree.tokens)
    np.testing.assert_array_equal(batch.position_ids, np.arange(11))
    np.testing.assert_array_equal(batch.parent_row, np.arange(11) - 1)
    np.testing.assert_array_equal(batch.kv_end, np.full(11, 10))
    np.testing.assert_array_equal(batch.target_rows, [2, 3, 6, 8, 9])
    np.testing.assert_array_equal(batch.target_ids, [20, 21, 22, 23, 24])
    np.testing.assert_array_equal(batch.target_call, [0, 0, 1, 2, 2])
    np.testing.assert_array_equal(batch.infer_logprobs, [lp(0, 0), lp(0, 1), lp(1, 0), lp(2, 0), lp(2, 1)])
    np.testing.assert_array_equal(batch.target_rollout, 0)
    np.testing.assert_array_equal(batch.target_leaf, 0)
    np.testing.assert_array_equal(batch.target_reward, 0.5)
    assert batch.leaf_rows.tolist() == [10] and batch.leaf_rollout.tolist() == [0] and batch.leaf_index.tolist() == [0]
    assert batch.num_tokens == 11 and batch.fill == 11 / 16 and not batch.is_context.any()
    check_pack([tree], [batch])


def test_pack_skips_dead_and_excluded_tokens():
    tree = build_tree([
        call(0, [1, 2], [3]),  # title call: generates 3, which the main thread then carries as context
        call(1, [1, 2, 3, 4], [5, 6], tags=("main",)),
        call(2, [1, 2, 3, 4], [7]),  # retry of call 1: call 1's leaf is dead
        call(3, [1, 2, 3, 9], [8], tags=("subagent",)),
    ])
    tree_title = build_tree([call(0, [1, 2], [3], tags=("title",)), call(1, [1, 2, 3, 4], [7])])
    for t in (tree, tree_title):
        (batch,) = pack([t], 32)
        check_pack([t], [batch])
    (batch,) = pack([tree_title], 32)
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 7]
    assert batch.target_ids.tolist() == [7]  # 3 is owned by the excluded title call
    np.testing.assert_array_equal(batch.target_reward, np.float32(np.nan))  # no rewards given
    (batch,) = pack([tree], 32)
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 7]
    assert batch.target_ids.tolist() == [3, 7]


def test_pack_merges_shared_prefix_across_trees():
    system = [100, 101, 102]
    a = build_tree([call(0, system + [1], [5, 6], rollout="a")])
    b = build_tree([call(0, system + [1], [5, 7], rollout="b")])
    c = build_tree([call(0, system + [2], [5], rollout="c")])
    (batch,) = pack([a, b, c], 64, rewards=[1.0, 0.0, 0.5])
    assert batch.input_ids.tolist() == [100, 101, 102, 1, 5, 6, 7, 2, 5]
    assert batch.parent_row.tolist() == [-1, 0, 1, 2, 3, 4, 4, 2, 7]
    assert batch.kv_end.tolist() == [8, 8, 8, 6, 6, 5, 6, 8, 8]
    # Token 5 after [.., 1] is generated in both a and b: one target per tree at the same row.
    assert list(zip(batch.target_rows.tolist(), batch.target_ids.tolist(), batch.target_rollout.tolist())) == [
        (3, 5, 0), (3, 5, 1), (4, 6, 0), (4, 7, 1), (7, 5, 2)]
    np.testing.assert_array_equal(batch.target_reward, [1.0, 0.0, 1.0, 0.0, 0.5])
    assert list(zip(batch.leaf_rows.tolist(), batch.leaf_rollout.tolist())) == [(5, 0), (6, 1), (8, 2)]
    check_pack([a, b, c], [batch])


def test_pack_first_fit_decreasing():
    # Five trees with distinct first tokens, so five root subtrees of 6, 5, 4, 3 and 2 rows.
    sizes = [3, 6, 2, 5, 4]
    trees = [build_tree([call(0, [10 * (k + 1)] * (n - 1), [1], rollout=str(k))]) for k, n in enumerate(sizes)]
    batches = pack(trees, 10)
    # FFD: 6 -> b0, 5 -> b1, 4 -> b0 (full), 3 -> b1, 2 -> b1 (full); rows in forest (token) order.
    assert [sorted(set(b.target_rollout.tolist())) for b in batches] == [[1, 4], [0, 2, 3]]
    assert [b.num_tokens for b in batches] == [10, 10]
    assert batches[1].input_ids.tolist() == [10, 10, 1, 30, 1, 40, 40, 40, 40, 1]
    check_pack(trees, batches)
    assert pack_stats(batches) == {"num_batches": 2, "num_tokens": 20, "num_context_tokens": 0, "num_targets": 5,
                                   "fill_mean": 1.0, "fill_min": 1.0, "fill_total": 1.0}


def test_pack_splits_large_subtree_by_leaves():
    # Three answers under a shared 4-token prompt: 10 unique tokens in one root subtree, max 7 rows.
    tree = build_tree([
        call(0, [1, 2, 3, 4], [5, 6]),
        call(1, [1, 2, 3, 4], [7, 8]),
        call(2, [1, 2, 3, 4, 12], [13]),
    ], drop_dead=False)
    batches = pack([tree], 7)
    # Forest rows 1 2 3 4 5 6 7 8 12 13; leaves 6, 8 and 13, each path 6 tokens. Pieces: {path to 6}
    # (adding 8 makes 8 rows), {path to 8}, {path to 13}; the prompt is real in the first piece and
    # context in the others. (Cutting DFS runs instead would pack 7 + 7 + 6 = 20 rows.)
    assert [b.input_ids.tolist() for b in batches] == [
        [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 12, 13]]
    assert [b.is_context.tolist() for b in batches] == [[False] * 6] + [[True] * 4 + [False] * 2] * 2
    b1 = batches[1]
    assert b1.parent_row.tolist() == [-1, 0, 1, 2, 3, 4]
    assert b1.kv_end.tolist() == [5] * 6
    assert b1.position_ids.tolist() == [0, 1, 2, 3, 4, 5]
    # A target sits in the batch where its predicting row is real: 4 -> 5, 4 -> 7 and 5 -> 6 in the
    # first batch (7's row is in the second), 7 -> 8 in the second, 12 -> 13 in the third.
    assert [list(zip(b.target_rows.tolist(), b.target_ids.tolist())) for b in batches] == [
        [(3, 5), (3, 7), (4, 6)], [(4, 8)], [(4, 13)]]
    assert [list(zip(b.leaf_rows.tolist(), b.leaf_index.tolist())) for b in batches] == [
        [(5, 0)], [(5, 1)], [(5, 2)]]
    check_pack([tree], batches)
    assert pack_stats(batches)["num_context_tokens"] == 8
    assert sum(b.num_tokens for b in batches) <= tree.num_flat_tokens == 18


def test_pack_split_pieces_share_a_batch_once():
    # One root subtree: prompt [1, 2] with answers of 5, 8 and 1 tokens, 17 rows, max 10 rows.
    tree = build_tree([
        call(0, [1, 2], [3, 20, 20, 20, 20]),
        call(1, [1, 2], [4] + [21] * 7),
        call(2, [1, 2], [5]),
    ], drop_dead=False)
    batches = pack([tree], 10)
    # Pieces: {1 2 3 20x4} (7 rows; the next leaf would make 15), {1 2 4 21x7} (10; the prompt is
    # context there), {1 2 5} (3). FFD: 10 -> b0, 7 -> b1, 3 -> b1 (7 + 3 <= 10). The first and
    # third piece share b1 and their prompt rows once, real (from the first piece): 8 rows, not 10.
    assert [b.input_ids.tolist() for b in batches] == [[1, 2, 4] + [21] * 7, [1, 2, 3, 20, 20, 20, 20, 5]]
    assert [b.is_context.tolist() for b in batches] == [[True, True] + [False] * 8, [False] * 8]
    assert batches[1].parent_row.tolist() == [-1, 0, 1, 2, 3, 4, 5, 1]
    assert batches[1].kv_end.tolist() == [7, 7, 6, 6, 6, 6, 6, 7]
    # Row 1 (token 2) is real in b1: it predicts all three answers' first tokens there.
    assert list(zip(batches[1].target_rows.tolist(), batches[1].target_ids.tolist())) == [
        (1, 3), (1, 4), (1, 5), (2, 20), (3, 20), (4, 20), (5, 20)]
    assert batches[0].target_ids.tolist() == [21] * 7
    check_pack([tree], batches)


def test_pack_split_random_trees():
    rng = np.random.default_rng(7)
    for _ in range(30):
        trees = []
        for r in range(3):
            calls = []
            for i in range(int(rng.integers(1, 6))):
                prompt = rng.integers(0, 3, int(rng.integers(1, 6)))
                calls.append(call(i, prompt, rng.integers(0, 3, int(rng.integers(0, 4))), rollout=str(r),
                                  tags=("main",) if rng.random() < 0.8 else ("subagent",)))
            trees.append(build_tree(calls, drop_dead=bool(rng.random() < 0.5)))
        longest = max((leaf.depth for t in trees for leaf in t.leaves if leaf.status == "kept"), default=1)
        for micro_batch_tokens in (longest, longest + 3, 64):
            check_pack(trees, pack(trees, micro_batch_tokens))


def test_pack_skips_dropped_trees_but_keeps_indices():
    dropped = build_tree([call(0, [1], [2]), call(1, [1], [3], rollout="r0")], drop_dead=False, max_kept_leaves=1)
    kept = build_tree([call(0, [1], [4], rollout="r1")])
    assert dropped.dropped
    (batch,) = pack([dropped, kept], 8)
    assert batch.input_ids.tolist() == [1, 4] and batch.target_rollout.tolist() == [1]
    assert pack([dropped], 8) == []
    assert pack([], 8) == [] and pack_stats([])["num_batches"] == 0


def test_pack_rejects_bad_arguments():
    tree = build_tree([call(0, [1, 2, 3], [4, 5])])
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack([tree], 4)  # the kept path has 5 tokens
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            pack([tree], bad)
    with pytest.raises(ValueError):
        pack([tree], 8, rewards=[1.0, 2.0])
    with pytest.raises(ValueError):
        pack([tree], 8, rewards=[float("inf")])


def _pack_args(**override):
    args = dict(
        seg_off=np.array([0, 2], np.int64), seg_parent=np.array([-1, 0], np.int32),
        seg_start=np.array([0, 2], np.int32), seg_len=np.array([2, 1], np.int32),
        seg_train=np.array([0, 1], np.uint8), tok_off=np.array([0, 3], np.int64),
        tokens=np.array([1, 2, 3], np.int32), infer_logprobs=np.array([np.nan, np.nan, -0.5], np.float32),
        token_call=np.array([-1, -1, 0], np.int32), leaf_off=np.array([0, 1], np.int64),
        leaf_node=np.array([1], np.int32), leaf_kept=np.array([1], np.uint8), micro_batch_tokens=8,
    )
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override",
    [
        {"seg_parent": np.array([-1, 1], np.int32)},  # parent does not precede
        {"seg_parent": np.array([-2, 0], np.int32)},
        {"seg_start": np.array([0, 3], np.int32)},  # token range out of bounds
        {"seg_len": np.array([2, 0], np.int32)},
        {"leaf_node": np.array([2], np.int32)},
        {"seg_off": np.array([0, 3], np.int64)},
        {"tok_off": np.array([1, 3], np.int64)},
        {"token_call": np.array([-1, -1], np.int32)},
        {"leaf_kept": np.array([1, 1], np.uint8)},
        {"micro_batch_tokens": 0},
        {"micro_batch_tokens": 2},  # the path has 3 tokens
    ],
)
def test_core_pack_rejects_inconsistent_buffers(override):
    assert _core.pack_forest(**_pack_args())["target_ids"].tolist() == [3]
    with pytest.raises(ValueError):
        _core.pack_forest(**_pack_args(**override))

"""Property tests of the prefix tree and packer (docs/TREE.md).

The C++ fast path (`clawfast.tree.build_tree`, `clawfast.pack.pack`) is compared field by field with
the plain-Python references (`clawfast.tree_ref`, `clawfast.pack_ref`) on fresh random call sets,
and the packed batches are checked against the contract directly, from paths of token ids rather
than from either implementation's internals:
every trainable token is targeted exactly once across micro-batches, with the right owner, logprob,
leaf and full ancestor context; each batch fits `micro_batch_tokens`; `kv_end` agrees with `parent_row`;
every kept root-to-leaf path can be read back from the rows; the rows never exceed one sample per
kept leaf. Leaves follow the rule of docs/TREE.md (excluded calls below a main end node do not take
its leaf), and the generator is checked to produce excluded calls that extend the main path.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawfast.pack import pack, pack_stats
from clawfast.pack_ref import pack_ref
from clawfast.records import CallRecord
from clawfast.synthetic import harness_like_rollout, random_call_set, random_group, task_group
from clawfast.tree import build_tree
from clawfast.tree_ref import build_tree_ref

TREE_ARRAYS = (
    "seg_parent seg_start seg_len seg_kind seg_depth tokens infer_logprobs token_call "
    "call_indices end_node call_excluded"
).split()
TREE_SCALARS = ("rollout_id", "num_unique_tokens", "num_flat_tokens", "num_call_tokens", "dropped", "num_segments")
BATCH_ARRAYS = (
    "input_ids position_ids kv_end parent_row is_context target_rows target_ids loss_mask weight "
    "infer_logprobs target_rollout target_leaf target_call target_reward leaf_rows leaf_rollout leaf_index leaf_reward"
).split()
BATCH_SCALARS = ("num_tokens", "micro_batch_tokens", "fill")

PROPS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_same_array(name: str, ref: np.ndarray, fast: np.ndarray) -> None:
    ref, fast = np.asarray(ref), np.asarray(fast)
    assert ref.dtype == fast.dtype, f"{name}: dtype {fast.dtype} (fast) != {ref.dtype} (reference)"
    # Bit equality: both copy the same float32 logprobs, NaN marks context.
    assert np.array_equal(ref, fast, equal_nan=ref.dtype.kind == "f"), f"{name}: fast {fast} != reference {ref}"


def assert_same_tree(ref, fast) -> None:
    for name in TREE_ARRAYS:
        assert_same_array(name, getattr(ref, name), getattr(fast, name))
    for name in TREE_SCALARS:
        assert getattr(ref, name) == getattr(fast, name), f"{name}: fast {getattr(fast, name)} != ref {getattr(ref, name)}"
    as_tuples = lambda t: [(lf.node, lf.depth, tuple(lf.calls), lf.status) for lf in t.leaves]  # noqa: E731
    assert as_tuples(ref) == as_tuples(fast), "leaves differ (node, depth, calls, status)"


def assert_same_batches(ref: list, fast: list) -> None:
    assert len(ref) == len(fast), f"{len(fast)} batches (fast) != {len(ref)} (reference)"
    for b, (x, y) in enumerate(zip(ref, fast)):
        for name in BATCH_ARRAYS:
            assert_same_array(f"batch {b} {name}", getattr(x, name), getattr(y, name))
        for name in BATCH_SCALARS:
            assert getattr(x, name) == getattr(y, name), f"batch {b} {name}"


# ------------------------------------------------------------------------------------------------
# The contract, read from paths of token ids


def tree_paths(tree) -> list[tuple[int, ...]]:
    """Root-to-token path (token ids) of every flat token of a tree."""
    paths: list[tuple[int, ...]] = [()] * len(tree.tokens)
    for s in range(len(tree.seg_len)):
        p = int(tree.seg_parent[s])
        prefix = () if p < 0 else paths[int(tree.seg_start[p] + tree.seg_len[p] - 1)]
        for t in range(int(tree.seg_start[s]), int(tree.seg_start[s] + tree.seg_len[s])):
            prefix = prefix + (int(tree.tokens[t]),)
            paths[t] = prefix
    return paths


def expected_contents(trees, calls_of):
    """From each tree and its calls: trainable targets keyed by (rollout, path) with (call,
    logprob, leaf), kept leaves keyed by (rollout, leaf) with their path, and the union of kept
    paths (the rows the forest must hold once)."""
    targets, leaves, union = {}, {}, set()
    for r, tree in enumerate(trees):
        if tree.dropped:
            continue
        excluded = {c.call_index for c in calls_of[r] if c.excluded}
        paths = tree_paths(tree)
        seg_of = np.repeat(np.arange(len(tree.seg_len)), tree.seg_len)
        leaf_path = {}
        for i in tree.kept_leaves:
            s = tree.leaves[i].node
            leaf_path[i] = paths[int(tree.seg_start[s] + tree.seg_len[s] - 1)]
            leaves[(r, i)] = leaf_path[i]
        for t, path in enumerate(paths):
            below = [i for i, lp in leaf_path.items() if lp[: len(path)] == path]
            if not below:
                continue
            union.add(path)
            if tree.seg_kind[seg_of[t]] == 1 and int(tree.token_call[t]) not in excluded:
                targets[(r, path)] = (int(tree.token_call[t]), float(tree.infer_logprobs[t]), min(below))
    return targets, leaves, union


def check_batches(trees, calls_of, batches, micro_batch_tokens, rewards=None) -> None:
    targets, leaves, union = expected_contents(trees, calls_of)
    seen_targets: Counter = Counter()
    seen_leaves: Counter = Counter()
    seen_rows: Counter = Counter()
    for b, batch in enumerate(batches):
        n = batch.num_tokens
        assert n == len(batch.input_ids) and 0 < n <= micro_batch_tokens, \
            f"batch {b}: {n} rows, max {micro_batch_tokens}"
        assert batch.fill == n / micro_batch_tokens
        parent, pos, kv_end = batch.parent_row, batch.position_ids, batch.kv_end
        paths: list[tuple[int, ...]] = []
        ancestors: list[set[int]] = []
        for i in range(n):
            p = int(parent[i])
            assert -1 <= p < i, f"batch {b} row {i}: parent {p}"
            assert (p == -1) == (pos[i] == 0), f"batch {b} row {i}: root rows are exactly depth 0"
            assert p == -1 or pos[i] == pos[p] + 1
            paths.append((() if p < 0 else paths[p]) + (int(batch.input_ids[i]),))
            ancestors.append(({p} | ancestors[p]) if p >= 0 else set())
        assert len(set(paths)) == n, f"batch {b}: a path appears twice"
        for j in range(n):
            # kv_end[j] is the last row of j's subtree, and the subtree is contiguous.
            below = [i for i in range(n) if i == j or j in ancestors[i]]
            assert int(kv_end[j]) == max(below), f"batch {b} row {j}: kv_end {kv_end[j]} != {max(below)}"
            assert below == list(range(j, max(below) + 1)), f"batch {b} row {j}: subtree not contiguous"
        context = batch.is_context
        for i in range(n):
            if context[i]:
                # A context row is an ancestor of the batch's next non-context row.
                nxt = next(k for k in range(i + 1, n) if not context[k])
                assert i in ancestors[nxt], f"batch {b}: context row {i} is not an ancestor of row {nxt}"
            else:
                seen_rows[paths[i]] += 1
        order = list(zip(batch.target_rows.tolist(), batch.target_ids.tolist(), batch.target_rollout.tolist()))
        assert order == sorted(order), "targets not ordered by (row, id, rollout)"
        assert np.all(batch.loss_mask == 1.0) and np.all(batch.weight == 1.0)
        for m in range(len(batch.target_ids)):
            row = int(batch.target_rows[m])
            assert not context[row], f"batch {b}: context row {row} predicts a target"
            r = int(batch.target_rollout[m])
            key = (r, paths[row] + (int(batch.target_ids[m]),))
            assert key in targets, f"batch {b} target {m}: not a trainable token of rollout {r}"
            call, lp, leaf = targets[key]
            got = (int(batch.target_call[m]), float(batch.infer_logprobs[m]), int(batch.target_leaf[m]))
            assert got == (call, lp, leaf), f"batch {b} target {m}: (call, logprob, leaf) {got} != {(call, lp, leaf)}"
            want_reward = np.nan if rewards is None else np.float32(rewards[r])
            assert np.array_equal(batch.target_reward[m], want_reward, equal_nan=True)
            seen_targets[key] += 1
        for k in range(len(batch.leaf_rows)):
            row = int(batch.leaf_rows[k])
            assert not context[row]
            key = (int(batch.leaf_rollout[k]), int(batch.leaf_index[k]))
            assert leaves.get(key) == paths[row], f"batch {b}: leaf {key} does not read back its path"
            seen_leaves[key] += 1
    # Splitting by leaves is never worse than one sample per kept leaf.
    flat = sum(t.num_flat_tokens for t in trees if not t.dropped)
    assert sum(b.num_tokens for b in batches) <= flat, "more rows than one sample per kept leaf"
    assert seen_targets == Counter(targets.keys()), "some trainable token is not targeted exactly once"
    assert seen_leaves == Counter(leaves.keys()), "some kept leaf is not listed exactly once"
    assert seen_rows == Counter(union), "non-context rows are not the union of kept paths, each once"


# ------------------------------------------------------------------------------------------------
# Fast path == reference, and both honour the contract


@PROPS
@given(
    seed=st.integers(0, 2**32 - 1),
    n_calls=st.integers(1, 12),
    vocab=st.integers(2, 6),
    drop_dead=st.booleans(),
    max_kept=st.one_of(st.none(), st.integers(0, 4)),
    p_extend_excluded=st.sampled_from([0.0, 0.3]),
)
def test_tree_matches_reference(seed, n_calls, vocab, drop_dead, max_kept, p_extend_excluded):
    calls = random_call_set(np.random.default_rng(seed), n_calls, vocab_size=vocab,
                            p_extend_excluded=p_extend_excluded)
    ref = build_tree_ref(calls, drop_dead=drop_dead, max_kept_leaves=max_kept)
    fast = build_tree(calls, drop_dead=drop_dead, max_kept_leaves=max_kept)
    assert_same_tree(ref, fast)
    # Counts: every token of every path is in the tree; flat = sum of kept leaf depths.
    assert fast.num_call_tokens == sum(len(c.prompt_ids) + len(c.output_ids) for c in calls)
    assert fast.num_unique_tokens == len(fast.tokens) == len(set(tree_paths(fast)))
    check_tree_shape(fast, calls, drop_dead)


def check_tree_shape(tree, calls, drop_dead: bool) -> None:
    """Radix-tree invariants of docs/TREE.md, read from the arrays alone."""
    paths = tree_paths(tree)
    ordered = sorted(calls, key=lambda c: c.call_index)
    # Every call's path ends at its end node.
    for k, c in enumerate(ordered):
        s = int(tree.end_node[k])
        assert paths[int(tree.seg_start[s] + tree.seg_len[s] - 1)] == tuple(np.concatenate([c.prompt_ids, c.output_ids]))
    # Forced boundaries: where some path's prompt or output ends.
    ends = {tuple(c.prompt_ids) for c in ordered} | {tuple(np.concatenate([c.prompt_ids, c.output_ids])) for c in ordered}
    children: dict[int, list[int]] = {}
    for s in range(tree.num_segments):
        a, n, p = int(tree.seg_start[s]), int(tree.seg_len[s]), int(tree.seg_parent[s])
        assert n >= 1 and a == (0 if s == 0 else int(tree.seg_start[s - 1] + tree.seg_len[s - 1])), "flat layout"
        assert p < s, "pre-order: a parent precedes its children"
        assert tree.seg_depth[s] == (0 if p < 0 else tree.seg_depth[p] + tree.seg_len[p])
        children.setdefault(p, []).append(s)
        # Homogeneous segments: one kind and one owner; logprob NaN exactly on context.
        kind = int(tree.seg_kind[s])
        owners = set(tree.token_call[a : a + n].tolist())
        assert len(owners) == 1 and (owners == {-1}) == (kind == 0)
        assert np.isnan(tree.infer_logprobs[a : a + n]).all() == (kind == 0)
    for p, kids in children.items():
        firsts = [int(tree.tokens[tree.seg_start[c]]) for c in kids]
        assert firsts == sorted(set(firsts)), "children by ascending, distinct first token"
        # Compressed: a segment with one child ends at a forced boundary.
        if p >= 0 and len(kids) == 1:
            assert paths[int(tree.seg_start[p] + tree.seg_len[p] - 1)] in ends, f"segment {p} could merge with its child"
    # Leaves, in DFS order, with their path length: an end node of a non-excluded call is a leaf
    # iff no non-excluded call's path strictly extends its path (for a live end: no live call's,
    # where a dead call is one a later call retried, with the same prompt, unless the last main
    # call ends with it); an end node of excluded calls only is a leaf iff it has no child. The
    # calls of a leaf are all those ending there.
    seg_path = [paths[int(tree.seg_start[s] + tree.seg_len[s] - 1)] for s in range(tree.num_segments)]
    full = [tuple(np.concatenate([c.prompt_ids, c.output_ids]).tolist()) for c in ordered]
    prompts = [tuple(c.prompt_ids.tolist()) for c in ordered]
    last_main = max((k for k, c in enumerate(ordered) if not c.excluded), default=-1)

    def dead(path) -> bool:
        ending = [k for k, f in enumerate(full) if f == path]
        return drop_dead and last_main not in ending and any(prompts[k] in prompts[k + 1:] for k in ending)

    main_paths = [f for f, c in zip(full, ordered) if not c.excluded]
    live_paths = [f for f in main_paths if not dead(f)]
    want_leaves = []
    for s in range(tree.num_segments):
        ending = [c.call_index for f, c in zip(full, ordered) if f == seg_path[s]]
        if not ending:
            continue
        if any(not c.excluded for c in ordered if c.call_index in ending):
            counted = main_paths if dead(seg_path[s]) else live_paths
            below = any(len(m) > len(seg_path[s]) and m[: len(seg_path[s])] == seg_path[s] for m in counted)
            if not below:
                want_leaves.append((s, tuple(ending)))
        elif s not in children:
            want_leaves.append((s, tuple(ending)))
    assert [(lf.node, tuple(lf.calls)) for lf in tree.leaves] == want_leaves
    # Kept leaves are never above one another (no kept path extends another within one tree).
    kept_paths = [seg_path[lf.node] for lf in tree.leaves if lf.status == "kept"]
    assert not any(a != b and b[: len(a)] == a for a in kept_paths for b in kept_paths)
    assert all(lf.depth == tree.seg_depth[lf.node] + tree.seg_len[lf.node] for lf in tree.leaves)
    # Pre-order: each subtree is the contiguous range of segments that starts at its root.
    size = [1] * tree.num_segments
    for s in reversed(range(tree.num_segments)):
        if tree.seg_parent[s] >= 0:
            size[int(tree.seg_parent[s])] += size[s]
    for p, kids in children.items():
        start = p + 1
        for c in kids:
            assert c == start, "children's subtrees follow each other in pre-order"
            start += size[c]


def test_generator_covers_excluded_calls_below_kept_leaves():
    # The property tests above draw p_extend_excluded=0.3 half the time: check that such draws do
    # produce the shape the leaf rule is about (a kept leaf with an excluded call's end node below).
    hits = 0
    for seed in range(200):
        calls = random_call_set(np.random.default_rng(seed), 8, vocab_size=4, p_extend_excluded=0.3)
        tree = build_tree(calls)
        paths = tree_paths(tree)
        last = tree.seg_start + tree.seg_len - 1  # last token of each segment
        kept = [paths[int(last[lf.node])] for lf in tree.leaves if lf.status == "kept"]
        excl = [paths[int(last[lf.node])] for lf in tree.leaves if lf.status == "excluded"]
        hits += any(len(e) > len(k) and e[: len(k)] == k for k in kept for e in excl)
    assert hits >= 40, f"only {hits} of 200 call sets have an excluded leaf below a kept leaf"


def test_tree_custom_exclude_tags_match():
    calls = random_call_set(np.random.default_rng(7), 10, vocab_size=3, p_exclude=0.5)
    for tags in (frozenset(), frozenset({"title"}), frozenset({"main"})):
        assert_same_tree(build_tree_ref(calls, exclude_tags=tags), build_tree(calls, exclude_tags=tags))


@PROPS
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 4),
    n_calls=st.integers(1, 8),
    vocab=st.integers(2, 5),
    slack=st.floats(0.0, 2.0),
    with_rewards=st.booleans(),
    repeat_one=st.booleans(),
    p_extend_excluded=st.sampled_from([0.0, 0.3]),
)
def test_pack_matches_reference_and_contract(seed, k, n_calls, vocab, slack, with_rewards, repeat_one,
                                             p_extend_excluded):
    rng = np.random.default_rng(seed)
    group = random_group(rng, k, n_calls, vocab_size=vocab, p_extend_excluded=p_extend_excluded)
    if repeat_one:  # the same rollout twice: every position trainable in both yields two targets
        group.append(group[0])
        k += 1
    trees = [build_tree(calls, max_kept_leaves=3 if i == 1 else None) for i, calls in enumerate(group)]
    longest = max([lf.depth for t in trees if not t.dropped for lf in t.leaves if lf.status == "kept"], default=1)
    micro_batch_tokens = longest + int(slack * longest)  # small budgets force split subtrees
    rewards = rng.normal(size=k).tolist() if with_rewards else None
    fast = pack(trees, micro_batch_tokens, rewards=rewards)
    assert_same_batches(pack_ref(trees, micro_batch_tokens, rewards=rewards), fast)
    check_batches(trees, group, fast, micro_batch_tokens, rewards)


def test_pack_splits_a_large_subtree():
    # One long shared prompt with several branches, packed into batches smaller than the subtree:
    # later batches must re-include the ancestor path as context rows.
    rng = np.random.default_rng(3)
    group = random_group(rng, 4, 8, vocab_size=3, max_len=30)
    trees = [build_tree(calls) for calls in group]
    longest = max(lf.depth for t in trees for lf in t.leaves if lf.status == "kept")
    fast = pack(trees, longest + 2)
    assert len(fast) > 1 and any(b.is_context.any() for b in fast)
    assert_same_batches(pack_ref(trees, longest + 2), fast)
    check_batches(trees, group, fast, longest + 2)
    stats = pack_stats(fast)
    assert stats["num_batches"] == len(fast)
    assert stats["num_tokens"] == sum(b.num_tokens for b in fast)
    assert stats["num_targets"] == sum(len(b.target_ids) for b in fast)


def test_pack_splits_an_agent_scale_group_at_128k():
    # bench_tree's GRPO group (8 rollouts x 64 calls, prompts growing to 64K): its deduplicated forest
    # holds ~577K rows, so a 128K-row budget (what tree attention makes affordable) splits it
    group = task_group(np.random.default_rng(1), 8, n_calls=64, max_prompt_tokens=65536, tokens_per_call=1000)
    trees = [build_tree(calls) for calls in group]
    batches = pack(trees, 131072)
    assert_same_batches(pack_ref(trees, 131072), batches)
    assert len(batches) > 1 and any(b.is_context.any() for b in batches)
    whole = pack(trees, sum(t.num_unique_tokens for t in trees))
    assert sum(len(b.target_ids) for b in batches) == sum(len(b.target_ids) for b in whole)
    for b in batches:
        assert b.num_tokens <= 131072
        # kv_end is each row's subtree end, the contract tree attention reads
        end = np.arange(b.num_tokens)
        for i in range(b.num_tokens - 1, -1, -1):
            if b.parent_row[i] >= 0:
                end[b.parent_row[i]] = max(end[b.parent_row[i]], end[i])
        assert np.array_equal(end, b.kv_end)


def test_harness_shaped_group_matches_reference():
    # Realistic shapes (growing prompts, retries, subagents, title, edit, compaction), shuffled.
    rng = np.random.default_rng(11)
    group = task_group(rng, 3, n_calls=24, max_prompt_tokens=1500, vocab_size=1000, shuffle=True,
                       tokens_per_call=70)
    trees = []
    for calls in group:
        fast = build_tree(calls)
        assert_same_tree(build_tree_ref(calls), fast)
        assert {lf.status for lf in fast.leaves} == {"kept", "dead", "excluded"}
        trees.append(fast)
    for micro_batch_tokens in (1600, 8192):  # split (context rows re-included) and whole
        fast_batches = pack(trees, micro_batch_tokens, rewards=[1.0, 0.0, 0.5])
        assert_same_batches(pack_ref(trees, micro_batch_tokens, rewards=[1.0, 0.0, 0.5]), fast_batches)
        check_batches(trees, group, fast_batches, micro_batch_tokens, [1.0, 0.0, 0.5])
    # The k samples share system prompt and task: packed once, fewer rows than k flat copies.
    assert sum(b.num_tokens for b in fast_batches) < sum(t.num_flat_tokens for t in trees)


# ------------------------------------------------------------------------------------------------
# The contract's rules on hand-made rollouts (both implementations)


def call(i, prompt, output, tags=("main",), rid="r"):
    lp = -np.linspace(0.1, 0.9, len(output)).astype(np.float32) - abs(i)
    return CallRecord(rid, i, "h", np.array(prompt, np.int32), np.array(output, np.int32), lp, tags=tags)


BUILDERS = pytest.mark.parametrize("build", [build_tree, build_tree_ref], ids=["fast", "ref"])


@BUILDERS
def test_retry_is_dead_but_last_main_call_is_kept(build):
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2], [5]), call(2, [1, 2], [6])]
    tree = build(calls)
    status = {lf.calls: lf.status for lf in tree.leaves}
    assert status == {(0,): "dead", (1,): "dead", (2,): "kept"}
    assert build(calls, drop_dead=False).kept_leaves == [0, 1, 2]


@BUILDERS
def test_history_edit_keeps_the_older_branch(build):
    calls = [call(0, [1, 2], [3]), call(1, [1, 2, 3, 7], [4]), call(2, [1, 2, 9, 7], [5])]
    status = {lf.calls: lf.status for lf in build(calls).leaves}
    assert status == {(1,): "kept", (2,): "kept"}


@BUILDERS
def test_excluded_leaf_and_owner_and_kinds(build):
    # Call 1 (subagent) regenerates call 0's output tokens 3, 4 at the same position: the owner is
    # the main call (call 0), not the later excluded one, and the tokens stay generated even where
    # call 2's prompt covers them.
    calls = [
        call(0, [1, 2], [3, 4]),
        call(1, [1, 2], [3, 4, 8], tags=("subagent",)),
        call(2, [1, 2, 3, 4, 5], [6]),
    ]
    tree = build(calls)
    paths = tree_paths(tree)
    owner = {p: int(c) for p, c in zip(paths, tree.token_call)}
    assert owner[(1,)] == -1 and owner[(1, 2, 3)] == 0 and owner[(1, 2, 3, 4)] == 0
    assert owner[(1, 2, 3, 4, 8)] == 1 and owner[(1, 2, 3, 4, 5)] == -1 and owner[(1, 2, 3, 4, 5, 6)] == 2
    assert {lf.calls: lf.status for lf in tree.leaves} == {(1,): "excluded", (2,): "kept"}
    assert tree.num_unique_tokens == 7 and tree.num_call_tokens == 4 + 5 + 6 and tree.num_flat_tokens == 6


@BUILDERS
def test_branching_limit_drops_the_tree(build):
    calls = [call(0, [1], [2]), call(1, [1], [3], tags=("main",)), call(2, [1, 4], [5])]
    tree = build(calls, drop_dead=False, max_kept_leaves=2)
    assert tree.dropped and len(tree.kept_leaves) == 3
    assert not build(calls, drop_dead=False, max_kept_leaves=3).dropped
    packer = pack if build is build_tree else pack_ref
    assert packer([tree], 16) == []


# ------------------------------------------------------------------------------------------------
# Malformed input


def _mutated(field, value):
    c = call(0, [1, 2], [3, 4])
    setattr(c, field, value)
    return [c]


MALFORMED = {
    "empty": [],
    "mixed rollouts": [call(0, [1], [2], rid="a"), call(1, [1], [2], rid="b")],
    "duplicate index": [call(3, [1], [2]), call(3, [1, 2], [5])],
    "negative index": _mutated("call_index", -1),  # CallRecord refuses it; a record changed after is caught too
    "negative token": _mutated("prompt_ids", np.array([1, -2], np.int32)),
    "logprob length": _mutated("infer_logprobs", np.zeros(1, np.float32)),
    "positive logprob": _mutated("infer_logprobs", np.array([-0.1, 0.5], np.float32)),
    "nan logprob": _mutated("infer_logprobs", np.array([-0.1, np.nan], np.float32)),
    "empty prompt": _mutated("prompt_ids", np.zeros(0, np.int32)),
}


@BUILDERS
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_calls_raise_value_error(build, case):
    with pytest.raises(ValueError):
        build(MALFORMED[case])


@BUILDERS
def test_exclude_tags_given_as_one_string_is_refused(build):
    # frozenset("title") is {"t", "i", "l", "e"}: a string would silently exclude nothing it names
    calls = [call(0, [1, 2], [3], tags=("title",))]
    with pytest.raises(ValueError, match="exclude_tags must be a collection of tags, got the string 'title'"):
        build(calls, exclude_tags="title")
    assert [lf.status for lf in build(calls, exclude_tags=("title",)).leaves] == ["excluded"]


@pytest.mark.parametrize("packer", [pack, pack_ref], ids=["fast", "ref"])
def test_pack_refuses_micro_batch_tokens_past_int32_rows(packer):
    """Batch-local rows are int32 (csrc/packer.hpp): one more than 2**31 - 1 is a ValueError naming
    micro_batch_tokens (the fast path handed such a value to pybind11, which raised a TypeError
    printing every array, or nothing at all below 2**63); the bound itself packs."""
    from clawfast.pack import MAX_MICRO_BATCH_TOKENS
    from clawfast.pack_ref import MAX_MICRO_BATCH_TOKENS as REF_MAX

    assert MAX_MICRO_BATCH_TOKENS == REF_MAX == 2**31 - 1
    tree = build_tree([call(0, [1, 2, 3], [4, 5])])
    for bad in (2**31, 10**20, np.int64(2**40)):
        with pytest.raises(ValueError, match=r"micro_batch_tokens must be at most 2147483647 .* got "):
            packer([tree], bad)
    assert len(packer([tree], MAX_MICRO_BATCH_TOKENS)) == 1


@pytest.mark.parametrize("packer", [pack, pack_ref], ids=["fast", "ref"])
def test_pack_rejects_paths_longer_than_micro_batch_tokens(packer):
    tree = build_tree([call(0, [1, 2, 3], [4, 5])])
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        packer([tree], 4)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        packer([tree], 0)
    with pytest.raises(ValueError):
        packer([tree], 8, rewards=[1.0, 2.0])
    assert len(packer([tree], 5)) == 1


def test_harness_like_rollout_shape():
    calls = harness_like_rollout(np.random.default_rng(0), 64, 8192, vocab_size=5000)
    assert len(calls) == 64 and [c.call_index for c in calls] == list(range(64))
    main = [c for c in calls if not c.excluded]
    assert 0.8 * 8192 < len(main[-1].prompt_ids) < len(main[-1].prompt_ids) + len(main[-1].output_ids) <= 8192
    assert sum("subagent" in c.tags for c in calls) == 6
    retries = sum(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(calls, calls[1:]))
    assert 2 <= retries <= 15

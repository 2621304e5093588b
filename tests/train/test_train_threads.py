"""Training every thread a harness runs (`algorithm.train_threads`): what is trained in each mode, on
rollouts captured through real harnesses (tests/train/stored_threads.py) and on synthetic sessions;
PPO's GAE across the links between threads against a float64 walk of the linked chain by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from clawfast.kernels.reference import gae_loop
from clawfast.records import RolloutResult
from clawfast.threads import KINDS, reconstruct
from clawfast.train.algorithms import KeptForest, link_levels, ppo_advantages
from clawfast.train.prepare import prepare_step, trained_links
from clawfast.train.step_config import StepConfig
from test_threads import SYSTEM, TOOL, USER, Session

from trained_targets import expected_targets, packed_targets
from stored_threads import CAPTURES, REWARDS, labels, step_digest, stored_rollouts

ALL = list(KINDS)

# Computed by the code before threads could be trained (c61559e) on tests/data/threads, with
# tests/train/stored_threads.py's `step_digest`: micro-batches, loss weights, denominators, GRPO
# advantages, PPO's GAE. The loss, its gradients and so the checkpoints are functions of these alone.
MAIN_ONLY = {
    "grpo": ({"name": "grpo", "micro_batch_tokens": 65536},
             "22cc796a57c87f0a23c0701ad31b0915778948346da5f3725f5e679f48bd4a8c"),
    "grpo-split": ({"name": "grpo", "micro_batch_tokens": 40000, "aggregation": "seq-mean-token-mean"},
                   "651911de1a107318918c621565df78c779c04ecafdf921079a2f998240845ad8"),
    "ppo-path": ({"name": "ppo", "micro_batch_tokens": 65536, "gamma": 0.9, "lam": 0.8, "gae_mode": "path"},
                 "65a1f8eb0fd37a6e400aa92ece3fb2fef11d442b131f181694758f74f0482a03"),
    "ppo-tree": ({"name": "ppo", "micro_batch_tokens": 65536, "gamma": 0.9, "lam": 0.8, "gae_mode": "tree"},
                 "65a1f8eb0fd37a6e400aa92ece3fb2fef11d442b131f181694758f74f0482a03"),
}


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> list[RolloutResult]:
    return stored_rollouts(tmp_path_factory.mktemp("threads"))


@pytest.mark.parametrize("case", list(MAIN_ONLY))
@pytest.mark.parametrize("threads", [None, ["main"]])
def test_main_only_is_bit_identical_on_stored_records(captured, case, threads):
    fields, digest = MAIN_ONLY[case]
    config = StepConfig(**fields, **({} if threads is None else {"train_threads": threads}))
    assert step_digest(captured, config) == digest


# -- which tokens are trained: every generated token of every trained thread, once ----------------------


@pytest.mark.parametrize("trained", [["main"], ALL, ["main", "subagent"], ["main", "compaction"]])
def test_trained_tokens_are_the_outputs_of_the_trained_threads_once_each(captured, trained):
    config = StepConfig(name="grpo", micro_batch_tokens=65536, train_threads=trained)
    data = prepare_step(captured, ["g"] * len(captured), config)
    rewards = np.asarray(REWARDS)
    adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    for g, name in enumerate(CAPTURES):
        truth = labels(name)
        assert [t.kind for t in reconstruct(captured[g].calls).calls] == truth
        got = packed_targets(data, g)
        assert len(got) == len(set(got)), f"{name}: a token is a target twice"
        assert set(got) == expected_targets(captured[g], truth, trained), name
        for b, a in zip(data.batches, data.advantages):
            mine = b.target_rollout == g
            assert np.all(b.target_reward[mine] == rewards[g]) and np.allclose(a[mine], adv[g])
    for k in KINDS:
        n = sum(lab == k for name in CAPTURES for lab in labels(name))
        if n:
            assert data.counts[f"threads/{k}/calls"] == n
            assert (f"threads/{k}/targets" in data.counts) == (k in trained)
            assert (data.counts.get(f"threads/{k}/calls_excluded", 0) == n) == (k not in trained)


def test_the_captured_rollout_with_two_subagents_and_a_compaction_trains_all_of_them(captured):
    """The bar: with every thread trained, each generated token of the Claude Code rollout (two
    subagent threads, one compaction, the restarted main thread) is a target once, with its reward."""
    rollout = captured[0]
    truth = labels(CAPTURES[0])
    assert truth.count("subagent") >= 4 and truth.count("compaction") == 1
    data = prepare_step([rollout], None, StepConfig(name="grpo", micro_batch_tokens=65536, train_threads=ALL))
    got = packed_targets(data, 0)
    every = expected_targets(rollout, truth, set(KINDS))
    assert len(got) == len(set(got)) and set(got) == every
    assert len(every) == sum(len(c.output_ids) for c in rollout.calls)  # no two calls sampled the same place
    kind_of = np.concatenate(data.target_kind)
    for k in ("main", "subagent", "compaction"):
        assert data.counts[f"threads/{k}/targets"] == int((kind_of == KINDS.index(k)).sum()) > 0


# -- GAE across the links ---------------------------------------------------------------------------


def hand_gae(rows, forest: KeptForest, reward, values, gamma, lam) -> dict[int, float]:
    """The advantage of each of `rows` (a chain walked by hand: a thread's rows, then the rows its
    link leads to) by the plain float64 reference loop over one sequence (`gae_loop`, verl's);
    context rows carry the next value and advantage."""
    r = torch.tensor([[reward.get(row, 0.0) for row in rows]], dtype=torch.float64)
    m = torch.as_tensor(forest.trainable[rows], dtype=torch.float64)[None]
    adv, _ = gae_loop(r, values[torch.as_tensor(rows)].double()[None], m, gamma, lam)
    return dict(zip(rows, adv[0].tolist()))


def path_rows(forest: KeptForest, row: int, stop: int = -1) -> list[int]:
    """The rows from below `stop` (an ancestor, exclusive; -1: the root) down to `row`."""
    out = []
    while row != stop:
        out.append(row)
        row = int(forest.parent[row])
    return out[::-1]


def subagent_session(seed: int, vocab: int = 5000, reward: float = 1.0):
    """Main delegates to a 3-call subagent (its own system prompt, a subset of the main one), gets its
    report back in a tool result, and goes on for two calls."""
    s = Session(seed, vocab)
    system = s.text(200)
    history = s.msg(SYSTEM, system) + s.msg(USER, s.text(30))
    history = history + s.ask(history)
    sub = s.msg(SYSTEM, system[:50] + s.text(30)) + s.msg(USER, s.text(25))
    for _ in range(3):
        answer = s.ask(sub)
        sub = sub + answer + s.msg(TOOL, s.text(15))
    history = history + s.msg(TOOL, answer[2:-1])
    for _ in range(2):
        history = history + s.ask(history) + s.msg(TOOL, s.text(20))
    return RolloutResult(f"r{seed}", "t", "h", reward=reward, calls=[dataclasses.replace(c, rollout_id=f"r{seed}")
                                                                      for c in s.calls])


@pytest.mark.parametrize("mode", ["path", "tree"])
@pytest.mark.parametrize("seed", range(4))
def test_gae_across_a_subagent_link_equals_a_walk_of_the_linked_chain(mode, seed):
    rollout = subagent_session(seed)
    threads = reconstruct(rollout.calls)
    assert [t.kind for t in threads.calls] == ["main", "subagent", "subagent", "subagent", "main", "main"]
    [link] = threads.links
    assert (link.kind, link.source, link.target) == ("returns", 3, 4)
    config = StepConfig(name="ppo", micro_batch_tokens=4096, gamma=0.95, lam=0.9, gae_mode=mode,
                        train_threads=["main", "subagent"])
    data = prepare_step([rollout], None, config)
    forest = data.forest
    assert forest.link_source.size == 1 and forest.links_unused == 0
    values = torch.as_tensor(np.random.default_rng(seed).normal(size=forest.num_rows))
    adv, ret = ppo_advantages(forest, values, data.rewards, gamma=0.95, lam=0.9, mode=mode)
    # By hand: the subagent's rows (below where its prompt leaves the main one), then the main rows
    # from the first token of the call its answer returns in to the main leaf, the reward at its end.
    src, dst = int(forest.link_source[0]), int(forest.link_target[0])
    [main_leaf] = [r for r in forest.leaf_rows if r != src]
    branch = int(forest.parent[path_rows(forest, src)[0]])
    while forest.subtree_end[branch] < main_leaf or branch > main_leaf:  # up to the common ancestor
        branch = int(forest.parent[branch])
    main_rows = path_rows(forest, main_leaf)
    chain = path_rows(forest, src, branch) + main_rows[main_rows.index(dst):]
    reward_row = int(np.flatnonzero(forest.reward_row)[0])
    want = hand_gae(chain, forest, {reward_row: 1.0}, values, 0.95, 0.9)
    for row in chain:
        if forest.trainable[row]:
            assert adv[row].item() == pytest.approx(want[row], rel=1e-9, abs=1e-9)
            assert ret[row].item() == pytest.approx(want[row] + float(values[row]), rel=1e-9, abs=1e-9)
    assert not forest.reward_row[src]  # the subagent's credit comes through the link, not a reward of its own
    # Main only: no link, no subagent row trained, and the main rows' advantages are the same.
    main_only = prepare_step([rollout], None, config.model_copy(update={"train_threads": ("main",)}))
    assert main_only.forest.link_source.size == 0


def test_gae_from_a_compaction_summary_goes_on_in_the_restarted_thread(captured):
    """Claude Code's compaction: the summary call extends the main history, so the main path before
    it flows into the summary, and the summary's last token bootstraps from the restarted thread."""
    rollout = captured[0]
    config = StepConfig(name="ppo", micro_batch_tokens=65536, gamma=0.97, lam=0.9, train_threads=["main", "compaction"])
    data = prepare_step([rollout], None, config)
    forest = data.forest
    links = reconstruct(rollout.calls).links
    assert {(lk.kind, lk.source, lk.target) for lk in links if lk.thread_kind == "compaction"} == {
        ("restarts", 8, 9), ("resumes", 7, 9)}
    assert forest.link_source.size == 2 and forest.links_unused == 0
    values = torch.as_tensor(np.random.default_rng(0).normal(size=forest.num_rows))
    adv, _ = ppo_advantages(forest, values, data.rewards, gamma=0.97, lam=0.9)
    rows = {int(s): int(t) for s, t in zip(forest.link_source, forest.link_target)}
    restart_leaf = max(forest.leaf_rows)  # the restarted thread's leaf: the rollout's reward is there
    for src, dst in rows.items():
        # From the last branch point above the source (the summary's own rows, or the last main
        # call's), then the restart from its first sampled token.
        top = src
        while (up := int(forest.parent[top])) >= 0 and up + 1 == top and forest.subtree_end[up] == forest.subtree_end[top]:
            top = up  # the parent's only child
        restart = path_rows(forest, restart_leaf)
        chain = path_rows(forest, src, int(forest.parent[top])) + restart[restart.index(dst):]
        [reward_row] = [r for r in restart if forest.reward_row[r]]
        want = hand_gae(chain, forest, {reward_row: 1.0}, values, 0.97, 0.9)
        for row in chain:  # thousands of rows: the kernel's scans round differently from this loop
            if forest.trainable[row]:
                assert adv[row].item() == pytest.approx(want[row], rel=1e-9, abs=1e-9)


def test_a_resumes_link_the_compaction_path_carries_is_not_unused():
    """A compaction call that extends the main thread's last call whole: that call's answer goes on
    in the trained compaction call, so its `resumes` link has no leaf to start from and needs none
    (the path carries the credit to the summary, which `restarts` the thread). It is not counted as a
    link that could not be placed."""
    from clawfast.records import CallRecord

    rng = np.random.default_rng(0)

    def tokens(n):
        return rng.integers(100, 1000, n).astype(np.int32)

    calls = []

    def call(prompt, kind):
        output = tokens(12)
        calls.append(CallRecord("r", len(calls), "h", prompt, output, np.full(12, -0.5, np.float32), tags=(kind,)))
        return output

    prompt = np.concatenate([[1, 2, 3], tokens(20)]).astype(np.int32)
    first = call(prompt, "main")
    history = np.concatenate([prompt, first, tokens(5)])
    second = call(history, "main")
    summary = call(np.concatenate([history, second, tokens(8)]), "compaction")
    call(np.concatenate([prompt[:15], tokens(3), summary, tokens(4)]), "main")
    rollout = RolloutResult("r", "t", "h", 0, 1.0, "ok", calls=calls)
    links = {(lk.kind, lk.source, lk.target) for lk in reconstruct(rollout.calls).links}
    assert links == {("resumes", 1, 3), ("restarts", 2, 3)}
    data = prepare_step([rollout], None, StepConfig(name="ppo", micro_batch_tokens=4096,
                                                    train_threads=["main", "compaction"]))
    forest = data.forest
    assert forest.link_source.size == 1 and forest.links_unused == 0
    assert data.counts["threads/links_unused"] == 0


def test_link_levels_order_nested_links_and_refuse_a_cycle():
    # three chains under one root: A = rows 1-2, B = 3-4, C = 5-6
    forest = dataclasses.replace(KeptForest.build([]), parent=np.array([-1, 0, 1, 0, 3, 0, 5]),
                                 subtree_end=np.array([6, 2, 2, 4, 4, 6, 6]))
    # A's end -> B's start needs B's advantages, which need B's end -> C's start first
    nested = dataclasses.replace(forest, link_source=np.array([2, 4]), link_target=np.array([3, 5]))
    assert link_levels(nested).tolist() == [1, 0]
    # ... and C's end -> A's start closes a cycle
    cycle = dataclasses.replace(forest, link_source=np.array([2, 4, 6]), link_target=np.array([3, 5, 1]))
    with pytest.raises(ValueError, match="cycle"):
        link_levels(cycle)


def test_links_of_untrained_kinds_are_not_followed():
    rollout = subagent_session(0)
    threads = reconstruct(rollout.calls)
    assert trained_links(rollout, threads, ("main",)) == []
    assert trained_links(rollout, threads, ("main", "subagent")) == [(3, 4, len(rollout.calls[4].prompt_ids))]


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_a_step_over_every_thread_trains_and_reports_each_kind(name):
    """A whole step (tiny model) with subagents trained: per-kind targets, advantage and IS means,
    and for PPO the links placed."""
    from test_step_equivalence import VOCAB, tiny_policy

    from clawfast.train.step import train_step

    policy = tiny_policy(1, value_head=name == "ppo")
    rollouts = [subagent_session(seed, VOCAB, reward=float(seed % 2)) for seed in range(4)]
    assert all([t.kind for t in reconstruct(r.calls).calls].count("subagent") == 3 for r in rollouts)
    config = StepConfig(name=name, micro_batch_tokens=2048, train_threads=["main", "subagent"])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    metrics = train_step(policy, optimizer, rollouts, ["g"] * 4, config)
    assert np.isfinite(metrics["loss"])
    for k in ("main", "subagent"):
        assert metrics[f"threads/{k}/targets"] > 0 and metrics[f"threads/{k}/calls"] == 12  # 3 calls a rollout each
        assert np.isfinite(metrics[f"threads/{k}/advantage_mean"]) and metrics[f"threads/{k}/is_ratio_mean"] > 0
    if name == "grpo":  # every target of a rollout carries its advantage: rewards 0, 1, 0, 1 give +-0.866
        data = prepare_step(rollouts, ["g"] * 4, config)
        sub = np.concatenate(data.target_kind) == KINDS.index("subagent")
        adv = np.concatenate(data.advantages)
        assert metrics["threads/subagent/advantage_mean"] == pytest.approx(adv[sub].mean(), abs=1e-9)
    else:
        assert metrics["threads/links"] == 4 and metrics["threads/links_unused"] == 0


def test_the_step_line_names_trained_threads_and_side_calls_left_out():
    from clawfast.train.report import step_line

    rollouts = [subagent_session(seed, reward=float(seed % 2)) for seed in range(2)]
    for trained, want in ((["main"], "; side calls not trained: subagent 6"),
                          (["main", "subagent"], "; targets by thread: main ")):
        data = prepare_step(rollouts, ["g"] * 2, StepConfig(name="grpo", micro_batch_tokens=4096, train_threads=trained))
        line = step_line(1, {"loss": 0.0, **data.counts})
        assert want in line, line
        assert ("subagent" in line.split("targets by thread:")[-1]) == ("subagent" in trained or "not trained" in line)

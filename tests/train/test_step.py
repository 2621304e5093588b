"""train_step end to end (optimizer step, filters, metrics, errors) and the pieces it relies on."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_step_equivalence import flat_loss, harness_rollouts, longest_kept, tiny_policy

from clawfast.kernels import tree_gae_ref
from clawfast.pack import pack
from clawfast.records import RolloutResult
from clawfast.synthetic import random_group
from clawfast.train.algorithms import KeptForest, group_ids, grpo_rollout_advantages, ppo_advantages, stale_rollouts
from clawfast.train.policy import Policy
from clawfast.train.prepare import prepare_step
from clawfast.train.step import train_step
from clawfast.train.step_config import StepConfig
from clawfast.tree import build_tree
from clawfast.tree_ref import trainable_mask_ref


def adamw(p):
    # eps far above the gradient noise floor: the first Adam step is ~lr * sign(g), which would turn
    # 1e-9 rounding differences of near-zero gradients into lr-sized differences.
    return torch.optim.AdamW(p.parameters(), lr=1e-3, eps=1e-2, weight_decay=0.01)


def test_train_step_matches_flat_reference_optimizer_step(policy, rollouts):
    config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + 40, max_grad_norm=0.05, entropy_coef=0.01)
    packed, flat = copy.deepcopy(policy), copy.deepcopy(policy)
    metrics = train_step(packed, adamw(packed), rollouts, None, config)

    opt = adamw(flat)
    loss = flat_loss(flat, rollouts, config)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(flat.parameters(), 0.05)
    opt.step()
    assert metrics["stepped"] == 1.0 and metrics["grad_norm"] > 0.05, "clipping was not exercised"
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-4)
    for (name, a), b in zip(packed.named_parameters(), flat.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert a.grad is None  # zeroed after the step
    moved = sum(float((a - b).detach().abs().max()) for a, b in zip(packed.parameters(), policy.parameters()))
    assert moved > 0


def test_metrics_report_tokens_dedup_and_timings(policy, rollouts):
    config = StepConfig(micro_batch_tokens=4096)
    metrics = train_step(copy.deepcopy(policy), adamw(policy), rollouts, None, config)
    trees = [build_tree(r.calls) for r in rollouts]
    assert metrics["tokens_per_call_flat"] == sum(t.num_call_tokens for t in trees)
    assert metrics["tokens_per_leaf_flat"] == sum(t.num_flat_tokens for t in trees)
    # one batch holds everything: packed rows are the merged forest, below the per-rollout sum
    # because the samples of a task share their system prompt
    assert metrics["num_microbatches"] == 1
    kept_rows = KeptForest.build(trees).num_rows  # the kept sets, one per rollout, unmerged
    assert metrics["tokens_packed"] < kept_rows < metrics["tokens_per_leaf_flat"]
    assert metrics["dedup_ratio_call"] == pytest.approx(metrics["tokens_per_call_flat"] / metrics["tokens_packed"])
    assert metrics["num_targets"] == sum(int(trainable_mask_ref(t).sum()) for t in trees)
    for key in ("loss", "entropy", "kl_ref", "clip_frac", "is_ratio_mean", "is_frac_above", "mismatch_k3",
                "grad_norm", "time_total_s", "time_fwd_bwd_s", "time_prepare_s"):
        assert np.isfinite(metrics[key]), key
    assert metrics["entropy"] > 0 and metrics["rollouts_trained"] == len(rollouts)


def test_filters_status_staleness_and_groups(policy, rollouts):
    rs = [dataclasses.replace(r) for r in rollouts]
    rs[0] = dataclasses.replace(rs[0], status="timeout")
    old = [dataclasses.replace(c, weight_version=3) for c in rs[1].calls]
    rs[1] = dataclasses.replace(rs[1], calls=old)
    for r in rs[2:]:
        r.calls = [dataclasses.replace(c, weight_version=9) for c in r.calls]
    assert stale_rollouts(rs, 10, 2).tolist() == [True, True] + [False] * (len(rs) - 2)
    assert not stale_rollouts(rs, 10, None).any() and not stale_rollouts(rs, None, 2).any()
    data = prepare_step(rs, None, StepConfig(max_staleness=2), weight_version=10)
    # rs[0] is stale too, but counted once, under its status
    assert data.counts["dropped_status"] == 1 and data.counts["dropped_stale"] == 1
    assert [r.rollout_id for r in data.rollouts] == [r.rollout_id for r in rs[2:]]
    # GRPO over what is left: task0 keeps one sample (advantage 0), task1 keeps three
    adv = {int(g): set() for g in np.unique(np.concatenate([b.target_rollout for b in data.batches]))}
    for b, a in zip(data.batches, data.advantages):
        for g, v in zip(b.target_rollout, a):
            adv[int(g)].add(round(float(v), 9))
    assert adv[0] == {0.0} and all(len(v) == 1 for v in adv.values())
    # task x harness: the "codex" sample of each task is alone in its group
    ids = group_ids(rollouts, "task_harness")
    assert len(set(ids.tolist())) == 4
    adv_th = grpo_rollout_advantages([r.reward for r in rollouts], ids)
    assert adv_th[2] == 0.0 and adv_th[5] == 0.0 and adv_th[0] == -adv_th[1] != 0.0


def test_nothing_trainable_skips_the_optimizer(policy, rollouts):
    failed = [dataclasses.replace(r, status="harness_error") for r in rollouts]
    p = copy.deepcopy(policy)
    metrics = train_step(p, adamw(p), failed, None, StepConfig())
    assert metrics["stepped"] == 0.0 and metrics["loss"] == 0.0 and metrics["dropped_status"] == len(rollouts)
    for a, b in zip(p.parameters(), policy.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_pg_loss_is_the_surrogate_alone_and_loss_the_whole_objective(name):
    """pg_loss, kl_ref, entropy and value_loss are separate parts of loss (token-mean):
    loss = pg_loss + kl_coef * kl_ref - entropy_coef * entropy + value_loss, and pg_loss does not
    move with the KL and entropy coefficients (lr 0: every run sees the same weights)."""
    p = tiny_policy(0, value_head=name == "ppo")
    rs = harness_rollouts(p, seed=2)
    ref = copy.deepcopy(p)
    with torch.no_grad():  # a reference away from the policy: a KL that is not 0
        for w in ref.parameters():
            w.add_(0.05 * torch.randn_like(w, generator=torch.Generator().manual_seed(w.numel())))
    runs = {}
    for kl, ent in ((0.0, 0.0), (1.0, 0.5)):
        q = copy.deepcopy(p)
        config = StepConfig(name=name, micro_batch_tokens=longest_kept(rs) + 40, kl_coef=kl, entropy_coef=ent)
        runs[kl, ent] = train_step(q, torch.optim.SGD(q.parameters(), lr=0.0), rs, None, config, ref_policy=ref)
    plain, both = runs[0.0, 0.0], runs[1.0, 0.5]
    assert plain["kl_ref"] > 1e-3 and plain["entropy"] > 0
    assert both["pg_loss"] == pytest.approx(plain["pg_loss"], rel=1e-6, abs=1e-9)
    for m, (kl, ent) in ((plain, (0.0, 0.0)), (both, (1.0, 0.5))):
        want = m["pg_loss"] + kl * m["kl_ref"] - ent * m["entropy"] + m["value_loss"]
        assert m["loss"] == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert abs(both["loss"] - both["pg_loss"]) > 1e-2


def test_a_minibatch_whose_groups_were_all_dropped_is_not_an_update_in_the_metrics(policy, rollouts):
    """With two mini-batches, one made only of a too-long rollout's group, the step makes one
    update: its metrics are that update's, the same as with one mini-batch, not halved by a 0."""
    depth = [max(lf.depth for lf in build_tree(r.calls).leaves if lf.status == "kept") for r in rollouts]
    cut = sorted(set(depth))[-2]
    groups = ["long" if d > cut else "short" for d in depth]
    assert groups.count("long") >= 1 and groups.count("short") >= 2
    runs = {}
    for updates in (1, 2):
        p = copy.deepcopy(policy)
        config = StepConfig(micro_batch_tokens=cut, updates_per_step=updates)
        runs[updates] = train_step(p, torch.optim.SGD(p.parameters(), lr=0.0), rollouts, groups, config)
    one, two = runs[1], runs[2]
    assert one["num_updates"] == two["num_updates"] == 1.0 and two["dropped_too_long"] == groups.count("long")
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "clip_frac", "ratio_mean", "lr"):
        assert two[key] == pytest.approx(one[key], rel=1e-9, abs=1e-12), key
    assert one["loss"] != 0.0 and one["grad_norm"] > 0.0


def test_bad_config_and_inputs_raise(policy, rollouts):
    with pytest.raises(ValueError, match="name"):
        StepConfig(name="dpo")
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        StepConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="keep_statuses"):
        StepConfig(keep_statuses=("done",))
    with pytest.raises(ValueError, match="is_cap|cap"):
        StepConfig(is_cap=0.0)
    with pytest.raises(ValueError, match="value head"):
        train_step(policy, adamw(policy), rollouts, None, StepConfig(name="ppo"))
    with pytest.raises(ValueError, match="ref_policy"):
        train_step(policy, adamw(policy), rollouts, None, StepConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="group keys"):
        prepare_step(rollouts, ["a"], StepConfig())



def test_overlong_and_overbranching_rollouts_are_dropped_and_counted(rollouts):
    depth = [max(lf.depth for lf in build_tree(r.calls).leaves if lf.status == "kept") for r in rollouts]
    cut = sorted(depth)[len(depth) // 2]
    data = prepare_step(rollouts, None, StepConfig(micro_batch_tokens=cut))
    assert data.counts["dropped_too_long"] == sum(d > cut for d in depth) > 0
    trained = {int(g) for b in data.batches for g in b.target_rollout}
    assert trained == {g for g, d in enumerate(depth) if d <= cut}
    assert prepare_step(rollouts, None, StepConfig(micro_batch_tokens=16)).denominator == 0
    leaves = [len(build_tree(r.calls).kept_leaves) for r in rollouts]
    data = prepare_step(rollouts, None, StepConfig(max_kept_leaves=min(leaves)))
    assert data.counts["dropped_branching"] == sum(n > min(leaves) for n in leaves)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 4), n_calls=st.integers(1, 8), slack=st.integers(0, 8))
def test_kept_forest_locates_every_target_once(seed, k, n_calls, slack):
    rng = np.random.default_rng(seed)
    trees = [build_tree(c, max_kept_leaves=3) for c in random_group(rng, k, n_calls, vocab_size=3, max_len=24)]
    forest = KeptForest.build(trees)
    longest = max((lf.depth for t in trees if not t.dropped for lf in t.leaves if lf.status == "kept"), default=1)
    rows = np.concatenate([forest.locate(b) for b in pack(trees, longest + slack)] + [np.zeros(0, np.int64)])
    assert sorted(rows.tolist()) == np.flatnonzero(forest.trainable).tolist()
    want = sum(int(trainable_mask_ref(t).sum()) for t in trees if not t.dropped)
    assert forest.trainable.sum() == want
    assert np.all(forest.parent < np.arange(forest.num_rows))


@pytest.mark.parametrize("mode", ["path", "tree"])
def test_ppo_advantages_match_reference_gae(mode):
    # tree GAE on the unmerged kept forest == the kernels' plain per-path / per-node loops
    rng = np.random.default_rng(5)
    trees = [build_tree(c) for c in random_group(rng, 3, 8, vocab_size=3, max_len=24)]
    forest = KeptForest.build(trees)
    values = torch.as_tensor(rng.normal(size=forest.num_rows))
    rewards = rng.normal(size=len(trees))
    adv, ret = ppo_advantages(forest, values, rewards, gamma=0.9, lam=0.8, mode=mode)
    row_r = torch.as_tensor(np.where(forest.reward_row, rewards[forest.rollout], 0.0))
    want_adv, want_ret = tree_gae_ref(row_r, values, torch.as_tensor(forest.parent),
                                      mask=torch.as_tensor(forest.trainable, dtype=torch.float64), gamma=0.9,
                                      lam=0.8, mode=mode)
    torch.testing.assert_close(adv, want_adv, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, want_ret, atol=1e-9, rtol=1e-9)
    assert forest.reward_row.sum() >= len(trees) - 1


def test_ppo_step_trains_the_value_head():
    p = tiny_policy(3, value_head=True)
    rs = harness_rollouts(p, seed=6)
    before = p.value_head.weight.detach().clone()
    cfg = StepConfig(name="ppo", micro_batch_tokens=longest_kept(rs) + 40, gae_mode="tree")
    metrics = train_step(p, adamw(p), rs, None, cfg)
    assert metrics["value_loss"] > 0 and np.isfinite(metrics["advantage_mean"])
    assert not torch.equal(before, p.value_head.weight)


def test_explicit_group_keys_override_group_by(policy, rollouts):
    keys = ["x"] * len(rollouts)  # one group over everything
    data = prepare_step(rollouts, keys, StepConfig())
    rewards = np.array([r.reward for r in rollouts])
    want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    for b, a in zip(data.batches, data.advantages):
        np.testing.assert_allclose(a, want[b.target_rollout], rtol=1e-9)
    assert isinstance(rollouts[0], RolloutResult)


def test_policy_from_pretrained_directory_runs_packed_batches(tmp_path, policy, rollouts):
    policy.lm.save_pretrained(tmp_path)
    loaded = Policy.from_pretrained(tmp_path, value_head=True)
    batch = prepare_step(rollouts, None, StepConfig(micro_batch_tokens=4096)).batches[0]
    with torch.no_grad():
        want, got = policy.run(batch), loaded.run(batch)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-6, rtol=0)
    assert want.values is None and got.values.shape == (len(batch.input_ids),) and not got.values.any()
    with pytest.raises(ValueError, match="config.json"):
        Policy.from_pretrained(tmp_path / "missing")


def test_single_chain_takes_the_causal_path_with_the_same_result(policy):
    # kv_end all N-1 is plain causal attention; appending a separate root forces the dense tree mask
    ids = torch.randint(0, 64, (37,))
    chain = policy.hidden_states(ids, torch.arange(37), torch.full((37,), 36))
    pos = torch.cat([torch.arange(37), torch.zeros(1, dtype=torch.long)])
    kv_end = torch.cat([torch.full((37,), 36), torch.tensor([37])])
    forest = policy.hidden_states(torch.cat([ids, ids[:1]]), pos, kv_end)
    torch.testing.assert_close(chain, forest[:37], atol=1e-5, rtol=0)
    torch.testing.assert_close(forest[37], chain[0], atol=1e-5, rtol=0)


def _with_rewards(rollouts, rewards):
    return [dataclasses.replace(r, reward=float(x)) for r, x in zip(rollouts, rewards)]


def test_filter_groups_trains_only_groups_whose_rewards_differ(policy, rollouts):
    # task0 (rollouts 0-2) all solved: no signal; task1 (3-5) mixed
    rs = _with_rewards(rollouts, [1, 1, 1, 0, 1, 0])
    plain = prepare_step(rs, None, StepConfig(micro_batch_tokens=4096))
    data = prepare_step(rs, None, StepConfig(micro_batch_tokens=4096, filter_groups=True, updates_per_step=2))
    assert data.counts["dropped_uniform_group"] == 3 and data.counts["rollouts_trained"] == 3
    trained = {int(g) for b in data.batches for g in b.target_rollout}
    assert trained == {3, 4, 5}
    assert len(data.minibatches) == 1  # one group left: one update, not one per configured mini-batch
    # the kept group's advantages are the unfiltered ones
    want = {int(g): float(a) for b, adv in zip(plain.batches, plain.advantages) for g, a in zip(b.target_rollout, adv)}
    for b, adv in zip(data.batches, data.advantages):
        for g, a in zip(b.target_rollout, adv):
            assert float(a) == want[int(g)] != 0.0
    with pytest.raises(ValueError, match="filter_groups"):
        StepConfig(name="ppo", filter_groups=True)


def test_filter_groups_makes_no_update_without_signal_where_adam_would_drift(policy, rollouts):
    signal = _with_rewards(rollouts, [1, 0, 1, 0, 1, 0])
    flat = _with_rewards(rollouts, [1, 1, 1, 0, 0, 0])
    moved = {}
    for filtered in (False, True):
        p = copy.deepcopy(policy)
        opt = adamw(p)
        config = StepConfig(micro_batch_tokens=4096, filter_groups=filtered)
        train_step(p, opt, signal, None, config)
        after_first = [a.detach().clone() for a in p.parameters()]
        metrics = train_step(p, opt, flat, None, config)
        moved[filtered] = max(float((a.detach() - b).abs().max()) for a, b in zip(p.parameters(), after_first))
        assert metrics["stepped"] == float(not filtered)
    assert moved[True] == 0.0 and moved[False] > 0.0  # zero advantages, yet Adam's momentum moves every weight


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 6), min_size=1, max_size=40), n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_split_groups_over_members_keeps_groups_whole(ids, n, seed):
    from clawfast.train.prepare import split_groups

    # first-appearance group indices, as group_ids makes them
    index: dict[int, int] = {}
    ids = np.array([index.setdefault(i, len(index)) for i in ids], dtype=np.int64)
    members = np.flatnonzero(np.random.default_rng(seed).random(len(ids)) < 0.6)
    parts = split_groups(ids, n, members)
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    assert sorted(flat.tolist()) == members.tolist()
    assert len(parts) == max(1, min(n, len(set(ids[members].tolist()))))
    owner = {}
    for k, part in enumerate(parts):
        for g in ids[part]:
            assert owner.setdefault(int(g), k) == k


def test_warmup_ramps_the_learning_rate_from_the_optimizers_own_count(policy, rollouts):
    from clawfast.train.warmup import updates_done

    rs = _with_rewards(rollouts, [1, 0, 1, 0, 1, 0])
    config = StepConfig(micro_batch_tokens=4096, warmup_updates=4, updates_per_step=2)
    p = copy.deepcopy(policy)
    opt = adamw(p)
    lrs = []
    for _ in range(3):
        lrs.append(train_step(p, opt, rs, None, config)["lr"])  # two updates per step, lr averaged
    assert lrs == pytest.approx([1e-3 * 1.5 / 4, 1e-3 * 3.5 / 4, 1e-3])
    assert updates_done(opt) == 6
    # a resumed run: a new optimizer loaded from the saved state continues the ramp, not restarts it
    again = adamw(p)
    again.load_state_dict(opt.state_dict())
    assert updates_done(again) == 6 and train_step(p, again, rs, None, config)["lr"] == pytest.approx(1e-3)
    fresh = copy.deepcopy(policy)
    assert train_step(fresh, adamw(fresh), rs, None, StepConfig(micro_batch_tokens=4096))["lr"] == 1e-3

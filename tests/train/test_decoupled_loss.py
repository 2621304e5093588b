"""The off-policy objective through the step: proximal pass, PPO epochs x mini-batches, sequence-level IS,
the mismatch metrics and their verl names.

The loss formula itself is checked against a plain float64 reference in tests/kernels/test_policy_loss.py
(``test_decoupled_loss_matches_float64_reference``); here the references are flat per-leaf forwards of
the same model (as in test_step_equivalence.py), so they share nothing with the packed path but the model
and the prefix tree. Tolerances: fp32 forwards on both sides, differing only in reduction order.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_step_equivalence import harness_rollouts, longest_kept, path_forward, tiny_policy

from clawfast.train import step as step_module
from clawfast.train.checkpoint import TrainState
from clawfast.train.config_file import ConfigError, config_from_dict
from clawfast.train.prepare import prepare_step
from clawfast.train.proximal import fix_step
from clawfast.train.step import train_on_rollouts, train_step
from clawfast.train.step_config import StepConfig, step_config
from clawfast.train.update import accumulate_gradients
from clawfast.train.verl_names import VERL_MISMATCH_NAMES, VERL_RATIO_NAMES
from clawfast.tree_ref import kept_leaf_paths_ref, trainable_mask_ref


def adamw(p, lr=1e-3):
    return torch.optim.AdamW(p.parameters(), lr=lr)


def grads(p):
    return [q.grad.clone() for q in p.parameters()]


def test_ppo_epochs_and_minibatches_make_the_clip_act(policy, rollouts):
    # 2 tasks -> 2 mini-batches of whole groups; 3 epochs: 6 updates against one proximal pass
    config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + 40, ppo_epochs=3, updates_per_step=2, clip_low=0.1,
                        max_grad_norm=None)  # no clipping, so that the hand-written loop below is train_step's
    p = copy.deepcopy(policy)
    opt = adamw(p)
    data = prepare_step(rollouts, None, config)
    assert len(data.minibatches) == 2 and sorted(np.concatenate(data.minibatches).tolist()) == list(
        range(len(data.batches)))
    for mb in data.minibatches:  # a mini-batch holds whole groups
        tasks = {data.rollouts[g].task_id for b in mb for g in data.batches[b].target_rollout}
        assert len(tasks) == 1
    fixed = fix_step(p, data, config)
    assert fixed.proximal is not None and fixed.is_weights is not None
    proximal = fixed.proximal.clone()
    per_update = []
    for _ in range(config.ppo_epochs):
        for k in range(len(data.minibatches)):
            opt.zero_grad()
            per_update.append(accumulate_gradients(p, data, config, fixed=fixed, minibatch=k))
            opt.step()
    # the first update runs at the proximal policy: ratio 1, nothing clipped
    assert per_update[0]["clip_frac"] == 0.0 and per_update[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert all(m["clip_frac"] > 0 and m["approx_kl_old"] > 0 for m in per_update[2:])
    assert torch.equal(fixed.proximal, proximal)  # fixed for the whole step

    # the same through train_step: clip_frac is the mean over the updates
    p2 = copy.deepcopy(policy)
    metrics = train_step(p2, adamw(p2), rollouts, None, config)
    assert metrics["num_updates"] == 6 and metrics["stepped"] == 1.0
    assert metrics["clip_frac"] == pytest.approx(np.mean([m["clip_frac"] for m in per_update]), abs=1e-6)
    assert metrics["clip_frac"] > 0
    for a, b in zip(p.parameters(), p2.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_train_on_rollouts_orders_minibatches_by_seed_and_step(policy, rollouts, monkeypatch):
    config = config_from_dict({"seed": 3, "optim": {"ppo_epochs": 3, "updates_per_step": 2, "lr": 1e-3,
                                                     "micro_batch_tokens": longest_kept(rollouts) + 40}})
    assert step_config(config).ppo_epochs == 3 and step_config(config).updates_per_step == 2
    state = TrainState(step=5, weight_version=5)
    seen = []
    real = step_module._update

    def spy(policy_, optimizer, data, cfg, fixed, minibatch, ref_policy):
        seen.append(minibatch)
        return real(policy_, optimizer, data, cfg, fixed, minibatch, ref_policy)

    monkeypatch.setattr(step_module, "_update", spy)
    runs = []
    for _ in range(2):
        seen.clear()
        p = copy.deepcopy(policy)
        metrics = train_on_rollouts(p, adamw(p), rollouts, config, state)
        runs.append((list(seen), p, metrics))
    rng = np.random.default_rng([3, 5, 8])
    assert runs[0][0] == [int(k) for _ in range(3) for k in rng.permutation(2)]
    assert runs[0][0] == runs[1][0] and runs[0][2]["clip_frac"] > 0
    for a, b in zip(runs[0][1].parameters(), runs[1][1].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_one_update_is_the_same_with_or_without_the_proximal_pass(name):
    # one update at token level skips the proximal pass (old = the update's forward, detached); a
    # proximal pass at the same weights must give the same loss, gradients and IS metrics
    p = tiny_policy(4, value_head=name == "ppo")
    rs = harness_rollouts(p, seed=3)
    config = StepConfig(name=name, micro_batch_tokens=longest_kept(rs) + 40, is_cap=1.3, entropy_coef=0.01)
    data = prepare_step(rs, None, config)
    skipped = accumulate_gradients(p, data, config)
    want = grads(p)
    p.zero_grad(set_to_none=True)
    fixed = fix_step(p, data, config.model_copy(update={"ppo_epochs": 2}))
    assert fixed.proximal is not None
    got = accumulate_gradients(p, data, config, fixed=fixed)
    for a, b in zip(grads(p), want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for key in ("loss", "clip_frac", "is_ratio_mean", "is_frac_above", "is_weight_mean", "mismatch_k3",
                "mismatch_log_ppl_diff", "rollout_corr/kl"):
        assert got[key] == pytest.approx(skipped[key], rel=1e-5, abs=1e-7), key
    assert 0 < skipped["is_frac_above"] < 1


def _leaf_paths(tree):
    """{leaf index: token indices of its root-to-leaf path} of the kept leaves."""
    kept = [i for i, leaf in enumerate(tree.leaves) if leaf.status == "kept"]
    return dict(zip(kept, kept_leaf_paths_ref(tree)))


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_level_weights_match_flat_paths(policy, rollouts, mode):
    # small micro-batches: the trees are split, but a path's weight is over the whole path
    # the sampler's log-probs are the model's plus noise, capped at 0, so path ratios lie in ~[1.4, 16]
    config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + 3, is_level="sequence", is_mode=mode, is_cap=4.0,
                        is_lo=2.5, is_hi=8.0)
    data = prepare_step(rollouts, None, config)
    assert len(data.batches) >= 3 and sum(int(b.is_context.sum()) for b in data.batches) > 0, "no split"
    fixed = fix_step(policy, data, config)

    # reference: every kept leaf's path alone through the model; w(prod over its trainable tokens)
    def weight(log_rho):
        rho = np.exp(log_rho)
        return min(rho, 4.0) if mode == "truncate" else (rho if 2.5 <= rho <= 8.0 else 0.0)

    path_w = {}  # (rollout, leaf) -> weight
    through = {}  # (rollout, token) -> weights of the paths through it
    for g, tree in enumerate(data.trees):
        train = trainable_mask_ref(tree)
        for leaf, path in _leaf_paths(tree).items():
            ids = torch.as_tensor(tree.tokens[path], dtype=torch.long)
            with torch.no_grad():
                logp = path_forward(policy, ids)[0].double()
            pos = [d for d in range(1, len(path)) if train[path[d]]]
            log_rho = sum(float(logp[d - 1, ids[d]]) - float(tree.infer_logprobs[path[d]]) for d in pos)
            path_w[(g, leaf)] = weight(log_rho)
            for d in pos:
                through.setdefault((g, int(path[d])), []).append(path_w[(g, leaf)])
    want = []
    for b in data.batches:
        depth = b.position_ids[b.target_rows] + 1
        for g, leaf, d in zip(b.target_rollout, b.target_leaf, depth):
            token = int(_leaf_paths(data.trees[g])[int(leaf)][d])
            want.append(np.mean(through[(int(g), token)]))
    want = torch.tensor(want, dtype=torch.float64)
    # fp32 forwards summed over paths of ~100 tokens: a few 1e-6 in log-ratio
    torch.testing.assert_close(fixed.is_weights.cpu(), want, rtol=1e-4, atol=1e-6)
    ws = np.array(list(path_w.values()))
    assert fixed.metrics["is_count"] == len(path_w)
    assert 0 < fixed.metrics["is_frac_above"] + fixed.metrics["is_frac_below"] < 1
    assert len(np.unique(ws.round(6))) > 2, "path weights do not vary: the comparison proves little"
    # and through a whole step
    p = copy.deepcopy(policy)
    metrics = train_step(p, adamw(p), rollouts, None, config)
    assert metrics["stepped"] == 1.0 and metrics["is_count"] == len(path_w)
    assert metrics["rollout_corr/chi2_seq"] == metrics["is_chi2"] and "rollout_corr/chi2_token" not in metrics


@pytest.mark.parametrize("mode", ["truncate", "mask", "off"])
def test_mismatch_metrics_and_their_verl_names(policy, rollouts, mode):
    config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + 40, is_mode=mode, is_cap=1.3, is_lo=0.7, is_hi=1.4)
    p = copy.deepcopy(policy)
    metrics = train_step(p, adamw(p), rollouts, None, config)
    for ours, verl in VERL_MISMATCH_NAMES.items():
        assert metrics[verl] == metrics[ours], verl
    assert metrics["rollout_corr/chi2_token"] == metrics["is_chi2"]
    if mode == "off":
        assert not any(k.startswith(("rollout_corr/rollout_is_", "rollout_corr/rollout_rs_")) for k in metrics)
    else:  # verl's IS statistics: fractions of rho, mean / max / min of the applied token weights
        for ours, verl in VERL_RATIO_NAMES.items():
            assert metrics[verl] == metrics[ours], verl
        assert metrics["rollout_corr/rollout_is_max"] <= (1.3 if mode == "truncate" else 1.4)
        assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(
            0.0 if metrics["is_frac_below"] + metrics["is_frac_above"] > 0 and mode == "mask"
            else metrics["is_ratio_min"])
        assert 0 < metrics["rollout_corr/rollout_is_mean"] <= metrics["rollout_corr/rollout_is_max"]
    if mode == "mask":
        rejected = metrics["rollout_corr/rollout_rs_masked_fraction"]
        assert rejected == metrics["is_frac_above"] + metrics["is_frac_below"] and 0 < rejected < 1

    # log-perplexities against the flat forwards: per rollout, the mean NLL of its unique trainable
    # tokens under the trainer (at the step's start) and the sampler, then the mean over rollouts
    data = prepare_step(rollouts, None, config)
    train_nll, infer_nll = [], []
    for tree in data.trees:
        train = trainable_mask_ref(tree)
        tokens = {}
        for path in kept_leaf_paths_ref(tree):
            ids = torch.as_tensor(tree.tokens[path], dtype=torch.long)
            with torch.no_grad():
                logp = path_forward(policy, ids)[0].double()
            for d in range(1, len(path)):
                if train[path[d]]:
                    tokens[int(path[d])] = (float(logp[d - 1, ids[d]]), float(tree.infer_logprobs[path[d]]))
        lp, infer = np.array(list(tokens.values())).T
        train_nll.append(-lp.mean())
        infer_nll.append(-infer.mean())
    train_nll, infer_nll = np.array(train_nll), np.array(infer_nll)
    assert metrics["mismatch_log_ppl_train"] == pytest.approx(train_nll.mean(), rel=1e-5)
    assert metrics["mismatch_log_ppl_infer"] == pytest.approx(infer_nll.mean(), rel=1e-6)
    assert metrics["mismatch_log_ppl_diff"] == pytest.approx((train_nll - infer_nll).mean(), rel=1e-4)
    assert metrics["mismatch_log_ppl_abs_diff"] == pytest.approx(np.abs(train_nll - infer_nll).mean(), rel=1e-4)
    assert metrics["mismatch_log_ppl_abs_diff"] > abs(metrics["mismatch_log_ppl_diff"]) > 0


def test_bad_off_policy_config_raises(policy, rollouts):
    with pytest.raises(ValueError, match="is_level"):
        StepConfig(is_level="sequence", is_mode="off")
    with pytest.raises(ValueError, match="is_level"):
        StepConfig(is_level="path")
    with pytest.raises(ValueError, match="ppo_epochs"):
        StepConfig(ppo_epochs=0)
    with pytest.raises(ConfigError, match="ppo_epochs"):
        config_from_dict({"optim": {"ppo_epochs": 0}})
    with pytest.raises(ConfigError, match="is_level"):
        config_from_dict({"algorithm": {"is_level": "sequence", "is_mode": "off"}})
    config = StepConfig(ppo_epochs=2)
    with pytest.raises(ValueError, match="fix_step"):
        accumulate_gradients(policy, prepare_step(rollouts, None, config), config)

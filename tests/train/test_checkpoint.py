"""Checkpoints: exact round trip of weights, optimizer, state and RNG; atomic LATEST; pruning."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from clawfast.train.checkpoint import (
    COMPLETE,
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from clawfast.train.policy import Policy

from loop_fixtures import VOCAB, make_tiny_model


def _policy(tmp_path, value_head=False) -> Policy:
    model_dir = make_tiny_model(tmp_path / "model")
    return Policy.from_pretrained(model_dir, value_head=value_head)


def _train_a_bit(policy: Policy, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, 17), generator=g)
    for _ in range(2):
        out = policy.lm(input_ids=ids).logits
        loss = out.logsumexp(-1).mean() - out[0, :, 3].mean()
        if policy.value_head is not None:
            loss = loss + policy.value_head(out[0, :, :32].detach()).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("value_head", [False, True])
def test_round_trip_is_exact(tmp_path, value_head):
    policy = _policy(tmp_path, value_head)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    _train_a_bit(policy, optimizer, 1)
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    state = TrainState(step=4, data_position=8, weight_version=5, extra={"coldstart_done": True})
    path = save_checkpoint(tmp_path / "run", policy, optimizer, state, tokenizer_dir=None)
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())

    fresh = _policy(tmp_path / "other", value_head)  # different random init? same seed: perturb it
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loaded = load_checkpoint(path, fresh, fresh_opt)
    assert loaded == state
    for (name, a), (_, b) in zip(policy.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    sa, sb = optimizer.state_dict(), fresh_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for key in sa["state"][k]:
            assert torch.equal(torch.as_tensor(sa["state"][k][key]), torch.as_tensor(sb["state"][k][key]))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws
    # The two continue identically.
    _train_a_bit(policy, optimizer, 2)
    _train_a_bit(fresh, fresh_opt, 2)
    for a, b in zip(policy.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_model_dir_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    policy = _policy(tmp_path)
    path = save_checkpoint(tmp_path / "run", policy, torch.optim.AdamW(policy.parameters()), TrainState(step=1))
    lm = AutoModelForCausalLM.from_pretrained(path / "model")
    for (name, a), b in zip(policy.lm.state_dict().items(), lm.state_dict().values()):
        assert torch.equal(a, b), name


def test_latest_pruning_and_incomplete_dirs(tmp_path):
    policy = _policy(tmp_path)
    opt = torch.optim.AdamW(policy.parameters())
    run = tmp_path / "run"
    assert latest_checkpoint(run) is None
    for step in (2, 4, 6):
        save_checkpoint(run, policy, opt, TrainState(step=step, data_position=2 * step), keep=2)
    assert [p.name for p in list_checkpoints(run)] == ["step-000004", "step-000006"]
    assert latest_checkpoint(run).name == "step-000006"
    assert read_state(latest_checkpoint(run)).data_position == 12
    # A torn write (no COMPLETE marker) is never picked, even if LATEST pointed at it.
    torn = run / "checkpoints" / "step-000008"
    torn.mkdir()
    (run / "checkpoints" / "LATEST").write_text("step-000008\n")
    assert latest_checkpoint(run).name == "step-000006"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(torn, policy)
    assert not any(p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir())
    assert json.loads((run / "checkpoints" / "step-000006" / "state.json").read_text())["step"] == 6
    assert (run / "checkpoints" / "step-000006" / COMPLETE).is_file()


def test_a_run_that_went_on_from_an_older_latest_replaces_the_checkpoints_past_it(tmp_path):
    """Killed between renaming step 4 into place and naming it in LATEST, the run resumed from step 2
    and saved step 3 with keep = 1: pruning kept the stale step 4 (the newest by name) and deleted the
    step 3 just written, and the stale one passed for the run's latest. The checkpoints past the step
    saved are the earlier attempt's: they go, and keep counts the rest."""
    policy = _policy(tmp_path)
    opt = torch.optim.AdamW(policy.parameters())
    run = tmp_path / "run"
    for step in (2, 4):
        save_checkpoint(run, policy, opt, TrainState(step=step))
    (run / "checkpoints" / "LATEST").write_text("step-000002\n")  # as the kill left it
    save_checkpoint(run, policy, opt, TrainState(step=3), keep=1)
    assert [p.name for p in list_checkpoints(run)] == ["step-000003"] and latest_checkpoint(run).name == "step-000003"


def test_a_step_saved_again_keeps_its_old_copy_until_the_new_one_is_named(tmp_path, monkeypatch):
    """A step saved again (a re-run after a crash before LATEST named it): the old copy was deleted
    before the new one was renamed into place, so a kill there left LATEST naming nothing, and with
    keep = 1 no checkpoint at all. It is moved aside, and dropped once the new copy is named."""
    import os

    from clawfast.train import checkpoint

    policy = _policy(tmp_path)
    opt = torch.optim.AdamW(policy.parameters())
    run = tmp_path / "run"
    save_checkpoint(run, policy, opt, TrainState(step=4, data_position=1), keep=1)
    rename = os.rename

    def killed(src, dst):
        if os.path.basename(src) == ".tmp-step-000004":
            raise KeyboardInterrupt  # the kill, as the new copy was about to take the old one's place
        rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run, policy, opt, TrainState(step=4, data_position=2), keep=1)
    monkeypatch.setattr(checkpoint.os, "rename", rename)
    assert (run / "checkpoints" / ".replaced-step-000004" / COMPLETE).is_file()  # the old copy, kept
    save_checkpoint(run, policy, opt, TrainState(step=4, data_position=3), keep=1)
    assert [p.name for p in list_checkpoints(run)] == ["step-000004"]
    assert read_state(latest_checkpoint(run)).data_position == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step-000004"]


def test_checkpoints_past_a_million_steps_sort_by_step(tmp_path):
    policy = _policy(tmp_path)
    opt = torch.optim.AdamW(policy.parameters())
    for step in (999_999, 1_000_000):
        save_checkpoint(tmp_path / "run", policy, opt, TrainState(step=step), keep=1)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-1000000"]


@pytest.mark.parametrize("damage, says", [("state", "state.json is not JSON"),
                                          ("trainer", "cannot be loaded into this run's policy: FileNotFoundError"),
                                          ("weights", "cannot be loaded into this run's policy"),
                                          ("wider", "size mismatch")])
def test_a_damaged_or_foreign_checkpoint_is_a_clear_error_naming_it(tmp_path, damage, says):
    """A torn state.json, a trainer.pt gone, emptied weights, or a checkpoint of a model of another
    width: a ValueError naming the checkpoint (`clawfast train` exits 2 with it), not a traceback."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    policy = _policy(tmp_path)
    ckpt = save_checkpoint(tmp_path / "run", policy, torch.optim.AdamW(policy.parameters()), TrainState(step=4))
    if damage == "state":
        (ckpt / "state.json").write_text('{"step": 4,\n')
    elif damage == "trainer":
        (ckpt / "trainer.pt").unlink()
    elif damage == "weights":
        (ckpt / "model" / "model.safetensors").write_bytes(b"")
    else:
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
        Qwen3ForCausalLM(config).save_pretrained(tmp_path / "wide")
        policy = Policy.from_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        load_checkpoint(ckpt, policy, torch.optim.AdamW(policy.parameters()))
    assert str(ckpt) in str(err.value)


def test_mismatched_weights_are_refused(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    policy = _policy(tmp_path)
    path = save_checkpoint(tmp_path / "run", policy, torch.optim.AdamW(policy.parameters()), TrainState(step=1))
    other = Policy(Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8)))
    with pytest.raises(ValueError, match="do not match"):
        load_checkpoint(path, other)


@pytest.mark.parametrize("saved_ppo", [False, True])
def test_switching_between_grpo_and_ppo_is_refused_naming_algorithm_name(tmp_path, saved_ppo):
    """A PPO checkpoint holds a value head, a GRPO one none: resuming either with the other algorithm
    says so (it was a missing value_head.safetensors, or torch's optimizer param-group error)."""
    policy = _policy(tmp_path, value_head=saved_ppo)
    path = save_checkpoint(tmp_path / "run", policy, torch.optim.AdamW(policy.parameters()), TrainState(step=1))
    other = _policy(tmp_path / "other", value_head=not saved_ppo)
    saved = "ppo" if saved_ppo else "grpo"
    with pytest.raises(ValueError, match=rf"{saved.upper()} run's checkpoint.*algorithm.name \('{saved}'\)"):
        load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))
    load_checkpoint(path, _policy(tmp_path / "same", value_head=saved_ppo))  # the run's own algorithm loads


def test_resume_takes_the_saved_moments_and_the_configured_hyperparameters(tmp_path):
    """The optimizer's moments and step counts resume; its lr, betas, eps and weight decay (and the
    warm-up's base lr) are those of the resumed run's config, which its config.json records."""
    from clawfast.train.build import build_optimizer
    from clawfast.train.config_file import config_from_dict
    from clawfast.train.warmup import updates_done, warm_up

    policy = _policy(tmp_path)
    first = config_from_dict({"optim": {"lr": 1e-5, "weight_decay": 0.0}})
    optimizer = build_optimizer(first, policy)
    warm_up(optimizer, 10)  # the ramp keeps its base lr in the groups (initial_lr)
    _train_a_bit(policy, optimizer, 1)
    path = save_checkpoint(tmp_path / "run", policy, optimizer, TrainState(step=2))

    changed = config_from_dict({"optim": {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.8, 0.99], "eps": 1e-6}})
    resumed = build_optimizer(changed, policy)
    load_checkpoint(path, policy, resumed)
    for group in resumed.param_groups:
        hyper = (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])
        assert hyper == (1e-3, (0.8, 0.99), 1e-6, 0.1)
        assert group["initial_lr"] == 1e-3  # the ramp's base: the configured lr, not the saved 1e-5
    assert updates_done(resumed) == updates_done(optimizer) == 2
    for p in policy.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed.state[p][key], optimizer.state[p][key]), key
    assert warm_up(resumed, 10) == pytest.approx(1e-3 * 3 / 10)  # the ramp continues at the configured lr


def test_an_moe_checkpoint_loads_back_exactly(tmp_path):
    """transformers (from 5.0) holds an MoE layer's experts fused in memory and saves them one tensor
    per expert: a full-weight MoE run's checkpoint is read back through transformers' own loading,
    every tensor equal."""
    from tiny_moe import tiny_moe

    policy = Policy(tiny_moe("qwen3_moe", vocab_size=VOCAB))
    path = save_checkpoint(tmp_path / "run", policy, torch.optim.AdamW(policy.parameters()), TrainState(step=1))
    fresh = Policy(tiny_moe("qwen3_moe", vocab_size=VOCAB, seed=1))
    load_checkpoint(path, fresh)
    for (name, a), (_, b) in zip(policy.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name

"""RL passes run the policy in train mode with every dropout off (`clawfast.train.policy.rl_mode`, applied by
`train_step`): gradient checkpointing recomputes each layer (transformers checkpoints in train mode only),
and the proximal pass and each update's forward are one function (the PPO ratio is exactly 1 at unchanged
weights), while the cold start's supervised passes keep the model's dropout. Policies are built as a run
builds them (`build_policy`: from_pretrained, in eval mode) and run in float64."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from loop_fixtures import VOCAB
from test_step_equivalence import harness_rollouts, longest_kept

from clawfast.train.build import build_engine, build_optimizer, build_policy
from clawfast.train.checkpoint import TrainState
from clawfast.train.coldstart import demonstration_tree, sft_epoch
from clawfast.train.config import EngineConfig, RunConfig
from clawfast.train.step import train_on_rollouts


def model_dir(path, attention_dropout: float = 0.0):
    """A 2-layer Qwen3 directory (loop_fixtures.make_tiny_model's shape) with `attention_dropout`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                         tie_word_embeddings=True, attention_dropout=attention_dropout)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def built(path, *, lora: dict | None = None, ppo_epochs: int = 1, **model):
    """(policy in float64, its RunConfig, rollouts) as `clawfast train` builds the policy; a LoRA adapter's
    B matrices random (peft starts them at 0, where dropout on the adapter's input changes nothing)."""
    probe = build_policy(RunConfig.model_validate({"model": {"path": str(path)}}), path)
    rollouts = harness_rollouts(probe, seed=2)
    config = RunConfig.model_validate({
        "model": {"path": str(path), "attention": "torch", "lora": lora, **model},
        "optim": {"micro_batch_tokens": longest_kept(rollouts) + 40, "ppo_epochs": ppo_epochs, "lr": 1e-3},
    })
    torch.manual_seed(1)  # peft draws the adapter's A matrices from torch's generator
    policy = build_policy(config, path).double()
    with torch.no_grad():
        for name, p in policy.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy, config, rollouts


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8.0}])
def test_gradient_checkpointing_recomputes_each_layer_in_an_rl_step(tmp_path, lora):
    """Each decoder layer's MLP starts once per micro-batch more with checkpointing: its recomputation in
    backward, in every update (none in the no-grad proximal pass); the step's loss, gradient norm and
    updated weights are those without checkpointing."""
    path = model_dir(tmp_path / "model")
    runs = {}
    for checkpointing in (False, True):
        policy, config, rollouts = built(path, lora=lora, ppo_epochs=2, gradient_checkpointing=checkpointing)
        calls = Counter()
        for layer in policy.lm.model.layers:
            # a pre-hook: torch's non-reentrant recomputation stops once it has what backward needs,
            # inside the MLP's forward, before a forward hook would run
            layer.mlp.register_forward_pre_hook(lambda *_: calls.update([torch.is_grad_enabled()]))
        metrics = train_on_rollouts(policy, build_optimizer(config, policy), rollouts, config, TrainState())
        runs[checkpointing] = calls, metrics, {k: v.detach().clone() for k, v in policy.named_parameters()}
    (plain, m_plain, w_plain), (ckpt, m_ckpt, w_ckpt) = runs[False], runs[True]
    assert plain[True] > 0 and plain[False] > 0  # update forwards and the proximal pass
    assert ckpt[False] == plain[False] and ckpt[True] == 2 * plain[True]
    assert m_ckpt["grad_norm"] > 0
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert m_ckpt[key] == pytest.approx(m_plain[key], rel=1e-12, abs=1e-14), key
    for name, w in w_plain.items():
        torch.testing.assert_close(w_ckpt[name], w, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", ["lora_dropout", "attention_dropout"])
def test_rl_passes_run_without_dropout_the_cold_start_keeps_it(tmp_path, case):
    """With model.lora.dropout = 0.5 or a model's attention_dropout = 0.3: the cold start's supervised
    passes draw dropout (two epochs at lr 0 differ); then an RL step of 2 PPO epochs at lr 0 compares
    identical passes (ratio exactly 1, approx_kl_old 0: every pass gives the same log-probs), and a
    torch engine's copy of the model stays in eval mode with its own dropout."""
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.5} if case == "lora_dropout" else None
    path = model_dir(tmp_path / "model", attention_dropout=0.3 if case == "attention_dropout" else 0.0)
    policy, config, rollouts = built(path, lora=lora, ppo_epochs=2)
    engine = build_engine(EngineConfig(kind="torch"), path, lm=policy.lm)
    frozen = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)  # weights never change

    nll = [sft_epoch(policy, frozen, [demonstration_tree(r) for r in rollouts[:3]], micro_batch_tokens=config.optim.micro_batch_tokens,
                     batch_rollouts=3, rng=np.random.default_rng(0))["nll"] for _ in range(2)]
    assert nll[0] != nll[1]  # the cold start's dropout acts

    passes = []
    policy.register_forward_hook(lambda _m, _a, out: passes.append(out.logprobs.detach().clone()))
    metrics = train_on_rollouts(policy, frozen, rollouts, config, TrainState())
    assert metrics["num_updates"] == 2 and len(passes) % 3 == 0  # proximal pass + 2 updates, same micro-batches
    k = len(passes) // 3
    for b in range(k):
        assert torch.equal(passes[b], passes[k + b]) and torch.equal(passes[b], passes[2 * k + b])
    assert metrics["ratio_mean"] == 1.0 and metrics["approx_kl_old"] == 0.0 and metrics["clip_frac"] == 0.0
    assert policy.lm.training  # train mode (gradient checkpointing acts), dropout off

    served = engine.model
    assert not served.training and not any(m.training for m in served.modules())
    if lora is not None:
        assert {m.p for n, m in served.named_modules() if isinstance(m, torch.nn.Dropout) and "lora" in n} == {0.5}
    else:
        assert {m.attention_dropout for m in served.modules() if hasattr(m, "attention_dropout")} == {0.3}

"""A mixture-of-experts policy through the whole loop: `clawfast train` on a tiny Qwen3-MoE (random
weights, the embedded model's tokenizer) with real mini-swe-agent rollouts in bubblewrap, the scripted
engine playing each task's oracle (the test is about the policy, not about what the model says). The
step trains with tree attention, its router and experts learn, and on the step's real rollouts the
keystone holds: every target's log-prob in the packed trees equals its path's run alone."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from loop_fixtures import oracle_engine_factory, record_trained
from test_keystone import assert_keystone
from tiny_moe import tiny_moe

pytestmark = [
    pytest.mark.harness,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("socat") is None,
                       reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)"),
]


def test_a_moe_policy_trains_a_step_of_real_harness_rollouts(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from clawfast.embedded import ensure_embedded_model
    from clawfast.pack import pack
    from clawfast.tasks import clawbench_mini
    from clawfast.threads import reconstruct, with_kinds
    from clawfast.train import loop
    from clawfast.train.checkpoint import copy_tokenizer, latest_checkpoint
    from clawfast.train.config_file import config_from_dict
    from clawfast.train.metrics_log import read_metrics
    from clawfast.train.policy import Policy
    from clawfast.tree import build_tree

    embedded = ensure_embedded_model()
    model_dir = tmp_path / "tiny-moe"
    initial = tiny_moe("qwen3_moe", vocab_size=AutoConfig.from_pretrained(embedded).vocab_size, seed=0)
    initial.save_pretrained(model_dir)
    copy_tokenizer(embedded, model_dir)

    config = config_from_dict({
        "run_dir": str(tmp_path / "run"), "steps": 1, "seed": 1,
        "model": {"path": str(model_dir), "attention": "torch"},
        "tasks": {"difficulties": ["easy"]},
        "rollout": {"harnesses": ["mini-swe-agent"], "tasks_per_step": 1, "samples_per_task": 2, "concurrency": 2,
                    "sandbox": "bwrap", "harness_max_turns": 8, "timeout_s": 240,
                    "harness_options": {"mini-swe-agent": {"instance_template": "Task: {{task}}"}}},
        # PPO: the oracle solves every rollout, so GRPO's advantages would all be 0; a critic's are not.
        "algorithm": {"name": "ppo"},
        "eval": {"before": False, "after": False},
        "optim": {"micro_batch_tokens": 4096, "lr": 1e-2},
        "checkpoint": {"interval": 1},
    })
    tasks = [t for t in clawbench_mini(0) if t.split == "train"]
    monkeypatch.setattr(loop, "build_engine", oracle_engine_factory(config, tasks))
    trained = record_trained(monkeypatch)
    summary = loop.train(config, progress=False)

    assert summary["steps"] == 1
    [results] = trained
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0)] * 2, [r.info for r in results]
    (record,) = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert record["rollouts_trained"] == 2 and record["tokens_packed"] > 0 and math.isfinite(record["loss"])

    # The router of every layer and its experts moved; the attention too.
    after = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "run") / "model", dtype=torch.float32)
    before = dict(initial.named_parameters())
    moved = {name for name, p in after.named_parameters() if not torch.equal(p, before[name])}
    for i in range(after.config.num_hidden_layers):
        assert {f"model.layers.{i}.mlp.gate.weight", f"model.layers.{i}.self_attn.q_proj.weight"} <= moved
        assert any(name.startswith(f"model.layers.{i}.mlp.experts.") for name in moved)

    # The keystone on the step's real rollouts, with the trained weights: packed = alone.
    trees = [build_tree(with_kinds(r.calls, reconstruct(r.calls))) for r in results]
    longest = max(leaf.depth for t in trees for leaf in t.leaves if leaf.status == "kept")
    policy = Policy(after.eval(), attention="torch")
    with torch.no_grad():
        checked = assert_keystone(after, trees, pack(trees, longest + 64),
                                  lambda b: policy.run(b).logprobs.numpy().astype(np.float32))
    assert checked > 10

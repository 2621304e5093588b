"""A tiny model directory and recorded rollouts for fast, deterministic tests of the training loop.

The rollouts are `clawfast.synthetic` harness-shaped sessions (shared system prompt, retries,
subagent calls) over a 64-token vocabulary; the model is a 2-layer Qwen3 of that vocabulary. No
engine, harness or sandbox is involved: the loop reads them through `RecordedRollouts`. For the tests
that run real harnesses, `oracle_engine_factory` stands in for the run's engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clawfast.records import write_rollouts
from clawfast.synthetic import group_results, task_group

VOCAB = 64


def make_tiny_model(path: Path, seed: int = 0, init: float = 0.02) -> Path:
    """`init`: the weights' initializer range (transformers' default 0.02)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=init)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def make_recorded(path: Path, *, tasks: int = 5, k: int = 3, harnesses=("claude-code",), seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for t in range(tasks):
        for h in harnesses:
            group = task_group(rng, k, task_id=f"task{t}-{h}", n_calls=5, max_prompt_tokens=120, vocab_size=VOCAB,
                               retry_frac=0.2, subagent_chains=1, subagent_calls=1)
            rewards = [float(x) for x in rng.integers(0, 2, size=k)]
            results = group_results(group, task_id=f"task{t}", rewards=rewards, harness=h)
            write_rollouts(path, results)
    return path


def recorded_config_text(model_dir: Path, recorded_dir: Path, run_dir: Path, *, steps: int = 6,
                         interval: int = 2, harnesses=("claude-code",), extra: str = "") -> str:
    return f"""
run_dir = "{run_dir}"
seed = 3
steps = {steps}
[model]
path = "{model_dir}"
[rollout]
source = "recorded"
recorded_dir = "{recorded_dir}"
harnesses = {list(harnesses)!r}
tasks_per_step = 2
samples_per_task = 3
[optim]
lr = 1e-3
micro_batch_tokens = 256
[eval]
before = false
after = false
[checkpoint]
interval = {interval}
keep = 10
{extra}
""".replace("'", '"')


def oracle_engine_factory(config, tasks):
    """A stand-in for `clawfast.train.loop.build_engine` (monkeypatched by the tests that run real
    harnesses): the scripted engine playing each of `tasks`' oracles through the run's mini-swe-agent,
    at the weight version the loop asks for."""
    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.harness import get_harness
    from clawfast.proxy.render import ChatRenderer
    from clawfast.rollout.oracle import OracleResponder
    from clawfast.train.build import harness_options

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(ensure_embedded_model()))
    harness = get_harness("mini-swe-agent", **harness_options(config)["mini-swe-agent"])

    def scripted_engine(engine_config, model_dir, *, weight_version, **_):
        engine = ScriptedEngine(renderer.encode, renderer.turn_end_id,
                                responder=OracleResponder(renderer, harness, tasks))
        engine.weight_version = weight_version
        return engine

    return scripted_engine


def record_trained(monkeypatch) -> list:
    """The rollouts each step of a run trains on, in step order (a spy on
    `clawfast.train.distributed.train_on_rollouts`, which every one-process step calls)."""
    from clawfast.train import distributed

    trained: list = []
    real_step = distributed.train_on_rollouts

    def spy(policy, optimizer, results, cfg, state, ref_policy=None):
        trained.append(list(results))
        return real_step(policy, optimizer, results, cfg, state, ref_policy)

    monkeypatch.setattr(distributed, "train_on_rollouts", spy)
    return trained

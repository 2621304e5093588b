"""What the learning benchmarks built on `clawfast.train.sampled.EngineRollouts` share
(bench/bench_async.py, bench/bench_train_threads.py): the tiny Qwen3 they train (4 layers, hidden
128, vocabulary 64, random weights from a seed) and the run config around it (torch engine,
12-token calls unless told, 4 tasks x 4 samples a step, no evaluation)."""

from __future__ import annotations

import json
from pathlib import Path


def make_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def run_config(run_dir: Path, model: Path, *, seed: int, steps: int, algorithm: dict, lr: float,
               micro_batch_tokens: int, max_tokens: int = 12, engine: dict | None = None) -> str:
    """The TOML of one run; ``algorithm`` and ``engine``: more keys of those sections (values as
    JSON, which TOML reads); ``max_tokens``: each call's output budget."""
    algo = "".join(f"{k} = {json.dumps(v)}\n" for k, v in algorithm.items())
    more_engine = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (engine or {}).items())
    return f"""
run_dir = "{run_dir}"
seed = {seed}
steps = {steps}
[model]
path = "{model}"
[engine]
kind = "torch"
max_tokens = {max_tokens}
max_batch = 16
{more_engine}[rollout]
tasks_per_step = 4
samples_per_task = 4
[algorithm]
{algo}[optim]
lr = {lr}
micro_batch_tokens = {micro_batch_tokens}
[eval]
before = false
after = false
[checkpoint]
interval = {steps}
"""

"""Rollouts captured through real harnesses with side threads (tests/data/threads: Claude Code with two
subagents and an automatic compaction, Codex and OpenClaw compactions; written by
tests/harness/test_side_calls.py with ``CLAWFAST_SIDECALLS_DIR``, gzip'd), their ground-truth kinds,
and a digest of everything a step's loss and gradients are computed from.

`step_digest` uses only what `prepare_step` returned before threads could be trained, so the digests
in test_train_threads.py were computed by that code on these records and stay the bar for
``train_threads = ["main"]``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from clawfast.records import RolloutResult, read_rollout
from clawfast.train.algorithms import ppo_advantages
from clawfast.train.prepare import prepare_step

DATA = Path(__file__).resolve().parent.parent / "data" / "threads"
CAPTURES = ("claude-code-threads", "codex-compaction", "openclaw-compaction")
REWARDS = (1.0, 0.0, 0.5)
BATCH_FIELDS = ("input_ids", "position_ids", "kv_end", "parent_row", "is_context", "target_rows", "target_ids",
                "loss_mask", "weight", "infer_logprobs", "target_rollout", "target_leaf", "target_call")


def stored_rollouts(tmp_path: Path) -> list[RolloutResult]:
    """The captures, rewarded 1, 0 and 0.5 (one GRPO group: the test passes one group key)."""
    out = []
    for name, reward in zip(CAPTURES, REWARDS):
        path = tmp_path / f"{name}.cfr"
        path.write_bytes(gzip.decompress((DATA / f"{name}.cfr.gz").read_bytes()))
        out.append(dataclasses.replace(read_rollout(path), reward=reward))
    return out


def labels(name: str) -> list[str]:
    return json.loads((DATA / f"{name}.labels.json").read_text())


def step_digest(rollouts: list[RolloutResult], config) -> str:
    """sha256 over a prepared step's micro-batches, loss weights, denominators, GRPO advantages and
    (PPO) the GAE advantages and returns for fixed float64 values: every input of the step's loss."""
    data = prepare_step(rollouts, ["g"] * len(rollouts), config)
    h = hashlib.sha256()

    def put(x):
        h.update(np.ascontiguousarray(x).tobytes())

    for b in data.batches:
        for name in BATCH_FIELDS:
            put(getattr(b, name))
    for w in data.weights:
        put(w)
    put(np.asarray(data.denominators, np.float64))
    for m in data.minibatches:
        put(m)
    for a in data.advantages or []:
        put(a)
    if data.forest is not None:
        for rows in data.forest_rows:
            put(rows)
        values = torch.as_tensor(np.sin(np.arange(data.forest.num_rows, dtype=np.float64)))
        adv, ret = ppo_advantages(data.forest, values, data.rewards, gamma=config.gamma, lam=config.lam,
                                  mode=config.gae_mode)
        put(adv.numpy())
        put(ret.numpy())
    return h.hexdigest()

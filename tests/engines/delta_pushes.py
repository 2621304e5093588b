"""What the delta tests of every engine share: real AdamW steps and the push sequence checked."""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch

from clawfast.train.push import WeightPusher


def adamw_steps(lm, steps: int, lr: float, seed: int = 0):
    """Real optimizer steps: AdamW on the LM loss of random token sequences, yielding after each."""
    opt = torch.optim.AdamW(lm.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, lm.config.vocab_size, (2, 24), generator=g)
        loss = lm(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield


def check_delta_pushes(engine, model, serves: Callable[[torch.nn.Module], object]) -> None:
    """Train a copy of `model` (float32) and push it to `engine` through a bfloat16 `WeightPusher`
    with checksums: a whole push, then two AdamW steps (the quickstart's lr) as deltas, after each of
    which ``serves(reference)`` must pass for `model` holding the trainer's weights rounded to
    bfloat16 (it returns the engine's greedy answer). Then a delta built on another version is
    refused with the old weights serving on, and the delta itself is taken."""
    trainer = copy.deepcopy(model).train()
    steps = adamw_steps(trainer, 3, lr=3e-5)
    pusher = WeightPusher(engine, torch.bfloat16, checksums=True)

    def rounded():
        reference = copy.deepcopy(model).eval()
        reference.load_state_dict({k: v.detach().to(torch.bfloat16).float() for k, v in trainer.state_dict().items()})
        return reference

    for step in range(3):
        if step:
            next(steps)
        pusher.update_weights(trainer.state_dict(), engine.weight_version + 1)
        assert pusher.last["push/delta"] == float(step > 0)
        serves(rounded())
    assert pusher.last["push/bytes"] < pusher.last["push/full_bytes"] / 4
    previous, version = rounded(), engine.weight_version
    next(steps)
    delta = pusher.encoder.encode(trainer.state_dict().items(), version + 1)
    with pytest.raises(ValueError, match="engine serves version"):
        engine.apply_delta(dataclasses.replace(delta, base_version=version - 1))
    assert engine.weight_version == version
    serves(previous)
    engine.apply_delta(delta)
    assert engine.weight_version == version + 1
    serves(rounded())

"""The learning-rate warm-up of a run (``optim.warmup_updates``): a linear ramp over its first optimizer
updates, counted from the optimizer's own step counts, so a resumed run continues the ramp (from its
configured lr: `clawfast.train.checkpoint.load_checkpoint` keeps the config's hyper-parameters). A fresh
AdamW's first update moves every weight by about ``lr`` in the sign of its gradient, however small
that gradient; the ramp keeps that first move small (docs/DESIGN.md, section 4).
"""

from __future__ import annotations

import torch


def updates_done(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer updates made so far, from the optimizer's own per-parameter step counts (saved
    with its state, so a resumed run counts on)."""
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def warm_up(optimizer: torch.optim.Optimizer, warmup_updates: int) -> float:
    """Within the ramp, set each parameter group's lr for the next update to its base lr (kept under
    ``initial_lr``, the key torch's schedulers use) times ``min(1, (updates done + 1) /
    warmup_updates)``; past it (or with no ramp) leave the lr alone, so that a scheduler the caller
    drives keeps control. Returns the first group's lr."""
    done = updates_done(optimizer) if warmup_updates > 0 else None
    if done is not None and done <= warmup_updates:
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * min(1.0, (done + 1) / warmup_updates)
    return float(optimizer.param_groups[0]["lr"])

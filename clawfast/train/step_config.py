"""The configuration of one RL step (`StepConfig`) and how a run's config makes it (`step_config`).

`StepConfig` is validated on construction like every config section (a `ValueError` naming the
field); a `RunConfig` that loaded always makes one without error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from clawfast.kernels import ISConfig
from clawfast.train.config import AlgorithmConfig, RunConfig


class StepConfig(AlgorithmConfig):
    """Everything `train_step` needs besides the policy, optimizer and rollouts: the run's
    ``[algorithm]`` section (`clawfast.train.config.AlgorithmConfig`, where each field is described;
    `name` is "grpo" or "ppo", which needs a policy with a value head) with `group_by` resolved to
    "task" or "task_harness", plus five fields of ``[optim]`` (`clawfast.train.config.OptimConfig`):
    micro_batch_tokens (rows per packed micro-batch), max_grad_norm (clip the global gradient norm;
    None: no clipping, the norm is still reported), updates_per_step (mini-batches per epoch),
    ppo_epochs and warmup_updates (`clawfast.train.warmup.warm_up`)."""

    group_by: Literal["task", "task_harness"] = "task"
    micro_batch_tokens: int = Field(8192, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    updates_per_step: int = Field(1, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    warmup_updates: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _is_config(self) -> "StepConfig":
        self.is_config()  # fail here, at construction, not mid-step
        return self

    def is_config(self) -> ISConfig:
        # is_lo / is_hi bound masked IS only: the other modes leave ISConfig's defaults, so bounds they never
        # read cannot stop a step (the config checks the bounds where they act, in "mask").
        if self.is_mode == "mask":
            return ISConfig(level=self.is_level, mode="mask", cap=self.is_cap, lo=self.is_lo, hi=self.is_hi)
        # "off" still measures the mismatch (metrics with the truncation thresholds); no weight is applied
        return ISConfig(level=self.is_level, mode="truncate", cap=self.is_cap)

    def needs_proximal(self, num_minibatches: int) -> bool:
        """Whether the proximal log-probs need their own no-grad pass: not for one update at token
        level, where they are the update's own forward, detached."""
        return self.ppo_epochs * num_minibatches > 1 or self.is_level == "sequence"


def step_config(config: RunConfig) -> StepConfig:
    """The trainer's `StepConfig` of a run: its algorithm section, group_by resolved, and the optimizer's
    micro-batch size, gradient clip, mini-batches and epochs."""
    optim = config.optim
    return StepConfig(**{**config.algorithm.model_dump(), "group_by": config.group_by},
                      micro_batch_tokens=optim.micro_batch_tokens, max_grad_norm=optim.max_grad_norm,
                      updates_per_step=optim.updates_per_step, ppo_epochs=optim.ppo_epochs,
                      warmup_updates=optim.warmup_updates)

"""The mismatch between trainer and sampler: the IS weights of the trainer's log-probs against the
sampler's (`clawfast.kernels.importance_weights`) and the step's mismatch metrics (the kernel's
``is_*`` / ``mismatch_k*``, the log-perplexity ones here), each also under verl's name
(`clawfast.train.verl_names`).
"""

from __future__ import annotations

import torch

from clawfast.kernels import TreePaths, importance_weights
from clawfast.train.step_config import StepConfig
from clawfast.train.verl_names import verl_names

LOG_PPL_NAMES = ("mismatch_log_ppl_train", "mismatch_log_ppl_infer", "mismatch_log_ppl_diff",
                 "mismatch_log_ppl_abs_diff")


def mismatch(lp: torch.Tensor, infer: torch.Tensor, a: torch.Tensor, seq: torch.Tensor, config: StepConfig,
             paths: TreePaths | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights (trainer ``lp`` vs sampler ``infer``, weights ``a``, at ``config.is_level``; paths
    for "sequence") and the metrics: `importance_weights`'s, the log-perplexity ones (sequences:
    the rollouts ``seq``) and all of them again under verl's names."""
    res = importance_weights(lp, infer, a, config=config.is_config(), paths=paths)
    metrics = {**res.metrics, **log_ppl(lp, infer, a, seq)}
    metrics.update(verl_names(metrics, config, res.weights, a))
    return res.weights, metrics


def log_ppl(lp: torch.Tensor, infer: torch.Tensor, a: torch.Tensor, seq: torch.Tensor) -> dict[str, float]:
    """Per rollout with weight, the weighted mean NLL of its targets under the trainer
    (``mismatch_log_ppl_train``) and the sampler (``mismatch_log_ppl_infer``), each averaged over
    rollouts, and the per-rollout difference train - infer (its mean ``mismatch_log_ppl_diff`` and
    mean absolute value ``mismatch_log_ppl_abs_diff``): verl's sequence-level perplexity diagnostics."""
    a = a.double()
    valid = a > 0
    n = int(seq.max()) + 1 if seq.numel() else 0
    seq = seq.long()

    def per_seq(x):
        return torch.zeros(n, dtype=torch.float64, device=a.device).index_add_(0, seq, x)

    total = per_seq(torch.where(valid, a, 0.0))
    live = total > 0
    if not bool(live.any()):
        return dict.fromkeys(LOG_PPL_NAMES, 0.0)
    nll_train = -per_seq(torch.where(valid, a * lp.double(), 0.0))[live] / total[live]
    nll_infer = -per_seq(torch.where(valid, a * infer.double(), 0.0))[live] / total[live]
    diff = nll_train - nll_infer
    vec = torch.stack([nll_train.mean(), nll_infer.mean(), diff.mean(), diff.abs().mean()])
    return dict(zip(LOG_PPL_NAMES, vec.tolist()))

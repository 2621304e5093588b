"""The step's IS / mismatch metrics under verl's names (verl/trainer/ppo/rollout_corr_helper.py,
``rollout_corr/...``), so a run reads the same in verl's dashboards; docs/DESIGN.md section 6 lists them.
Every name maps a value `clawfast.train.mismatch.mismatch` measured: same quantity, same items.
"""

from __future__ import annotations

import torch

from clawfast.train.step_config import StepConfig

# Over targets, or sequences at is_level "sequence". Not aliased: std and ESS, which verl takes of
# weights clamped to the thresholds.
VERL_MISMATCH_NAMES = {
    "mismatch_k1": "rollout_corr/kl",
    "mismatch_k3": "rollout_corr/k3_kl",
    "mismatch_log_ppl_train": "rollout_corr/training_log_ppl",
    "mismatch_log_ppl_infer": "rollout_corr/rollout_log_ppl",
    "mismatch_log_ppl_diff": "rollout_corr/log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
}
# verl's IS statistics (`compute_is_metrics`): the high / low fractions are of rho before truncation
# or masking; mean is of the applied weights (token-weighted); max and min of the applied weights at
# token level, of rho at sequence level.
VERL_RATIO_NAMES = {"is_frac_above": "rollout_corr/rollout_is_ratio_fraction_high",
                    "is_frac_below": "rollout_corr/rollout_is_ratio_fraction_low"}


def verl_names(metrics: dict[str, float], config: StepConfig, weights: torch.Tensor,
               a: torch.Tensor) -> dict[str, float]:
    """``metrics`` (of `clawfast.train.mismatch.mismatch`, with its applied IS ``weights`` and target
    weights ``a``) under verl's names: truncated IS is verl's TIS and masked IS its IcePop
    (``rollout_is_*``), the masked share also its rejection-sampling ``rollout_rs_*masked_fraction``;
    "off" only the mismatch diagnostics; ``is_chi2`` is verl's ``chi2_token`` or ``chi2_seq`` by level. Checked against
    verl's own code by ``bench/peers/importance.py``."""
    token = config.is_level == "token"
    out = {verl: metrics[ours] for ours, verl in VERL_MISMATCH_NAMES.items()}
    out["rollout_corr/chi2_token" if token else "rollout_corr/chi2_seq"] = metrics["is_chi2"]
    if config.is_mode == "off":
        return out
    out.update({verl: metrics[ours] for ours, verl in VERL_RATIO_NAMES.items()})
    valid = a > 0
    applied, count = weights.double()[valid], a.double()[valid]
    out["rollout_corr/rollout_is_mean"] = float((applied * count).sum() / count.sum()) if applied.numel() else 0.0
    if token:
        out["rollout_corr/rollout_is_max"] = float(applied.max()) if applied.numel() else 0.0
        out["rollout_corr/rollout_is_min"] = float(applied.min()) if applied.numel() else 0.0
    else:
        out["rollout_corr/rollout_is_max"] = metrics["is_ratio_max"]
        out["rollout_corr/rollout_is_min"] = metrics["is_ratio_min"]
    if config.is_mode == "mask":  # rejected: outside [is_lo, is_hi], i.e. above or below
        name = "rollout_rs_masked_fraction" if token else "rollout_rs_seq_masked_fraction"
        out["rollout_corr/" + name] = metrics["is_frac_above"] + metrics["is_frac_below"]
    return out


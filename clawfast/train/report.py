"""What a run reports in words: pass@1 of a set of rollouts, the one-line summaries of an eval and
of a step (for logs, CI and ``--no-progress``), and their per-harness / per-difficulty breakdowns."""

from __future__ import annotations

from typing import Sequence

from clawfast.records import RolloutResult
from clawfast.train.metrics import rollout_metrics, subscore_means


def pass_at_1(results: Sequence[RolloutResult]) -> dict[str, float]:
    """pass@1 overall and per harness: the share of attempts whose reward is 1 (with k samples per
    task this is the unbiased pass@1 estimate), the mean reward (graded verifiers give partial
    credit), counts, verifier errors and mean sub-scores."""
    out = rollout_metrics(results)
    kept = {k: v for k, v in out.items() if k.startswith(("pass@1", "reward/", "status/")) or k in ("rollouts", "verifier_errors")}
    return {**kept, **subscore_means(results)}


def breakdown(metrics: dict[str, float], prefix: str) -> str:
    """``name value`` pairs of the metrics named ``{prefix}/name`` (per harness, per difficulty)."""
    return ", ".join(f"{k[len(prefix) + 1:]} {v:.3f}" for k, v in sorted(metrics.items()) if k.startswith(prefix + "/"))


def eval_line(label: str, metrics: dict[str, float]) -> str:
    """The one-line report of an eval: overall pass@1, then per harness and per difficulty."""
    per = breakdown(metrics, "pass@1")
    levels = breakdown(metrics, "pass@1_difficulty")
    return (f"eval {label}: pass@1 {metrics.get('pass@1', 0.0):.3f} ({per}{'; ' + levels if levels else ''}) "
            f"over {int(metrics.get('rollouts', 0))} rollouts")


def step_line(step: int, record: dict[str, float]) -> str:
    """One line per step for runs without the live display (logs, CI, --no-progress)."""
    return (f"step {step}: pass@1 {record.get('pass@1', 0.0):.3f} ({breakdown(record, 'pass@1')}) "
            f"loss {record.get('loss', float('nan')):.4f} "
            f"over {int(record.get('rollouts', 0))} rollouts; rollout {record.get('time/rollout_s', 0.0):.1f} s, "
            f"train {record.get('time/train_s', 0.0):.1f} s")

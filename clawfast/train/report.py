"""What a run reports in words: pass@1 of a set of rollouts, the one-line summaries of an eval, a
cold start and a step (for logs, CI and ``--no-progress``), their per-harness / per-difficulty
breakdowns, and a finished run's table of every eval per difficulty and per task (`run_table`, `clawfast report`)."""

from __future__ import annotations

import json
from pathlib import Path
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
    """One line per step for runs without the live display (logs, CI, --no-progress); with side
    threads trained, the targets of each thread kind, and the side calls left out of the loss."""
    line = (f"step {step}: pass@1 {record.get('pass@1', 0.0):.3f} ({breakdown(record, 'pass@1')}) "
            f"loss {record.get('loss', float('nan')):.4f} "
            f"over {int(record.get('rollouts', 0))} rollouts; rollout {record.get('time/rollout_s', 0.0):.1f} s, "
            f"train {record.get('time/train_s', 0.0):.1f} s")
    targets = _per_thread(record, "targets")
    if len(targets) > 1:
        line += "; targets by thread: " + ", ".join(targets)
    left_out = _per_thread(record, "calls_excluded")
    if left_out:
        line += "; side calls not trained: " + ", ".join(left_out)
    if record.get("rollout/retries") or record.get("rollout/nodes_lost"):
        line += (f"; infrastructure: {int(record.get('rollout/retries', 0))} rollout(s) retried, "
                 f"{int(record.get('rollout/nodes_lost', 0))} node(s) lost")
    return line


def _per_thread(record: dict[str, float], name: str) -> list[str]:
    """``kind n`` of each metric ``threads/<kind>/<name>`` (`clawfast.train.prepare.thread_counts`)."""
    return [f"{k.split('/')[1]} {int(v)}" for k, v in record.items() if k.startswith("threads/") and k.endswith("/" + name)]


def nll_by_epoch(summary: dict[str, float]) -> tuple[int, str]:
    """The number of SFT epochs of a cold-start summary and their nll in epoch order ("0.326, 0.032")."""
    epochs = sorted(int(k.rsplit("_", 1)[1]) for k in summary if k.startswith("nll_epoch_"))
    return len(epochs), ", ".join(f"{summary[f'nll_epoch_{e}']:.3f}" for e in epochs)


def coldstart_line(summary: dict[str, float]) -> str:
    """The one-line report of a cold start (``run_coldstart``'s summary): demonstrations kept of
    those captured (and those too long to train), the nll of each SFT epoch, and the time of both
    phases."""
    epochs, nlls = nll_by_epoch(summary)
    dropped = int(summary.get("dropped_too_long", 0))
    too_long = f", {dropped} too long for a micro-batch" if dropped else ""
    return (f"cold start: {int(summary['kept'])} of {int(summary['captured'])} demonstrations solved their task"
            f"{too_long} (captured in {summary['time_capture_s']:.1f} s); SFT {epochs} epoch{'s' * (epochs != 1)}, "
            f"nll by epoch {nlls} ({summary['time_sft_s']:.1f} s)")


_PHASES = {"before": "before", "coldstart": "cold start"}


def run_table(run_dir: str | Path) -> str:
    """Every eval of the run in `run_dir` side by side (before, after the cold start, at each
    evaluated step, after): pass@1 overall, per difficulty and per task, with the number of rollouts,
    the seed and the harnesses; then the gains after - before and after - cold start (what RL
    added over its own cold start)."""
    from clawfast.train.metrics_log import read_metrics

    run_dir = Path(run_dir)
    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    if not evals:
        raise ValueError(f"{run_dir}: the run has no eval records (metrics.jsonl)")
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    columns = [(_PHASES.get(r.get("label"), r.get("label") or f"step {r['step']}"), r) for r in evals]
    rows: list[tuple[str, str | None]] = [("all eval tasks", "pass@1"), ("per difficulty", None)]
    rows += [(f"  {k.split('/', 1)[1]}", k) for k in sorted({k for r in evals for k in r if k.startswith("pass@1_difficulty/")})]
    rows += [("per task", None)]
    rows += [(f"  {k.split('/', 1)[1]}", k) for k in sorted({k for r in evals for k in r if k.startswith("pass@1_task/")})]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"run {run_dir}  seed {config.get('seed', '?')}  harnesses "
             f"{', '.join(config.get('rollout', {}).get('harnesses', [])) or '?'}  model {config.get('model', {}).get('path', '?')}",
             f"{'pass@1':<{width}}" + "".join(f"{name:>12}" for name, _ in columns),
             f"{'rollouts':<{width}}" + "".join(f"{int(r.get('rollouts', 0)):>12d}" for _, r in columns)]
    for name, key in rows:
        if key is None:
            lines.append(name)
            continue
        lines.append(f"{name:<{width}}" + "".join(f"{r[key]:>12.3f}" if key in r else f"{'-':>12}" for _, r in columns))
    by_label = {r.get("label"): r for r in evals}
    for first, last, what in (("before", "after", "training"), ("coldstart", "after", "RL over its cold start")):
        # An eval with no scored rollout (every task a rubric no judge scored) has no pass@1 to gain from.
        if first in by_label and last in by_label and "pass@1" in by_label[first] and "pass@1" in by_label[last]:
            a, b = by_label[first], by_label[last]
            levels = [k for k in sorted(b) if k.startswith("pass@1_difficulty/")]
            lines.append(f"gain from {what}: {100 * (b['pass@1'] - a['pass@1']):+.1f} points"
                         + (" (" + ", ".join(f"{k.split('/', 1)[1]} {100 * (b[k] - a.get(k, 0.0)):+.1f}" for k in levels) + ")"
                            if levels else ""))
    return "\n".join(lines)

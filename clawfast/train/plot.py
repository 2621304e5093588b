"""A run's curves: `plot_run(run_dir, png)` draws its metrics (`clawfast.train.metrics_log`) against
step with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from clawfast.train.metrics_log import read_metrics

_PANELS = (
    ("reward (train rollouts)", ("reward/",)),
    ("pass@1 (eval, per harness)", ("eval:pass@1",)),
    ("loss", ("loss", "pg_loss")),
    ("entropy", ("entropy",)),
    ("KL / train-inference mismatch", ("kl_ref", "approx_kl_old", "mismatch_")),
    ("importance sampling", ("is_ratio_", "is_frac_", "is_weight_mean", "clip_frac")),
    ("tokens: flat vs packed", ("tokens_per_call_flat", "tokens_packed")),
    ("time per step (s)", ("time/",)),
    ("asynchronous loop: lag (versions), stale groups dropped", ("async/",)),
)


def _series(records: Iterable[dict[str, Any]], kind: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        if r.get("kind") != kind:
            continue
        for k, v in r.items():
            if k in ("kind", "step", "time") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            xs, ys = out.setdefault(k, ([], []))
            xs.append(int(r["step"]))
            ys.append(float(v))
    return out


def _match(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or (p.endswith(("/", "_")) and name.startswith(p)) for p in patterns)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's curves (train and eval metrics against step) to a PNG; returns its path
    (default ``<run_dir>/curves.png``). Raises FileNotFoundError without a metrics file,
    ValueError when it holds nothing to plot and ImportError without matplotlib (an optional
    dependency: the ``train`` extra) or with one that does not import."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = _series(records, "train")
    evals = _series(records, "eval")
    if not train and not evals:
        raise ValueError(f"{run_dir}: metrics.jsonl holds no train or eval records")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"matplotlib does not import ({exc}; pip install 'clawfast[train]'), so no curves "
                          f"are drawn; the metrics are in {run_dir / 'metrics.jsonl'}") from exc
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    for ax, (title, patterns) in zip(axes.flat, _PANELS):
        drawn = 0
        if patterns == ("eval:pass@1",):
            for name, (xs, ys) in sorted(evals.items()):
                if name == "pass@1" or name.startswith("pass@1/"):
                    ax.plot(xs, ys, marker="o", label=name)
                    drawn += 1
            ax.set_ylim(-0.05, 1.05)
        else:
            for name, (xs, ys) in sorted(train.items()):
                if _match(name, patterns) and not name.startswith("status/"):
                    ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=name)
                    drawn += 1
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(f"clawfast run {run_dir.name}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out

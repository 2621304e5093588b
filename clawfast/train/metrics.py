"""Per-step metrics: a JSONL file (the source of truth), TensorBoard scalars, a live display.

``<run_dir>/metrics.jsonl`` holds one JSON object per line: ``{"kind": "train", "step": N, ...}``
for a training step, ``{"kind": "eval", "step": N, "pass@1": ..., "pass@1/<harness>": ...}`` for an
evaluation, ``{"kind": "coldstart", "epoch": E, ...}`` for the warm-up. Every line is flushed
when written. On resume, `MetricsLogger(run_dir, resume_step=S)` first drops the lines of steps
after S (they belong to work the checkpoint does not hold), so a resumed run's file lists every
step exactly once.

Metric names (train): ``reward/mean``, ``reward/<harness>``, ``pass@1/<harness>`` (share of
rollouts with reward 1), ``status/<status>`` (counts), ``verifier_errors`` (rollouts whose verifier
could not score them), the trainer's metrics (``loss``,
``entropy``, ``kl_ref``, ``clip_frac``, the ``is_*`` / ``mismatch_*`` statistics, token counts
``tokens_per_call_flat`` / ``tokens_packed`` / ``dedup_ratio_call``, ...), and timings
``time/rollout_s``, ``time/train_s``, ``time/sync_s``. An eval adds ``pass@1_<tag>/<value>`` and
``reward_<tag>/<value>`` per difficulty, per category and per task (tag ``task``), and
``subscore/<name>``, the mean of each named sub-score of a graded verifier (`subscore_means`).

`plot_run(run_dir, png)` draws the curves with matplotlib's Agg backend (no display needed).
Not guaranteed: TensorBoard output when the `tensorboard` package is missing (the JSONL is always
written; the logger says once that TensorBoard is off).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from clawfast.records import RolloutResult

METRICS_FILE = "metrics.jsonl"


def rollout_metrics(results: Sequence[RolloutResult], prefix: str = "") -> dict[str, float]:
    """Reward and pass@1 overall and per harness, status counts, calls per rollout."""
    out: dict[str, float] = {}
    if not results:
        return out
    by_harness: dict[str, list[float]] = defaultdict(list)
    for r in results:
        by_harness[r.harness].append(r.reward)
    rewards = [r.reward for r in results]
    out[f"{prefix}reward/mean"] = sum(rewards) / len(rewards)
    out[f"{prefix}pass@1"] = sum(x >= 1.0 for x in rewards) / len(rewards)
    for h, xs in sorted(by_harness.items()):
        out[f"{prefix}reward/{h}"] = sum(xs) / len(xs)
        out[f"{prefix}pass@1/{h}"] = sum(x >= 1.0 for x in xs) / len(xs)
    for status, n in sorted(Counter(r.status for r in results).items()):
        out[f"{prefix}status/{status}"] = float(n)
    out[f"{prefix}calls_per_rollout"] = sum(len(r.calls) for r in results) / len(results)
    out[f"{prefix}rollouts"] = float(len(results))
    verdicts = [r.info.get("verifier") for r in results]
    out[f"{prefix}verifier_errors"] = float(sum(v is not None and v.get("status") != "ok" for v in verdicts))
    return out


def subscore_means(results: Sequence[RolloutResult]) -> dict[str, float]:
    """``subscore/<name>``: the mean of each named sub-score of a graded verifier over the rollouts
    that report it. Names are usually a task's own, so only evals log them (a training run over
    thousands of tasks would log as many series)."""
    subscores: dict[str, list[float]] = defaultdict(list)
    for r in results:
        details = (r.info.get("verifier") or {}).get("details") or {}
        for name, value in details.get("subscores", {}).items():
            subscores[name].append(value)
    return {f"subscore/{name}": sum(xs) / len(xs) for name, xs in sorted(subscores.items())}


def metrics_by_tag(results: Sequence[RolloutResult], tasks: dict, tag: str) -> dict[str, float]:
    """pass@1 and mean reward per value of one task tag (``pass@1_difficulty/easy`` and
    ``reward_difficulty/easy`` for tag ``difficulty``; tag ``task`` means the task id), so an eval
    over mixed tasks shows where a change came from; tasks without the tag are left out."""
    by_value: dict[str, list[float]] = defaultdict(list)
    for r in results:
        value = r.task_id if tag == "task" else tasks[r.task_id].tags.get(tag)
        if value is not None:
            by_value[value].append(r.reward)
    out = {}
    for v, xs in sorted(by_value.items()):
        out[f"pass@1_{tag}/{v}"] = sum(x >= 1.0 for x in xs) / len(xs)
        out[f"reward_{tag}/{v}"] = sum(xs) / len(xs)
    return out


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe: non-finite floats become None (JSON has no NaN)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


class MetricsLogger:
    """Appends metric records to ``metrics.jsonl`` and, when available, TensorBoard (``tb/``)."""

    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run owns its file
        self._fh = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step drops TensorBoard events of steps after the checkpoint on resume.
                self._tb = SummaryWriter(str(self.run_dir / "tb"),
                                         purge_step=None if resume_step is None else resume_step + 1)
            except ImportError:
                print("clawfast: tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)

    def log(self, kind: str, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": int(step), "time": time.time(), **_clean(metrics)}
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()
        return record

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir_or_file: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl (a torn last line, from a kill mid-write, is skipped)."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file")
    records = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return records


def truncate_after(path: Path, step: int) -> None:
    """Keep only records with ``step <= step`` (and cold-start records), rewritten atomically."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("kind") == "coldstart" or r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for r in kept:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Live display

_COLUMNS = (("step", "step", "{:d}"), ("reward/mean", "reward", "{:.3f}"), ("pass@1", "pass@1", "{:.2f}"),
            ("loss", "loss", "{:+.4f}"), ("entropy", "entropy", "{:.3f}"), ("grad_norm", "|g|", "{:.2f}"),
            ("dedup_ratio_call", "dedup", "{:.1f}x"), ("time/rollout_s", "rollout s", "{:.0f}"),
            ("time/train_s", "train s", "{:.1f}"))


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Phase:
    """Progress of one phase of a run: `done` of `total` `unit`s since `started`, with an ETA from the
    mean pace so far, and a short `note` (the latest loss, failures)."""

    def __init__(self, name: str, total: int, unit: str) -> None:
        self.name, self.total, self.unit = name, total, unit
        self.done = 0
        self.note = ""
        self.started = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def eta_s(self) -> float | None:
        if self.done == 0 or self.done >= self.total:
            return None
        return self.elapsed_s / self.done * (self.total - self.done)

    def line(self, *, bar_width: int = 0) -> str:
        bar = ""
        if bar_width:
            filled = round(bar_width * self.done / max(self.total, 1))
            bar = " [" + "#" * filled + "." * (bar_width - filled) + "]"
        eta = self.eta_s()
        timing = f"{clock(self.elapsed_s)} elapsed" + (f", ETA {clock(eta)}" if eta is not None else "")
        return f"{self.name}: {self.done}/{self.total} {self.unit}{bar}  {timing}" + (f"  {self.note}" if self.note else "")


class ProgressView:
    """A live rich view of the run: a table of the recent steps, the current phase's counter (done /
    total, elapsed, ETA) and the latest results. Phases: `begin(name, total, unit)`, `advance`,
    `end`. On a non-terminal (a CI log), or with ``live=False``, it prints one line per phase as the
    phase ends and one per training step instead."""

    def __init__(self, total_steps: int, *, rows: int = 12, live: bool = True) -> None:
        from rich.console import Console

        # Live: drawn on stderr; otherwise plain lines on stdout, as print would put them.
        self.console = Console(stderr=live, soft_wrap=True)
        self.total_steps = total_steps
        self.rows: list[dict[str, Any]] = []
        self.max_rows = rows
        self.phase = "starting"
        self.counters: list[Phase] = []  # nested phases, outermost first (an eval within the RL steps)
        self.evals: list[str] = []
        self._live = None
        if live and self.console.is_terminal:
            from rich.live import Live

            self._live = Live(self._render(), console=self.console, refresh_per_second=2)

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"clawfast train ({self.total_steps} steps)", expand=False)
        for _, title, _ in _COLUMNS:
            table.add_column(title, justify="right")
        for row in self.rows[-self.max_rows:]:
            table.add_row(*[_fmt(row.get(key), fmt) for key, _, fmt in _COLUMNS])
        status = [c.line(bar_width=24) for c in self.counters] or [self.phase]
        parts = [table, *[Text(line, style="cyan") for line in status]]
        parts += [Text(e, style="green") for e in self.evals[-4:]]
        return Group(*parts)

    def start(self) -> "ProgressView":
        if self._live is not None:
            self._live.start()
        return self

    def set_phase(self, text: str) -> None:
        self.phase = text
        if self._live is not None:
            self._live.update(self._render())

    def begin(self, name: str, total: int, unit: str) -> Phase:
        """Start a phase (inside the current one, if any: `end` returns to it)."""
        self.counters.append(Phase(name, total, unit))
        self._refresh()
        return self.counters[-1]

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if not self.counters:
            return
        self.counters[-1].done += n
        if note is not None:
            self.counters[-1].note = note
        self._refresh()

    def end(self, note: str | None = None) -> None:
        """Close the innermost phase: its final line stays in the view (a terminal) or is printed."""
        if not self.counters:
            return
        counter = self.counters.pop()
        if note is not None:
            counter.note = note
        self.add_eval(counter.line())

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def add_step(self, record: dict[str, Any], line: str) -> None:
        """A finished step: a row of the table (a terminal), else `line` printed."""
        self.rows.append(record)
        if self._live is not None:
            self._live.update(self._render())
        else:
            self.console.print(line, highlight=False)

    def add_eval(self, text: str) -> None:
        self.evals.append(text)
        if self._live is not None:
            self._live.update(self._render())
        else:
            self.console.print(text, highlight=False)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(int(value) if fmt == "{:d}" else value)
    except (TypeError, ValueError):
        return str(value)


# ----------------------------------------------------------------------------------------------
# Plot

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
    (default ``<run_dir>/curves.png``). Raises FileNotFoundError without a metrics file and
    ValueError when it holds nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = _series(records, "train")
    evals = _series(records, "eval")
    if not train and not evals:
        raise ValueError(f"{run_dir}: metrics.jsonl holds no train or eval records")
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

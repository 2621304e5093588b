"""A training run's progress on the program's live view (`clawfast.live`): a table of the recent
steps, the current phase's counter (done / total, elapsed, ETA) and the latest results; on a
non-terminal (a CI log), or with ``live=False``, one line per phase as the phase ends and one per
training step instead."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from clawfast.live import LiveView

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
    """The run's view. Phases: `begin(name, total, unit)`, `advance`, `end`; finished steps
    `add_step`, other results `add_eval`."""

    def __init__(self, total_steps: int, *, rows: int = 12, live: bool = True) -> None:
        self.total_steps = total_steps
        self.rows: list[dict[str, Any]] = []
        self.max_rows = rows
        self.counters: list[Phase] = []  # nested phases, outermost first (an eval within the RL steps)
        self.evals: list[str] = []
        self.view = LiveView(self._render, live=live)

    def _render(self) -> Group:
        table = Table(title=f"clawfast train ({self.total_steps} steps)", expand=False)
        for _, title, _ in _COLUMNS:
            table.add_column(title, justify="right")
        for row in self.rows[-self.max_rows:]:
            table.add_row(*[_fmt(row.get(key), fmt) for key, _, fmt in _COLUMNS])
        status = [c.line(bar_width=24) for c in self.counters] or ["starting"]
        parts = [table, *[Text(line, style="cyan") for line in status]]
        parts += [Text(e, style="green") for e in self.evals[-4:]]
        return Group(*parts)

    def start(self) -> "ProgressView":
        self.view.start()
        return self

    def begin(self, name: str, total: int, unit: str) -> Phase:
        """Start a phase (inside the current one, if any: `end` returns to it)."""
        self.counters.append(Phase(name, total, unit))
        self.view.update()
        return self.counters[-1]

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if not self.counters:
            return
        self.counters[-1].done += n
        if note is not None:
            self.counters[-1].note = note
        self.view.update()

    def end(self, note: str | None = None) -> None:
        """Close the innermost phase: its final line stays in the view (a terminal) or is printed."""
        if not self.counters:
            return
        counter = self.counters.pop()
        if note is not None:
            counter.note = note
        self.add_eval(counter.line())

    def add_step(self, record: dict[str, Any], line: str) -> None:
        """A finished step: a row of the table (a terminal), else `line` printed."""
        self.rows.append(record)
        self.view.update()
        self.view.say(line)

    def add_eval(self, text: str) -> None:
        self.evals.append(text)
        self.view.update()
        self.view.say(text)

    def stop(self) -> None:
        self.view.stop()


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(int(value) if fmt == "{:d}" else value)
    except (TypeError, ValueError):
        return str(value)

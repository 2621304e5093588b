"""A rollout run's progress: its counts (`RunStats`, made by each `run` of the scheduler or the Ray
pool) and their one live line (`rollout_line`, on the program's live view `clawfast.live`): done /
total, running, failed, rollouts per minute, the count of each non-ok status, and the retries of
infrastructure failures with the Ray nodes lost (`clawfast.rollout.retry`). Drawn on stderr;
on a non-terminal it prints only at the end."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rich.text import Text

from clawfast.live import LiveView
from clawfast.records import RolloutResult
from clawfast.rollout.retry import infra_counts


@dataclass
class RunStats:
    """Counts of one `run`; `failed` counts every status other than ``ok``; `running`: rollouts
    running now for any caller of the scheduler; `retries`: attempts of the results so far that ran
    again; `nodes_lost`: Ray nodes whose actor died under one of their attempts."""

    total: int = 0
    done: int = 0
    running: int = 0
    failed: int = 0
    by_status: Counter = field(default_factory=Counter)
    retries: int = 0
    nodes_lost: set = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)

    def record(self, result: RolloutResult) -> None:
        # The one place counters change.
        self.done += 1
        self.by_status[result.status] += 1
        if result.status != "ok":
            self.failed += 1
        infra = infra_counts([result])
        self.retries += infra["retries"]
        self.nodes_lost.update(infra["nodes_lost"])

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def per_minute(self) -> float:
        return 60.0 * self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


def render_stats(stats: RunStats) -> Text:
    text = Text()
    text.append(f"rollouts {stats.done}/{stats.total}", style="bold")
    text.append(f"  running {stats.running}", style="cyan")
    text.append(f"  failed {stats.failed}", style="red" if stats.failed else "green")
    text.append(f"  {stats.per_minute:.1f}/min  {stats.elapsed_s:.0f}s")
    failures = {k: v for k, v in sorted(stats.by_status.items()) if k != "ok"}
    if failures:
        text.append("  (" + ", ".join(f"{k} {v}" for k, v in failures.items()) + ")", style="red")
    if stats.retries or stats.nodes_lost:
        text.append(f"  retried {stats.retries}, nodes lost {len(stats.nodes_lost)}", style="yellow")
    return text


def rollout_line(stats: RunStats) -> LiveView:
    """The live line of `stats` (`start`, `update` after each change, `stop`)."""
    return LiveView(lambda: render_stats(stats), last=True)

"""A live one-line display of a rollout run (rich): done / total, running, failed, rollouts per minute,
and the count of each non-ok status. Drawn on stderr; on a non-terminal it prints only at the end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.text import Text

if TYPE_CHECKING:
    from clawfast.rollout.scheduler import RunStats


def render_stats(stats: "RunStats") -> Text:
    text = Text()
    text.append(f"rollouts {stats.done}/{stats.total}", style="bold")
    text.append(f"  running {stats.running}", style="cyan")
    text.append(f"  failed {stats.failed}", style="red" if stats.failed else "green")
    text.append(f"  {stats.per_minute:.1f}/min  {stats.elapsed_s:.0f}s")
    failures = {k: v for k, v in sorted(stats.by_status.items()) if k != "ok"}
    if failures:
        text.append("  (" + ", ".join(f"{k} {v}" for k, v in failures.items()) + ")", style="red")
    return text


class ProgressDisplay:
    def __init__(self, stats: "RunStats", console: Console | None = None) -> None:
        self.stats = stats
        self.console = console or Console(stderr=True)
        self._live = Live(render_stats(stats), console=self.console, refresh_per_second=2, transient=False)

    def start(self) -> None:
        self._live.start()

    def update(self) -> None:
        self._live.update(render_stats(self.stats))

    def stop(self) -> None:
        self._live.update(render_stats(self.stats))
        self._live.stop()

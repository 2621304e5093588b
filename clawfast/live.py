"""The program's one live view: a region of the terminal that rich redraws, at most twice a second,
from its owner's `render()`. A training run's view (`clawfast.train.progress.ProgressView`) and a
rollout run's line (`clawfast.rollout.progress.rollout_line`) are both drawn through it, so the
program has one policy for where and how progress shows.

Drawn on stderr, and only on a terminal, wrapped to its width. On a non-terminal (a CI log, a file),
or with ``live=False``, nothing is redrawn: the owner's `say` lines are printed as they come, as print
would put them (unwrapped; on stdout with ``live=False``, else on stderr), and with ``last=True`` the
final state is printed once, at `stop`. Not guaranteed: a region taller than the terminal is cropped
while it is live.
"""

from __future__ import annotations

from typing import Callable

from rich.console import Console, RenderableType
from rich.live import Live


class LiveView:
    """`render()` drawn live between `start` and `stop`; `update` after each change of what it shows."""

    def __init__(self, render: Callable[[], RenderableType], *, live: bool = True, last: bool = False) -> None:
        self.render = render
        self.console = Console(stderr=live)
        self.drawn = live and self.console.is_terminal
        self._live = None
        # On a non-terminal, rich's Live prints its final state when it stops and nothing before.
        if self.drawn or (live and last):
            self._live = Live(render(), console=self.console, refresh_per_second=2)

    def start(self) -> "LiveView":
        if self._live is not None:
            self._live.start()
        return self

    def update(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    def say(self, text: str) -> None:
        """A line for where nothing is drawn (the live region shows the same from `render`)."""
        if not self.drawn:
            self.console.print(text, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        """Draw the final state and stop (idempotent)."""
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()
            self._live = None

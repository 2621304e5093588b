"""How the calls of one rollout hold MoE routing (`CallRecord.routing`), each row once: the rule the
proxy stores by and the trainer reads by (docs/MODELS.md "Routing replay").

Row p of a call's path (``prompt_ids + output_ids``) is the model's forward at ``path[p]``; the
engine reports the experts it chose there. A harness's next call re-sends the conversation, so most
of a call's rows are rows an earlier call of the rollout ran. The rule:

- A call's **parent** is the earlier call whose path shares the longest prefix with its path (the
  latest one among equals); ``lcp`` is that shared length.
- A call **stores** its rows from the first one, at or after the engine's first reported row, whose
  routing differs from the parent's routing of that row, or that the parent has none for, or that
  lies past the shared prefix (`first_stored_row`): the leading rows it would store again are the
  parent's, so they are not stored.
- A row's routing (`RolloutRouting`): the call's own stored row if it stored it, else the parent's
  routing of that row if the row lies in their shared prefix, else none.

So a row that the engine ran once (a conversation's history, reused from its KV cache) is stored
once, and a row it ran again with another outcome (recomputed, where rounding flipped a near tie)
is stored again, by the call that ran it so: the trainer then sees two different computations and
keeps them apart (`clawfast.train.routing_rows`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def routing_parent(path: np.ndarray, earlier: Sequence[np.ndarray]) -> tuple[int, int]:
    """(index into `earlier`, shared prefix length) of the earlier path sharing the longest prefix
    with `path`, the latest among equals; (-1, 0) when none shares a token."""
    best, best_len = -1, 0
    for i, other in enumerate(earlier):
        n = common_prefix_len(path, other)
        if n and n >= best_len:
            best, best_len = i, n
    return best, best_len


class RolloutRouting:
    """The routing sources of a rollout's calls, added in call order: ``sources[i]`` (int32, one per
    path row of call i, or None when it has none) indexes the rows of the calls' stored routings
    concatenated (`row`, `table`), -1 for none. ``first_own``: rows of a call below it that the call
    stored do not count as its own (routing replay "generated" passes the prompt length: only
    sampled tokens' rows)."""

    def __init__(self, paths: Sequence[np.ndarray] = ()) -> None:
        """`paths`: earlier calls that hold no routing (so their sources are None)."""
        self.paths: list[np.ndarray] = [np.asarray(p) for p in paths]
        self.sources: list[np.ndarray | None] = [None] * len(self.paths)
        self._stored: list[np.ndarray] = []
        self._stored_tokens: list[np.ndarray] = []
        self._offsets = [0]

    def parent(self, path: np.ndarray) -> tuple[int, int]:
        return routing_parent(path, self.paths)

    def inherited(self, path: np.ndarray) -> np.ndarray:
        """The sources a call of `path` takes from its parent before its own rows (-1 elsewhere)."""
        src = np.full(len(path), -1, dtype=np.int32)
        parent, lcp = self.parent(path)
        if parent >= 0 and self.sources[parent] is not None:
            src[:lcp] = self.sources[parent][:lcp]
        return src

    def add(self, path: np.ndarray, routing: np.ndarray | None, routing_start: int, first_own: int = 0,
            inherited: np.ndarray | None = None) -> None:
        """`inherited`: `inherited(path)` if the caller has it already (it compares `path` with every
        earlier one)."""
        src = (self.inherited(path) if inherited is None else inherited).copy()
        if routing is not None and len(routing):
            rows = routing_start + np.arange(len(routing))
            own = rows >= first_own
            src[rows[~own]] = -1
            src[rows[own]] = self._offsets[-1] + np.flatnonzero(own)
            self._stored.append(routing)
            self._stored_tokens.append(np.asarray(path)[rows])
            self._offsets.append(self._offsets[-1] + len(routing))
        self.paths.append(np.asarray(path))
        self.sources.append(src if (src >= 0).any() else None)

    def row(self, sources: np.ndarray) -> np.ndarray:
        """The stored routing rows ([n, layers, top_k]) of `sources` (all >= 0)."""
        which = np.searchsorted(self._offsets, sources, side="right") - 1
        out = None
        for j in np.unique(which):
            at = which == j
            part = self._stored[j][sources[at] - self._offsets[j]]
            if out is None:
                out = np.empty((len(sources), *part.shape[1:]), dtype=part.dtype)
            out[at] = part
        return out if out is not None else np.zeros((0, 0, 0), dtype=np.uint8)

    def table(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The stored rows concatenated (what `sources` index: [S, layers, top_k]) and the token of
        each (its input token); None when no call stored any."""
        if not self._stored:
            return None
        return np.concatenate(self._stored), np.concatenate(self._stored_tokens)


def first_stored_row(history: RolloutRouting, inherited: np.ndarray, routing: np.ndarray, routing_start: int) -> int:
    """The first row a new call stores of the engine's `routing` (rows from `routing_start`; its
    parent's sources `history.inherited(path)`): past the leading rows whose routing the parent
    holds alike (module docstring). Returns a row in ``[routing_start, routing_start + len(routing)]``."""
    end = routing_start + len(routing)
    same_to = routing_start
    if end > routing_start:
        src = inherited[routing_start:end]
        known = np.flatnonzero(src < 0)
        span = int(known[0]) if known.size else len(src)  # rows the parent has routing for
        if span:
            equal = np.all(history.row(src[:span]).reshape(span, -1) == routing[:span].reshape(span, -1), axis=1)
            differ = np.flatnonzero(~equal)
            span = int(differ[0]) if differ.size else span
        same_to = routing_start + span
    return same_to

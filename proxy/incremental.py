"""Per-rollout memory that makes request translation incremental.

A harness resends the whole conversation on every call. `UnitMemory` remembers the raw JSON units
(message dicts, or runs of Responses items) of a rollout's recent requests and the canonical
messages each became; a new request reuses the translation of its longest matching prefix — the
*same* `Message` objects, which the renderer then recognises by identity — and validates and
translates only the new units. With `loads` (`clawfast.proxy.rawprefix`) the units of a shared
prefix are the very objects parsed for an earlier body, so comparing them is mostly identity checks;
others are compared as the JSON they were (`same_json`).

Guaranteed: the result equals translating every unit afresh (the translation of a unit depends only
on the unit and its index, which callers must ensure). Not guaranteed: thread safety — one event
loop owns a rollout's memory.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import orjson

from clawfast.proxy.canonical import Message
from clawfast.proxy.rawprefix import PrefixParser

Convert = Callable[[Any, int], Sequence[Message]]


def common_prefix(a: list | tuple, b: list | tuple, same: Callable[[Any, Any], bool] | None = None) -> int:
    """Length of the longest common prefix: elements identical, or equal (`same`; default ``==``)."""
    if same is None and len(a) >= len(b) and a[: len(b)] == b:  # the usual extension: one C-level comparison
        return len(b)
    n = 0
    for x, y in zip(a, b):
        if x is not y and not (same(x, y) if same is not None else x == y):
            break
        n += 1
    return n


def same_json(x: Any, y: Any) -> bool:
    """Whether two parsed JSON units are the same JSON: ``==`` alone takes ``1``, ``1.0`` and ``true``
    for one another and ignores key order, each of which a template writes differently."""
    return x == y and orjson.dumps(x) == orjson.dumps(y)


class UnitMemory:
    def __init__(self, entries: int = 4) -> None:
        self._entries: deque[tuple[list, list, list, list[int]]] = deque(maxlen=entries)
        self._memo: dict[str, tuple[Any, Any]] = {}
        self._parsers: dict[str, PrefixParser] = {}

    def loads(self, body: bytes, key: str) -> Any:
        """``orjson.loads(body)``, reusing the parsed elements of the `key` array that earlier bodies
        share byte for byte (see `clawfast.proxy.rawprefix`)."""
        parser = self._parsers.get(key)
        if parser is None:
            parser = self._parsers[key] = PrefixParser(key)
        return parser.loads(body)

    def translate(self, units: list, convert: Convert) -> list[Message]:
        """Canonical messages of `units`, converting only those past the longest remembered prefix."""
        best_k, best = 0, None
        for entry in self._entries:
            k = common_prefix(units, entry[0], same_json)
            if k > best_k:
                best_k, best = k, entry
        # An entry keeps its flat message list and, per unit, how many messages the units up to it
        # became: reusing a prefix is then list slices (C), not a Python loop over every message of
        # the history (~20 us per call at 257 messages).
        if best is not None:
            groups, messages, counts = best[1][:best_k], best[2][: best[3][best_k - 1]], best[3][:best_k]
        else:
            groups, messages, counts = [], [], []
        for i, unit in enumerate(units[best_k:], start=best_k):
            group = tuple(convert(unit, i))
            groups.append(group)
            messages.extend(group)
            counts.append(len(messages))
        if best is not None:
            if best_k == len(best[0]):
                self._entries.remove(best)  # the new request extends it: keep one entry per thread of calls
            # Keep the remembered objects for the shared prefix so entries share memory.
            units = best[0][:best_k] + units[best_k:]
        self._entries.append((units, groups, messages, counts))
        return list(messages)

    def memo(self, name: str, raw: Any, compute: Callable[[Any], Any]) -> Any:
        """`compute(raw)`, reusing the last result for `name` when `raw` is the same JSON as last time's
        (`same_json`; so the value keeps its identity across calls, e.g. the tool list)."""
        last = self._memo.get(name)
        if last is not None and (last[0] is raw or same_json(last[0], raw)):
            return last[1]
        value = compute(raw)
        self._memo[name] = (raw, value)
        return value

"""Where an answer ends before the engine stopped: at a stop sequence (OpenAI's ``stop``, Anthropic's
``stop_sequences``), or after its first tool call where the request allows one call at a time
(`clawfast.proxy.core.ProxyCore`).

Engines sample token ids and know no text, so the proxy cuts after the engine is done: the call keeps
the fewest sampled tokens whose text reaches the end (with their log-probs, weight versions and MoE
routing rows), and the harness gets the text up to it. Cutting after sampling is exact: the kept
tokens were sampled from the same distributions they would have been if the engine had stopped there,
and what the policy sampled past them is dropped, not trained. What it costs is the engine's time on
the dropped tokens, up to the call's output budget.

Not guaranteed: the last kept token may hold text past the end (a token such as ``"\\n\\nObs"``
completing the stop sequence ``"\\nO"``); the record keeps the token. The harness never sees the text
past a stop sequence; past a first tool call it gets it as text after the call (only where the
markup's opening is not one token: a ``">\\n<"`` token ending ``</tool_call>`` where ``<tool_call>``
is plain text to the tokenizer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from clawfast.engines.base import Generation


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop sequence in `text` starts, and which it is (the longest of those
    starting there); None if `text` holds none."""
    found = [(i, -len(s), s) for s in stops if (i := text.find(s)) != -1]
    if not found:
        return None
    i, _, s = min(found)
    return i, s


def before_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` up to its earliest stop sequence, and that sequence (None: `text` whole)."""
    found = first_stop(text, stops)
    return (text, None) if found is None else (text[: found[0]], found[1])


def cut_at_stop(gen: Generation, prompt_len: int, stops: Sequence[str],
                answer_text: Callable[[np.ndarray], str]) -> Generation:
    """`gen` ended at its first stop sequence: the shortest prefix of its output whose
    `answer_text` holds one (`cut_where`)."""
    return cut_where(gen, prompt_len, lambda ids: first_stop(answer_text(ids), stops) is not None)


def cut_where(gen: Generation, prompt_len: int, ends: Callable[[np.ndarray], bool]) -> Generation:
    """`gen` with the shortest prefix of its output ids for which `ends` holds, finish_reason "stop";
    `gen` itself if `ends` does not hold for its whole output. A binary search: `ends` must hold for a
    prefix if it holds for a shorter one (true of a text test, since each prefix's text begins the
    next one's)."""
    ids = gen.output_ids
    if not ends(ids):
        return gen
    lo, hi = 1, len(ids)  # the shortest prefix that ends has hi tokens, and more than lo - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ends(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return _keep(gen, hi, prompt_len)


def _keep(gen: Generation, n: int, prompt_len: int) -> Generation:
    """`gen` with its first `n` output tokens: routing rows past the kept path's last fed-back token
    (path row ``prompt_len + n - 2``) dropped."""
    routing, routing_start = gen.routing, gen.routing_start
    if routing is not None:
        rows = max(0, prompt_len + n - 1 - routing_start)
        routing = routing[:rows] if rows else None
        routing_start = routing_start if rows else 0
    versions = gen.output_versions
    return dataclasses.replace(
        gen,
        output_ids=gen.output_ids[:n],
        infer_logprobs=gen.infer_logprobs[:n],
        output_versions=None if versions is None else versions[:n],
        finish_reason="stop",
        routing=routing,
        routing_start=routing_start,
    )

"""Suite specs with a path and options, ``PREFIX:PATH[?name=value&...]`` (``clawgym:``, ``pinchbench:``),
and the hash split they share (``eval=FRACTION``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl


def parse_spec(spec: str, prefix: str, allowed: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """``PREFIX:PATH[?options]`` -> (PATH, options). `allowed`: option name -> how it is written, for
    the error that names an unknown one. Raises ValueError."""
    if not spec.startswith(prefix):
        raise ValueError(f"{spec!r} is not a {prefix[:-1]} suite ({prefix}PATH)")
    path, _, query = spec[len(prefix):].partition("?")
    if not path:
        raise ValueError(f"{spec!r}: no path after {prefix}")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{spec!r}: unknown option {unknown[0]!r} (allowed: {', '.join(allowed.values())})")
    return Path(path), options


def eval_fraction(spec: str, options: dict[str, str]) -> float | None:
    """The ``eval=FRACTION`` option of `spec`, None when absent. Raises ValueError."""
    if "eval" not in options:
        return None
    try:
        fraction = float(options["eval"])
    except ValueError:
        raise ValueError(f"{spec!r}: eval={options['eval']!r} is not a number") from None
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{spec!r}: eval={fraction} must lie strictly between 0 and 1")
    return fraction


def hash_split(task_id: str, eval_fraction: float) -> str:
    """``eval`` or ``train`` for `task_id`, the same on every machine and in every run: ``eval`` when
    the first 8 bytes of the SHA-256 of the id, read as a fraction of 2^64, are below `eval_fraction`."""
    h = int.from_bytes(hashlib.sha256(task_id.encode("utf-8")).digest()[:8], "big")
    return "eval" if h / 2.0**64 < eval_fraction else "train"


def split_rule(split: str | None, eval_fraction: float | None) -> str | Callable[[str], str]:
    """The split of a suite's tasks: by `hash_split` with ``eval=FRACTION``; without it the suite is one
    split, the one asked for (``train`` when none is)."""
    if eval_fraction is None:
        return split or "train"
    return lambda task_id: hash_split(task_id, eval_fraction)

"""argparse value types shared by the `clawfast` commands.

A value they refuse is argparse's usage error: one line naming the option, exit status 2, before the
command does anything (never a traceback later, nor a silently different value).
"""

from __future__ import annotations

import argparse
import math

MAX_PORT = 65535


def port(text: str) -> int:
    """A TCP port to listen on, 0 meaning any free one. Checked here because a larger number is not
    refused further down: it ends up listening on another port (the number modulo 65536)."""
    value = int(text)
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..{MAX_PORT} (0: any free port), got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):  # also refuses nan, which compares false with everything
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A top_p: in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value

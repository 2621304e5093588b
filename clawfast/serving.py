"""The serving proxy's settings as plain data: `ProxyConfig`, the bounds `clawfast.proxy.core.ProxyCore`
puts on every call and how it answers.

It lives below the proxy because the trainer writes a run's proxy settings (`clawfast.train.build`) and
may not import `clawfast.proxy` (tests/test_dependencies.py R5), while the proxy may not import the
trainer or the rollout service (R3): this module imports nothing of clawfast, so every floor may. The
proxy re-exports it (`clawfast.proxy.ProxyConfig`, `clawfast.proxy.core.ProxyConfig`: the same class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ProxyConfig:
    """max_tokens_cap: upper bound on any call's output budget. default_max_tokens: budget when the
    request names none. max_model_len: prompt + output limit (None: unchecked). keepalive_s: seconds
    between keep-alive events while the engine works. parser: tool-call parser family (None: from the
    tokenizer's special tokens). What a call samples with beyond these bounds (temperature, top_p,
    its rollout's call budget) is its rollout's `Sampling`, set when the rollout is opened, merged by
    `Sampling.params`."""

    max_tokens_cap: int = 4096
    default_max_tokens: int = 1024
    max_model_len: int | None = None
    keepalive_s: float = 5.0
    parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens_cap", "default_max_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProxyConfig.{name} must be a positive int, got {value!r}")
        # 0 or less would make the server's wait for the engine return at once, in a busy loop
        keepalive = self.keepalive_s
        if isinstance(keepalive, bool) or not isinstance(keepalive, (int, float)) or not (
                math.isfinite(keepalive) and keepalive > 0):
            raise ValueError(f"ProxyConfig.keepalive_s must be a number of seconds > 0, got {keepalive!r}")

    def served_context(self, engine_limit: int | None) -> int | None:
        """The longest prompt + output a call may have: `max_model_len` or the engine's own limit
        (`clawfast.engines.base.Engine.max_model_len`), whichever is smaller; None where neither is set."""
        limits = [n for n in (self.max_model_len, engine_limit) if n is not None]
        return min(limits) if limits else None

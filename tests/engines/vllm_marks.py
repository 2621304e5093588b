"""The marks of a test module that needs vLLM: ``vllm`` and ``slow``, skipped with the import error as
the reason where ``import vllm`` fails (ImportError, or a broken binary build raising something else)."""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401

    VLLM_ERROR = None
except Exception as exc:
    VLLM_ERROR = f"{type(exc).__name__}: {exc}"

VLLM_MODULE = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vllm does not import: {VLLM_ERROR}"),
]

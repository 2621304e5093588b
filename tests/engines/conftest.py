"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen3 (`tiny_qwen3.tiny_qwen3(seed=1)`) saved as a model directory, once per module."""
    from .tiny_qwen3 import tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_qwen3(seed=1).save_pretrained(path)
    return path

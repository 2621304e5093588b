"""Shared setup of the kernel tests.

Triton decides at ``@triton.jit`` time (i.e. when clawfast.kernels is imported) whether a kernel is
compiled or interpreted, from TRITON_INTERPRET. This conftest is imported before the test modules
of this directory, so on a machine without CUDA it sets TRITON_INTERPRET=1 first; the ``triton``
tests then run the real kernel code in the interpreter on small CPU tensors. On a CUDA machine it
leaves the variable alone and the same tests run compiled on the GPU. If something imported
clawfast.kernels earlier without the variable (another test directory collected first), the triton
tests fail with a message that says so rather than skipping: run them with TRITON_INTERPRET=1 set
in the environment.

Every test here also runs with ``torch.empty``/``torch.empty_like`` poisoned (NaN for floats, a
huge negative for integers), so an output element a kernel forgot to write cannot pass.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-(2**30))
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(real_empty_like(*a, **k)))
    yield


@pytest.fixture
def triton_device():
    """The device the Triton kernels run on here; fails if they cannot run at all."""
    pytest.importorskip("triton", reason="triton is not installed")
    import importlib

    mod = importlib.import_module("clawfast.kernels.tree_logprobs")

    interpreted = type(mod._tree_logprobs_fwd_kernel).__name__ == "InterpretedFunction"
    if DEVICE == "cpu" and not interpreted:
        pytest.fail("clawfast.kernels was imported before TRITON_INTERPRET=1 was set; "
                    "run the triton tests with TRITON_INTERPRET=1 in the environment")
    return DEVICE

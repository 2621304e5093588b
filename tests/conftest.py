import os

import torch

# Triton picks compiled or interpreted mode when clawfast.kernels is first imported, and any test
# directory may import it first: on a machine without a GPU the interpreter must be on from the start.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:
        pass
    yield


def pytest_report_header(config):
    return [f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"]

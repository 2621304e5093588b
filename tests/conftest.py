import os
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

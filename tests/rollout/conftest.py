import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def private_tmp(monkeypatch):
    """Every temporary file of the test (sandbox dirs, verifier copies) goes to a fresh directory
    with a short path (the proxy's Unix socket path under it must fit in 107 bytes); removed after."""
    path = Path(tempfile.mkdtemp(prefix="cfr-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

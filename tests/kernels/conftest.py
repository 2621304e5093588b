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

import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from kernel_testing import AOT_PYTHONS, AOT_TIMEOUT_S, aot_environment

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


# ---------------------------------------------------------------------------------------------
# The ahead-of-time compile of every kernel variant (test_aot.py): minutes of CPU, so it starts in
# the background as soon as the suite is collected, at low priority (the other tests keep the CPU
# when they want it), and its test runs last.

_AOT_RUN = pytest.StashKey[dict]()


def pytest_configure(config):
    config.addinivalue_line("markers", "aot_background: reads the background ahead-of-time compiles of every kernel")


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: no compile for a test that will not run
def pytest_collection_modifyitems(session, config, items):
    waiting = [item for item in items if item.get_closest_marker("aot_background")]
    if not waiting:
        return
    items[:] = [item for item in items if item not in waiting] + waiting
    out = Path(tempfile.mkdtemp(prefix="clawfast-aot-"))
    # One job, the Tritons in turn (each compiles with every CPU), at low priority, in a session of
    # its own and not a child of this process: tests that check for leftover children (the sandbox
    # leak checks) must not see it. Its end is the file `done`.
    script = "".join(
        f"{shlex.quote(str(python))} -m clawfast.kernels.aot --quiet --json {out / (name + '.json')} "
        f"--table {out / (name + '.md')} > {out / (name + '.log')} 2>&1; echo $? > {out / (name + '.rc')}; "
        for name, python in AOT_PYTHONS.items() if python.exists()) + f"touch {out / 'done'}"
    launcher = subprocess.run(["bash", "-c", f"nice -n 10 setsid bash -c {shlex.quote(script)} </dev/null >/dev/null 2>&1 & "
                               "echo $!"], env=aot_environment(), capture_output=True, text=True, check=True)
    config.stash[_AOT_RUN] = {"pid": int(launcher.stdout), "dir": out}


def _kill(run: dict) -> None:
    try:
        os.killpg(run["pid"], signal.SIGKILL)  # setsid: the session's group is the job's pid
    except ProcessLookupError:
        pass


def pytest_unconfigure(config):
    run = config.stash.get(_AOT_RUN, None)
    if run is not None and not (run["dir"] / "done").exists():  # the suite stopped before the test waited
        _kill(run)


@pytest.fixture(scope="session")
def aot_reports(pytestconfig) -> dict:
    """By Triton (AOT_PYTHONS): (exit status, JSON report, printed output) of the background compile,
    waited for; None for an interpreter that does not exist."""
    run = pytestconfig.stash[_AOT_RUN]
    deadline = time.monotonic() + AOT_TIMEOUT_S
    while not (run["dir"] / "done").exists():
        if time.monotonic() > deadline:
            _kill(run)
            pytest.fail(f"the ahead-of-time compiles did not finish in {AOT_TIMEOUT_S} s; logs in {run['dir']}")
        time.sleep(2)
    reports = {}
    for name, python in AOT_PYTHONS.items():
        if not python.exists():
            reports[name] = None
            continue
        output = (run["dir"] / f"{name}.log").read_text()
        report = run["dir"] / f"{name}.json"
        assert report.is_file(), output[-6000:]
        reports[name] = (int((run["dir"] / f"{name}.rc").read_text()), json.loads(report.read_text()), output)
    return reports

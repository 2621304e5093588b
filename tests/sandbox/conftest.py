"""Fixtures for sandbox tests: real backends, throwaway loopback servers, and leak probes that look
at the host itself (/proc, mountinfo, cgroup directories, temp directories)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from clawfast.sandbox.cgroup import CgroupHost, sandbox_groups
from clawfast.sandbox.probes import pids_with

from .host_servers import EchoServer


@pytest.fixture
def echo_server():
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def marker() -> str:
    """A unique string to put on the command lines of sandboxed processes, to find them from the host."""
    return f"cfmark{uuid.uuid4().hex[:12]}"


def mounts() -> list[str]:
    """Mounts this test process's sandboxes made on the host (their quota filesystems): the only
    mounts a backend makes outside its sandboxes' own namespaces. Other processes' are left out, so
    that a suite running beside another (a benchmark, a second pytest) is judged on its own."""
    own = (f"clawfast-sandbox-{os.getpid()}-", f"clawfast-docker-{os.getpid()}-")
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split(" ", 5)[4] for line in f if any(o in line.split(" ", 5)[4] for o in own))


def own_cgroups() -> list[str]:
    """Sandbox cgroups created by this test process."""
    return sandbox_groups(CgroupHost.detect(), os.getpid())


def children() -> list[int]:
    """Live (non-zombie) child processes of this test process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(entry))
    return out


@pytest.fixture
def leak_check():
    """Call the returned function after closing everything to assert that no process, mount, cgroup
    or temp directory was left behind."""

    def check(*, base_dirs: list[str] = (), markers: list[str] = ()) -> None:
        for d in base_dirs:
            assert not os.path.exists(d), f"temp directory left behind: {d}"
        for m in markers:
            assert pids_with(m) == [], f"processes left behind: {m}"
        assert own_cgroups() == [], "cgroups left behind"
        assert mounts() == [], "mounts left behind"
        assert children() == [], "child processes left behind"

    return check


class Host:
    """The probes above, as a fixture (test modules cannot import a conftest by name)."""

    pids_with = staticmethod(pids_with)
    mounts = staticmethod(mounts)
    own_cgroups = staticmethod(own_cgroups)
    children = staticmethod(children)


@pytest.fixture
def backend(leak_check):
    """A bwrap backend, checked for leaks after the test (docker's tests bring their own)."""
    from clawfast.sandbox.bwrap import BwrapBackend

    b = BwrapBackend()
    yield b
    b.close()
    leak_check(base_dirs=[b.base_dir])


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def outside_dir():
    """A fresh, world-readable host directory outside /tmp and /run (which every sandbox covers with
    its own anyway), so that only the backend's isolation can keep what a test puts there hidden."""
    d = tempfile.mkdtemp(prefix="clawfast-outside-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)

"""Per-sandbox cgroups against the real kernel: v1 (this machine's memory, pids and cpu hierarchies)
and v2 (its unified hierarchy at /sys/fs/cgroup/unified, which holds only the hugetlb controller: the
v2 tests cover what does not need memory/pids/cpu there — groups, membership, cgroup.kill, the
delegation of controllers to a subtree — and that missing controllers are reported, not skipped), and
the startup message of a host with no usable hierarchy. Run as root, as CI does."""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid

import pytest

from clawfast.sandbox import Limits, SandboxSpec
from clawfast.sandbox import cgroup as cg
from clawfast.sandbox.bwrap import BwrapBackend
from clawfast.sandbox.cgroup import Cgroup, CgroupHost

UNIFIED = "/sys/fs/cgroup/unified"


def joined_sleeper(procs_file: str) -> subprocess.Popen:
    proc = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {procs_file} && exec sleep 300'])
    deadline = time.monotonic() + 5
    while proc.pid not in {int(p) for p in open(procs_file).read().split()}:
        assert time.monotonic() < deadline, "the process did not join its group"
        time.sleep(0.01)
    return proc


def test_v1_groups_carry_the_limits():
    host = CgroupHost.legacy()
    assert set(host.parents) == {"memory", "pids", "cpu"}, host.missing  # this machine's v1 hierarchies
    group = Cgroup.create(Limits(memory_bytes=64 << 20, max_processes=32, cpus=0.25), host)
    try:
        assert group.enforced == {"memory": "cgroup v1 memory", "processes": "cgroup v1 pids", "cpu": "cgroup v1 cpu"}
        assert open(os.path.join(group.dirs["memory"], "memory.limit_in_bytes")).read().strip() == str(64 << 20)
        assert open(os.path.join(group.dirs["pids"], "pids.max")).read().strip() == "32"
        assert open(os.path.join(group.dirs["cpu"], "cpu.cfs_quota_us")).read().strip() == "25000"
    finally:
        group.destroy()
    assert not any(os.path.exists(d) for d in group.procs_files)


@pytest.fixture
def unified_parent(monkeypatch):
    """An empty group of the real v2 hierarchy, delegated to the test as CLAWFAST_CGROUP says."""
    if not os.path.exists(os.path.join(UNIFIED, "cgroup.controllers")):
        pytest.fail(f"no cgroup v2 hierarchy at {UNIFIED}")
    # hugetlb, the one controller there, is handed down from the root (exempt from the rule that a
    # group giving controllers to children holds no process) for the test's parent to delegate.
    root_control = os.path.join(UNIFIED, "cgroup.subtree_control")
    had_hugetlb = "hugetlb" in open(root_control).read().split()
    if not had_hugetlb:
        with open(root_control, "w") as f:
            f.write("+hugetlb")
    parent = os.path.join(UNIFIED, f"clawfast-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(parent)
    monkeypatch.setenv("CLAWFAST_CGROUP", parent)
    yield parent
    # Put this process back where it was if a test moved it, then remove the test's groups.
    with open(os.path.join(UNIFIED, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    for dirpath, dirnames, _ in sorted(os.walk(parent), key=lambda w: -len(w[0])):
        os.rmdir(dirpath)
    if not had_hugetlb:
        with open(root_control, "w") as f:
            f.write("-hugetlb")


def test_v2_group_membership_kill_and_missing_controllers_reported(unified_parent):
    host = CgroupHost.unified(UNIFIED)
    assert host.version == 2 and host.parents == {"": unified_parent}
    # This hierarchy has no memory, pids or cpu controller: each limit says so, none is claimed.
    assert set(host.missing) == {"memory", "processes", "cpu"}
    assert all("not available" in why for why in host.missing.values())
    assert "NOT enforced" in host.report() and "memory" in host.report()
    group = Cgroup.create(Limits(memory_bytes=64 << 20, max_processes=32, cpus=0.5), host)
    assert group.enforced == {} and os.path.isdir(group.dirs[""])
    sleeper = joined_sleeper(group.procs_files[0])
    try:
        assert group.pids() == {sleeper.pid}
        assert group.kill_all(5.0)  # through cgroup.kill
        assert sleeper.wait(5) == -9
    finally:
        sleeper.kill()
        group.destroy()
    assert not os.path.exists(group.dirs.get("", "/nonexistent"))
    assert cg.sandbox_groups(host, os.getpid()) == []


def test_v2_delegation_enables_controllers_in_an_empty_parent(unified_parent):
    cg._enable(unified_parent, {"hugetlb"})
    assert "hugetlb" in open(os.path.join(unified_parent, "cgroup.subtree_control")).read().split()


def test_v2_delegation_refuses_a_parent_shared_with_other_processes(unified_parent):
    stranger = joined_sleeper(os.path.join(unified_parent, "cgroup.procs"))
    try:
        with pytest.raises(OSError, match="holds other processes.*CLAWFAST_CGROUP"):
            cg._enable(unified_parent, {"hugetlb"})
        assert "hugetlb" not in open(os.path.join(unified_parent, "cgroup.subtree_control")).read().split()
    finally:
        stranger.kill()
        stranger.wait()


def test_v2_delegation_moves_this_process_into_a_leaf_of_its_own(unified_parent):
    with open(os.path.join(unified_parent, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    cg._enable(unified_parent, {"hugetlb"})
    leaf = os.path.join(unified_parent, f"clawfast-trainer-{os.getpid()}")
    assert open(os.path.join(leaf, "cgroup.procs")).read().split() == [str(os.getpid())]
    assert "hugetlb" in open(os.path.join(unified_parent, "cgroup.subtree_control")).read().split()


def test_a_host_without_cgroups_says_so_at_start(monkeypatch, tmp_path, caplog, leak_check):
    """No hierarchy where the backend looks (as in a container without /sys/fs/cgroup): the backend
    logs which limits are not enforced when it is made, and sandboxes do not claim them."""
    monkeypatch.setattr(cg, "CGROUP_ROOT", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="clawfast.sandbox"):
        backend = BwrapBackend()
    try:
        message = " ".join(r.getMessage() for r in caplog.records)
        assert "NOT enforced" in message and all(k in message for k in ("memory", "processes", "cpu"))
        with backend.create(SandboxSpec(limits=Limits(memory_bytes=64 << 20, cpus=1.0))) as sb:
            assert not {"memory", "processes", "cpu"} & set(sb.enforced)
            assert sb.run(["true"]).ok
    finally:
        backend.close()
    leak_check(base_dirs=[backend.base_dir])

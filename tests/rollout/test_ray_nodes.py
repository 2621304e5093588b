"""The Ray path on a cluster of three raylets on this machine (`ray_cluster.LocalRayCluster`): the
rollout service places one actor per worker node and runs real mini-swe-agent rollouts in bubblewrap
sandboxes with the scripted engine; a worker raylet SIGKILLed under its rollouts makes each of them a
truthful ``sandbox_error`` (the others finish ok), later rollouts run on the live node, and nothing is
left running: no rollout open in the
proxy, no sandbox, no Ray process of the cluster."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

from clawfast.embedded import ensure_embedded_model
from clawfast.rollout import ORACLE, HarnessConfig, OnRay, RolloutService, Sampling, SchedulingConfig, make_specs
from clawfast.rollout.check import check_task

from .ray_cluster import LocalRayCluster

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)


def _bwrap_count() -> int:
    return len(subprocess.run(["pgrep", "-x", "bwrap"], capture_output=True, text=True).stdout.split())


@pytest.fixture
def cluster(tmp_path):
    c = LocalRayCluster(tmp_path / "ray-logs", workers=2, cpus_per_worker=1)
    try:
        yield c
    finally:
        c.close()
    left = subprocess.run(["pgrep", "-f", f"127.0.0.1:{c.port}"], capture_output=True, text=True).stdout.split()
    assert not left, f"Ray processes of the cluster left running: {left}"


def _service(cluster, tmp_path, tasks):
    return RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                          harnesses=HarnessConfig({"mini-swe-agent": {}}, timeout_s=240, logs_dir=tmp_path / "logs"),
                          scheduling=SchedulingConfig(concurrency=2, ray=OnRay(cluster.address, "clawbench-mini")),
                          oracle_tasks=tasks)


def test_actors_on_every_worker_node_run_rollouts(cluster, tmp_path):
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, ["mini-swe-agent"], k=2)
    with _service(cluster, tmp_path, tasks) as service:
        results = service.run(specs, Sampling(max_calls=20))
        assert service.registry.open_ids() == []
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0)] * 4, [r.info for r in results]
    # One actor per worker node (the head has no CPU for one), and both ran rollouts.
    assert {r.info["ray_node_id"] for r in results} == {cluster.node_id(0), cluster.node_id(1)}


def test_a_node_killed_under_its_rollouts_makes_them_sandbox_errors(cluster, tmp_path):
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, ["mini-swe-agent"], k=2)  # 4 rollouts: 2 slots on each node's actor
    doomed = cluster.node_id(0)
    bwraps = _bwrap_count()
    with _service(cluster, tmp_path, tasks) as service:
        out = {}
        runner = threading.Thread(target=lambda: out.setdefault("results", service.run(specs, Sampling(max_calls=20))))
        runner.start()
        # Kill node 0 once its rollouts are under way (each has opened its rollout in the proxy).
        deadline = time.monotonic() + 120
        while len(service.registry.open_ids()) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        cluster.kill_worker(0)
        runner.join(timeout=300)
        assert not runner.is_alive()
        assert service.registry.open_ids() == []
        # The dead node's actor gets no more rollouts: the next batch runs on node 1 alone.
        again = service.run(specs, Sampling(max_calls=20))
    assert [(r.status, r.reward) for r in again] == [("ok", 1.0)] * 4, [r.info for r in again]
    assert {r.info["ray_node_id"] for r in again} == {cluster.node_id(1)}
    results = out["results"]
    assert len(results) == 4
    lost = [r for r in results if r.status == "sandbox_error"]
    assert lost and all("rollout actor failed" in r.info["error"] for r in lost), [r.info for r in results]
    assert all((r.status, r.reward) == ("ok", 1.0) and r.info["ray_node_id"] != doomed
               for r in results if r.status != "sandbox_error"), [r.info for r in results]
    # The dead node's sandboxes die with its processes (bwrap's parent-death signal), the live node's
    # when the service closes; the kernel takes a moment to tear their PID namespaces down.
    deadline = time.monotonic() + 30
    while _bwrap_count() > bwraps and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _bwrap_count() <= bwraps

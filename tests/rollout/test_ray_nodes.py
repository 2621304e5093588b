"""The Ray path on a cluster of three raylets on this machine (`clawfast.rollout.local_cluster.LocalRayCluster`): the
rollout service places one actor per worker node and runs real mini-swe-agent rollouts in bubblewrap
sandboxes with the scripted engine; a worker raylet SIGKILLed under its rollouts makes each of them a
truthful ``sandbox_error`` that runs again on the live node (the others finish ok), a raylet started
again gets an actor, and nothing is left running: no rollout open in the proxy, no sandbox, no Ray
process of the cluster."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

from clawfast.embedded import ensure_embedded_model
from clawfast.proxy.rollouts import RETRIED_DIR
from clawfast.records import read_rollouts
from clawfast.rollout import ORACLE, HarnessConfig, OnRay, RolloutService, Sampling, SchedulingConfig, make_specs
from clawfast.rollout.check import check_task
from clawfast.train.metrics import rollout_metrics

from clawfast.rollout.local_cluster import LocalRayCluster

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


def test_a_node_killed_under_its_rollouts_runs_them_again_and_a_restarted_node_gets_an_actor(cluster, tmp_path):
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, ["mini-swe-agent"], k=2)  # 4 rollouts: 2 slots on each node's actor
    doomed, survivor = cluster.node_id(0), cluster.node_id(1)
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
        results = out["results"]

        # Every rollout comes back once, ok: those of the dead node ran again on the live one, with
        # the same task and sample index; their first attempts are closed as sandbox_error and set aside.
        assert [(r.task_id, r.sample_index, r.status, r.reward) for r in results] == [
            (s.task.id, s.sample_index, "ok", 1.0) for s in specs], [r.info for r in results]
        retried = [r for r in results if r.info.get("retries")]
        assert retried, "no rollout of the killed node was running"
        for r in retried:
            [note] = r.info["retries"]
            assert note["status"] == "sandbox_error" and note["actor_died"] and note["ray_node_id"] == doomed
            assert "rollout actor failed" in note["error"] and r.info["ray_node_id"] == survivor
        aside = read_rollouts(tmp_path / "records" / RETRIED_DIR)
        assert sorted(a.rollout_id for a in aside) == sorted(r.info["retries"][0]["rollout_id"] for r in retried)
        assert all(a.status == "sandbox_error" for a in aside)
        on_disk = read_rollouts(tmp_path / "records")
        assert sorted(r.rollout_id for r in on_disk) == sorted(r.rollout_id for r in results)
        metrics = rollout_metrics(results)
        assert metrics["rollout/nodes_lost"] == 1.0 and metrics["rollout/retries"] == len(retried)
        assert metrics[f"rollout/node/{survivor[:8]}"] == 4 - sum(r.info["ray_node_id"] == doomed for r in results)

        # The raylet comes back (as a new node): the next batch finds it and runs on both nodes.
        cluster.start_worker(0)
        reborn = cluster.node_id(0)
        assert reborn != doomed
        again = service.run(specs, Sampling(max_calls=20))
    assert [(r.status, r.reward) for r in again] == [("ok", 1.0)] * 4, [r.info for r in again]
    assert {r.info["ray_node_id"] for r in again} == {reborn, survivor}
    # The dead node's sandboxes die with its processes (bwrap's parent-death signal), the live node's
    # when the service closes; the kernel takes a moment to tear their PID namespaces down.
    deadline = time.monotonic() + 30
    while _bwrap_count() > bwraps and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _bwrap_count() <= bwraps

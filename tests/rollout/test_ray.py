"""The Ray path of the rollout service: two Ray actors of a local cluster executing rollouts that the
service opens and closes in its own process (so each call record is captured once, by the proxy),
running real mini-swe-agent in bubblewrap sandboxes with the scripted engine replaying each task's
oracle. Ray is installed by the test setup (the ``ray`` extra)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from clawfast.embedded import ensure_embedded_model
from clawfast.records import read_rollouts
from clawfast.rollout import ORACLE, HarnessConfig, OnRay, RolloutService, Sampling, SchedulingConfig, make_specs
from clawfast.rollout.check import check_task

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)


def test_two_actor_local_cluster_runs_rollouts_with_truthful_results(tmp_path):
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, ["mini-swe-agent"], k=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = OnRay("local", "clawbench-mini", num_actors=2, actor_options={"num_cpus": 1})
        with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                            harnesses=HarnessConfig({"mini-swe-agent": {}}, timeout_s=240, logs_dir=tmp_path / "logs"),
                            scheduling=SchedulingConfig(concurrency=2, ray=on_ray), oracle_tasks=tasks) as service:
            results = service.run(specs, Sampling(max_calls=20))
            # Two callers at once (the asynchronous loop's groups) share the actors' slots.
            with ThreadPoolExecutor(2) as callers:
                runs = [callers.submit(service.run, make_specs([t], ["mini-swe-agent"], k=2), Sampling(max_calls=20))
                        for t in tasks]
                concurrent = [r for run in runs for r in run.result()]
            assert service.registry.open_ids() == []
    finally:
        ray.shutdown()
    assert [(r.task_id, r.sample_index) for r in results] == [(s.task.id, s.sample_index) for s in specs]
    for r in results:
        assert (r.status, r.reward) == ("ok", 1.0), r.info
        assert len(r.calls) == len(check_task(r.task_id).oracle) + 1
        assert r.info["actor_pid"] != os.getpid() and r.info["ray_node_id"]
    assert len({r.rollout_id for r in results}) == 4
    assert len({r.info["actor_pid"] for r in results}) == 2  # both actors ran rollouts
    assert [(r.task_id, r.sample_index) for r in concurrent] == [(s.task.id, s.sample_index) for s in specs]
    assert all((r.status, r.reward) == ("ok", 1.0) for r in concurrent), [r.info for r in concurrent]
    # The records the caller got are the proxy's own, written in this process as calls were answered.
    on_disk = {r.rollout_id: r for r in read_rollouts(tmp_path / "records")}
    for r in results:
        assert [c.output_ids.tolist() for c in r.calls] == [c.output_ids.tolist() for c in on_disk[r.rollout_id].calls]
        assert on_disk[r.rollout_id].info["actor_pid"] == r.info["actor_pid"]


def test_a_pool_whose_actors_cannot_start_says_why_at_its_start(monkeypatch):
    # A suite path that does not exist on the nodes: every actor's start raises. The pool says so as
    # it starts, with the cause, instead of every rollout failing later as lost nodes.
    from clawfast.rollout.ray_backend import RayRolloutPool, RaySetup

    # "local" is a private cluster even where a plain `ray.init()` would join another (here a dead
    # address, which it would wait on for minutes); the pool shuts the cluster it started down.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    setup = RaySetup(suite="/nonexistent/suite-typo", harnesses={"mini-swe-agent": {}}, concurrency=1)
    with pytest.raises(RuntimeError, match=r"no rollout actor started \(suite '/nonexistent/suite-typo'\)"
                                           r"(.|\n)*suite-typo"):
        RayRolloutPool(setup, address="local")
    assert not ray.is_initialized()


def test_an_actor_run_that_raises_stops_the_run_as_the_local_scheduler_does(tmp_path):
    # A task the actors' suite does not hold: the actor's run raises (a bug in the caller's setup). It
    # is not a lost node to retry elsewhere: the run stops with that error and its rollout is closed.
    known = check_task("files-create-0")
    stranger = dataclasses.replace(known, id="files-create-0-elsewhere")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = OnRay("local", "clawbench-mini", num_actors=1, actor_options={"num_cpus": 1})
        with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                            harnesses=HarnessConfig({"mini-swe-agent": {}}, timeout_s=240, logs_dir=tmp_path / "logs"),
                            scheduling=SchedulingConfig(concurrency=1, ray=on_ray), oracle_tasks=[known]) as service:
            with pytest.raises(ValueError, match="'files-create-0-elsewhere' is not in this actor's suite"):
                service.run(make_specs([stranger], ["mini-swe-agent"], k=1), Sampling(max_calls=5))
            assert service.registry.open_ids() == []
    finally:
        ray.shutdown()
    (closed,) = read_rollouts(tmp_path / "records")
    assert closed.status == "harness_error" and "internal error" in closed.info["error"]
    assert "retries" not in closed.info

"""The scheduler's own contract: spec expansion, the concurrency cap, results in spec order, cleanup on
cancellation, and truthful statuses when the proxy fails to close. Real bwrap sandboxes and the real
rollout registry; the harness is the trivial `/bin/sh -c` one."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from clawfast.proxy.rollouts import RolloutRegistry
from clawfast.records import read_rollouts
from clawfast.rollout.progress import render_stats
from clawfast.rollout.scheduler import RolloutScheduler
from clawfast.rollout.spec import RolloutSpec, make_specs
from clawfast.rollout.worker import RolloutConfig, RolloutWorker
from clawfast.rollout.worker import proxy_port
from clawfast.sandbox.probes import pids_with
from clawfast.tasks.task import CommandVerifier, Task

from .script_harness import ScriptHarness

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)
SCORE_1 = "echo '{\"score\": 1}'"


def task(task_id: str, instruction: str, timeout: float = 30.0, verifier: str = SCORE_1) -> Task:
    return Task(id=task_id, instruction=instruction, verifier=CommandVerifier(verifier, timeout=10),
                oracle=[instruction], tags={"category": "t", "split": "train"}, timeout=timeout)


@pytest.fixture
def env(tmp_path, private_tmp):
    """A registry, a bwrap backend and the trivial harness; checks that nothing is left in temp."""
    from clawfast.sandbox.bwrap import BwrapBackend

    install = tmp_path / "install"
    install.mkdir()
    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47322")
    backend = BwrapBackend()
    try:
        yield registry, backend, {"script": ScriptHarness(install)}, tmp_path
    finally:
        backend.close()
    assert list(private_tmp.iterdir()) == []


def test_make_specs_is_task_major_and_validates():
    tasks = [task("a", "true"), task("b", "true")]
    specs = make_specs(tasks, ["x", "y"], k=2)
    assert [(s.task.id, s.harness, s.sample_index) for s in specs] == [
        ("a", "x", 0), ("a", "x", 1), ("a", "y", 0), ("a", "y", 1),
        ("b", "x", 0), ("b", "x", 1), ("b", "y", 0), ("b", "y", 1),
    ]  # fmt: skip
    with pytest.raises(ValueError):
        make_specs(tasks, ["x"], k=0)
    with pytest.raises(ValueError):
        make_specs(tasks, [], k=1)


def test_proxy_port_accepts_only_loopback_http():
    assert proxy_port("http://127.0.0.1:8765") == 8765
    for bad in ("", "http://127.0.0.1", "https://127.0.0.1:1", "http://10.0.0.1:80", "127.0.0.1:80"):
        with pytest.raises(ValueError):
            proxy_port(bad)


def test_progress_line_counts():
    from clawfast.rollout.progress import RunStats
    from clawfast.records import RolloutResult

    stats = RunStats(total=3)
    stats.record(RolloutResult("r1", "t", "h", status="ok"))
    stats.record(RolloutResult("r2", "t", "h", status="timeout"))
    stats.running = 1
    line = render_stats(stats).plain
    assert line.startswith("rollouts 2/3  running 1  failed 1") and "(timeout 1)" in line and "retried" not in line
    # A rollout that ran again after its node died: the line says so, and names the node once.
    lost = {"rollout_id": "r0", "status": "sandbox_error", "error": "x", "ray_node_id": "n1", "actor_died": True}
    stats.record(RolloutResult("r3", "t", "h", status="ok", info={"retries": [lost, {**lost, "rollout_id": "r00"}]}))
    assert render_stats(stats).plain.endswith("retried 2, nodes lost 1")


def peak_overlap(results) -> int:
    """Most rollouts running at once, from the start and end times each task's command printed."""
    spans = [tuple(map(float, (Path(r.info["logs"]) / "stdout").read_text().split())) for r in results]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running, peak = 0, 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


@needs_bwrap
def test_concurrency_cap_and_spec_order(env, capsys):
    registry, backend, harnesses, tmp = env
    # Each run prints its start and end time; the kept stdout shows how many overlapped.
    tasks = [task(f"t{i}", "date +%s.%N; sleep 0.4; date +%s.%N") for i in range(10)]
    worker = RolloutWorker(registry, backend, harnesses, config=RolloutConfig(logs_dir=tmp / "logs"))
    with RolloutScheduler(worker, concurrency=3) as scheduler:
        results = scheduler.run(make_specs(tasks, ["script"]), progress=True)
    assert "rollouts 10/10  running 0  failed 0" in capsys.readouterr().err  # the live line's last state
    assert [r.task_id for r in results] == [t.id for t in tasks]
    assert all((r.status, r.reward) == ("ok", 1.0) for r in results)
    assert 2 <= peak_overlap(results) <= 3
    assert scheduler.running == 0


@needs_bwrap
def test_runs_from_several_threads_share_one_cap(env):
    """Two callers at once (an asynchronous trainer's groups): each gets its own results in its own
    spec order, and at most `concurrency` rollouts of both run at any moment."""
    registry, backend, harnesses, tmp = env
    worker = RolloutWorker(registry, backend, harnesses, config=RolloutConfig(logs_dir=tmp / "logs"))
    groups = [[task(f"g{g}-{i}", "date +%s.%N; sleep 0.4; date +%s.%N") for i in range(4)] for g in range(2)]
    with RolloutScheduler(worker, concurrency=3) as scheduler:
        with concurrent.futures.ThreadPoolExecutor(2) as callers:
            runs = [callers.submit(scheduler.run, make_specs(ts, ["script"])) for ts in groups]
            results = [run.result() for run in runs]
    for ts, rs in zip(groups, results):
        assert [r.task_id for r in rs] == [t.id for t in ts]
        assert all((r.status, r.reward) == ("ok", 1.0) for r in rs)
    assert 2 <= peak_overlap([r for rs in results for r in rs]) <= 3
    assert len({r.rollout_id for rs in results for r in rs}) == 8


@needs_bwrap
def test_cancel_closes_every_rollout_and_kills_every_sandbox(env):
    registry, backend, harnesses, tmp = env
    token = uuid.uuid4().hex[:10]
    tasks = [task(f"slow{i}", f": {token}; sleep 60") for i in range(5)]
    worker = RolloutWorker(registry, backend, harnesses)
    with RolloutScheduler(worker, concurrency=3) as scheduler:
        with concurrent.futures.ThreadPoolExecutor(1) as caller:
            run = caller.submit(scheduler.run, make_specs(tasks, ["script"]))
            while scheduler.running < 3:
                time.sleep(0.05)
            time.sleep(1.0)  # the three harnesses are running now
            scheduler.cancel()
            with pytest.raises(concurrent.futures.CancelledError):
                run.result()
    assert registry.open_ids() == []
    closed = read_rollouts(tmp / "records")  # every opened rollout has its result frame
    assert len(closed) == 3
    assert all(r.status == "harness_error" and r.info["error"] == "cancelled" for r in closed)
    assert pids_with(token) == []



def test_close_from_another_thread_ends_a_running_run(env):
    # The trainer's group threads are such callers: `close` cancels their rollouts, and their `run`
    # must raise, not wait forever on a cancel sent to a loop that `close` stopped meanwhile.
    registry, backend, harnesses, tmp = env
    token = uuid.uuid4().hex[:10]
    for attempt in range(10):
        worker = RolloutWorker(registry, backend, harnesses)
        scheduler = RolloutScheduler(worker, concurrency=2)
        scheduler.start()
        with concurrent.futures.ThreadPoolExecutor(1) as caller:
            run = caller.submit(scheduler.run, make_specs([task(f"held{attempt}", f": {token}; sleep 60")],
                                                          ["script"], k=2))
            deadline = time.monotonic() + 60
            while scheduler.running < 2:
                assert time.monotonic() < deadline and not run.done(), "the two rollouts never ran"
                time.sleep(0.01)
            scheduler.close()
            with pytest.raises(concurrent.futures.CancelledError):
                run.result(timeout=30)
        with pytest.raises(RuntimeError, match="not started"):
            scheduler.submit(make_specs([task("late", "true")], ["script"])[0])
    assert registry.open_ids() == [] and pids_with(token) == []

@needs_bwrap
def test_proxy_failing_to_close_is_proxy_error(env):
    registry, backend, harnesses, tmp = env

    class CloseFails:
        def open(self, **kw):
            return registry.open(**kw)

        def close(self, rollout_id, **kw):
            raise ConnectionError("injected: proxy went away")

    worker = RolloutWorker(CloseFails(), backend, harnesses)
    with RolloutScheduler(worker) as scheduler:
        [result] = scheduler.run([RolloutSpec(task("c", "true"), "script")])
    # The harness and verifier succeeded, but the calls could not be collected: not usable as ok.
    assert result.status == "proxy_error" and result.reward == 1.0 and result.calls == []
    assert "proxy went away" in result.info["error"]
    registry.close(result.rollout_id)  # still open in the registry: the injected close never reached it


@needs_bwrap
def test_cancel_while_opening_and_starting_leaks_nothing(env):
    """Cancelled while the proxy opens rollouts and sandboxes start (in threads): what those threads
    create after the cancellation is closed all the same."""
    registry, backend, harnesses, tmp = env

    class SlowControl:
        def open(self, **kw):
            time.sleep(0.4)
            return registry.open(**kw)

        def close(self, rollout_id, **kw):
            return registry.close(rollout_id, **kw)

    class SlowStart:
        name = "bwrap"

        def create(self, spec):
            time.sleep(0.4)
            return backend.create(spec)

    for control, sandboxes, delay in ((SlowControl(), backend, 0.2), (registry, SlowStart(), 0.2)):
        worker = RolloutWorker(control, sandboxes, harnesses)
        tasks = [task(f"x{i}", "sleep 60") for i in range(4)]

        with RolloutScheduler(worker, concurrency=4) as scheduler:
            futures = [scheduler.submit(spec) for spec in make_specs(tasks, ["script"])]
            time.sleep(delay)  # the opens (or starts) are in flight in their threads
            scheduler.cancel(futures)
            assert all(f.cancelled() for f in futures)
        assert registry.open_ids() == []
        assert os.listdir(backend.base_dir) == ["view"]  # every sandbox directory is gone (the view is the backend's)
    closed = read_rollouts(tmp / "records")
    assert len(closed) == 8 and all(r.status == "harness_error" for r in closed)


def test_proxy_without_an_address_is_proxy_error_and_closed(tmp_path):
    registry = RolloutRegistry(tmp_path / "records")  # no server bound: base_url is ""
    worker = RolloutWorker(registry, backend=None, harnesses={"script": ScriptHarness(tmp_path)})
    with RolloutScheduler(worker) as scheduler:
        [result] = scheduler.run([RolloutSpec(task("u", "true"), "script")])
    assert result.status == "proxy_error" and "127.0.0.1:PORT" in result.info["error"]
    assert registry.open_ids() == [] and [r.status for r in read_rollouts(tmp_path / "records")] == ["proxy_error"]

"""Infrastructure retries in this process (`clawfast.rollout.retry` through `RolloutScheduler`): a
sandbox killed from outside under its harness is a real infrastructure failure; its spec runs again
with the same task and sample index, the failed attempt closed truthfully and its record set aside
(never read as a rollout of the records directory), the returned attempt naming it. A sandbox killed
on every attempt ends ``sandbox_error`` after the budget; a failure the policy caused (the harness's
own error) never runs again."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import uuid

import pytest

from clawfast.proxy.rollouts import RETRIED_DIR, RolloutRegistry
from clawfast.records import read_rollouts
from clawfast.rollout.retry import infra_counts
from clawfast.rollout.scheduler import RolloutScheduler
from clawfast.rollout.spec import RolloutSpec
from clawfast.rollout.worker import RolloutConfig, RolloutWorker
from clawfast.sandbox.base import SandboxError
from clawfast.sandbox.probes import pids_with
from clawfast.tasks.task import CommandVerifier, Task
from clawfast.tasks.verify import SubprocessRunner
from clawfast.train.metrics import rollout_metrics

from .script_harness import ScriptHarness

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)

CHECK_OUT = 'test "$(cat out.txt 2>/dev/null)" = hi && echo \'{"score": 1}\' || echo \'{"score": 0}\''


@contextlib.contextmanager
def killing_sandboxes(times: dict[str, int | None]):
    """While inside, SIGKILL from outside each bwrap of this process whose command line holds a marker:
    the first `times` sandboxes of each marker (None: every one). Yields the kills per marker."""
    killed = {marker: 0 for marker in times}
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        me = os.getpid()
        while not stop.is_set():
            for marker, limit in times.items():
                for pid in pids_with(marker):
                    try:
                        with open(f"/proc/{pid}/stat") as f:
                            parent = int(f.read().rsplit(")", 1)[1].split()[1])
                        with open(f"/proc/{pid}/comm") as f:
                            comm = f.read().strip()
                    except OSError:
                        continue
                    if comm != "bwrap" or parent != me or pid in seen:
                        continue
                    seen.add(pid)
                    if limit is None or killed[marker] < limit:
                        os.kill(pid, signal.SIGKILL)
                        killed[marker] += 1
            stop.wait(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join()


def _task(name: str, token: str, instruction: str = "echo hi > out.txt; sleep 1", timeout: float = 30.0) -> Task:
    return Task(id=f"{name}-{token}", instruction=f": {name}-{token}; {instruction}",
                verifier=CommandVerifier(CHECK_OUT, timeout=10), oracle=[instruction],
                tags={"category": "retry", "split": "train"}, timeout=timeout)


def _run(tmp_path, specs, *, infra_retries: int, kill: dict[str, int | None]):
    from clawfast.sandbox.bwrap import BwrapBackend

    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47321")
    backend = BwrapBackend()
    root = tmp_path / "install"
    root.mkdir(exist_ok=True)
    worker = RolloutWorker(registry, backend, {"script": ScriptHarness(root)},
                           config=RolloutConfig(sandbox_retry_delay_s=0.01))
    try:
        with killing_sandboxes(kill) as killed, RolloutScheduler(worker, concurrency=4,
                                                                 infra_retries=infra_retries) as scheduler:
            results = scheduler.run(specs)
    finally:
        backend.close()
    assert registry.open_ids() == []
    return results, killed


def test_a_sandbox_killed_once_runs_again_and_its_attempt_is_set_aside(tmp_path, private_tmp):
    token = uuid.uuid4().hex[:10]
    flaky, steady, broken = _task("flaky", token), _task("steady", token), _task(
        "broken", token, instruction="echo hi > out.txt; exit 3")
    specs = [RolloutSpec(flaky, "script", 3), RolloutSpec(steady, "script", 0), RolloutSpec(broken, "script", 1)]
    results, killed = _run(tmp_path, specs, infra_retries=2, kill={f"flaky-{token}": 1})

    assert killed == {f"flaky-{token}": 1}
    assert [(r.task_id, r.sample_index) for r in results] == [(s.task.id, s.sample_index) for s in specs]
    flaky_r, steady_r, broken_r = results
    assert (flaky_r.status, flaky_r.reward) == ("ok", 1.0), flaky_r.info
    [note] = flaky_r.info["retries"]
    assert note["status"] == "sandbox_error" and note["rollout_id"] != flaky_r.rollout_id
    assert "retries" not in steady_r.info and steady_r.status == "ok"
    # The harness's own failure is the policy's business: it is not run again.
    assert broken_r.status == "harness_error" and "retries" not in broken_r.info

    # The failed attempt: closed truthfully, kept apart from the records a trainer reads.
    on_disk = {r.rollout_id: r for r in read_rollouts(tmp_path / "records")}
    assert set(on_disk) == {r.rollout_id for r in results}
    assert on_disk[flaky_r.rollout_id].info["retries"] == [note]
    [aside] = read_rollouts(tmp_path / "records" / RETRIED_DIR)
    assert (aside.rollout_id, aside.status, aside.task_id, aside.sample_index) == (
        note["rollout_id"], "sandbox_error", flaky.id, 3)

    counts = infra_counts(results)
    assert counts == {"retries": 1, "infra_failures": 1, "retried_rollouts": 1, "nodes_lost": []}
    metrics = rollout_metrics(results)
    assert metrics["rollout/retries"] == 1.0 and metrics["rollout/infra_failures"] == 1.0
    assert pids_with(token) == []


def test_a_sandbox_that_dies_every_time_ends_sandbox_error_after_the_budget(tmp_path, private_tmp):
    token = uuid.uuid4().hex[:10]
    doomed = _task("doomed", token, instruction="echo hi > out.txt; sleep 30")
    [result], killed = _run(tmp_path, [RolloutSpec(doomed, "script", 0)], infra_retries=2,
                            kill={f"doomed-{token}": None})
    assert killed[f"doomed-{token}"] == 3  # the first attempt and two retries
    assert result.status == "sandbox_error" and result.reward == 0.0
    assert [n["status"] for n in result.info["retries"]] == ["sandbox_error"] * 2
    assert len(read_rollouts(tmp_path / "records" / RETRIED_DIR)) == 2
    assert infra_counts([result])["infra_failures"] == 3


def test_no_retry_budget_returns_the_first_failure(tmp_path, private_tmp):
    token = uuid.uuid4().hex[:10]
    flaky = _task("flaky", token)
    [result], killed = _run(tmp_path, [RolloutSpec(flaky, "script", 0)], infra_retries=0,
                            kill={f"flaky-{token}": 1})
    assert killed[f"flaky-{token}"] == 1
    assert result.status == "sandbox_error" and "retries" not in result.info
    assert not (tmp_path / "records" / RETRIED_DIR).exists()


class StartsOnSecondTry(SubprocessRunner):
    """A verifier runner whose first sandbox does not start."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, command, workspace, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise SandboxError("the verifier's sandbox did not start")
        return super().__call__(command, workspace, **kwargs)


def test_a_verifier_runner_that_failed_runs_again_and_its_note_says_why(tmp_path, private_tmp):
    from clawfast.sandbox.bwrap import BwrapBackend

    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47321")
    backend = BwrapBackend()
    root = tmp_path / "install"
    root.mkdir()
    worker = RolloutWorker(registry, backend, {"script": ScriptHarness(root)},
                           config=RolloutConfig(sandbox_retry_delay_s=0.01), verifier_runner=StartsOnSecondTry())
    try:
        with RolloutScheduler(worker, concurrency=1, infra_retries=1) as scheduler:
            [result] = scheduler.run([RolloutSpec(_task("runner", uuid.uuid4().hex[:10], "echo hi > out.txt"),
                                                  "script", 0)])
    finally:
        backend.close()
    assert (result.status, result.reward) == ("ok", 1.0)
    [note] = result.info["retries"]
    assert note["status"] == "sandbox_error"
    assert note["error"] == "the verifier's runner failed: SandboxError: the verifier's sandbox did not start"

def test_a_task_the_backend_refuses_is_not_run_again(tmp_path):
    # The local backend cannot place a Task.workdir: every attempt would be refused the same way.
    from clawfast.sandbox.local import LocalBackend

    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47321")
    root = tmp_path / "install"
    root.mkdir()
    worker = RolloutWorker(registry, LocalBackend(allow_unsafe=True), {"script": ScriptHarness(root)},
                           config=RolloutConfig(sandbox_retry_delay_s=0.01))
    task = Task(id="placed", instruction="true", verifier=CommandVerifier(CHECK_OUT, timeout=10), oracle=[],
                tags={"category": "retry", "split": "train"}, workdir="/work/placed", timeout=10)
    with RolloutScheduler(worker, concurrency=1, infra_retries=2) as scheduler:
        [result] = scheduler.run([RolloutSpec(task, "script", 0)])
    assert result.status == "sandbox_error" and result.info["sandbox_refused"]
    assert result.info["error"].startswith("sandbox refused the task: the local backend cannot put the workspace")
    assert "retries" not in result.info and not (tmp_path / "records" / RETRIED_DIR).exists()
    assert registry.open_ids() == []

def test_set_aside_refuses_an_open_rollout(tmp_path):
    registry = RolloutRegistry(tmp_path / "records")
    opened = registry.open(task_id="t")
    with pytest.raises(ValueError, match="still open"):
        registry.set_aside(opened.rollout_id)
    registry.close(opened.rollout_id, status="sandbox_error")
    moved = registry.set_aside(opened.rollout_id)
    assert moved.parent.name == RETRIED_DIR and moved.is_file()
    assert read_rollouts(tmp_path / "records") == []

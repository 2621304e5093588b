"""Verifiers in fresh bwrap sandboxes (bubblewrap is a required dependency: scripts/setup.sh)."""

from __future__ import annotations

import pytest

from clawfast.tasks import CommandVerifier, Task, check_task, clawbench_mini, run_verifier
from clawfast.tasks.sandbox_runner import SandboxRunner


@pytest.fixture(scope="module")
def runner():
    with SandboxRunner() as r:
        yield r


def _task(command: str, timeout: float = 10.0, verifier_files=None) -> Task:
    return Task(id="t", instruction="x", verifier=CommandVerifier(command, files=verifier_files or {},
                                                                  timeout=timeout),
                oracle=(), tags={"category": "test", "split": "train"}, files={"a.txt": "a\n"})


# One task per kind of check: text, python_tests (a child interpreter), json via an oracle that runs
# python3, symlink, executable + command_output. All 64 run through the sandbox in `clawfast tasks
# check --sandbox`; here a sample keeps the test short.
SAMPLE = ("files-create-0", "code-area-0", "data-csv-json-0", "shell-symlink-0", "shell-script-0")


def test_sample_tasks_are_sound_in_the_sandbox(runner):
    tasks = {t.id: t for t in clawbench_mini()}
    failures = []
    for task_id in SAMPLE:
        c = check_task(tasks[task_id], runner)
        if not c.sound:
            failures.append((task_id, c.oracle, c.nothing))
    assert failures == []


def test_verifier_sees_workspace_and_its_files_but_not_the_host_copy(runner, tmp_path):
    task = _task('test "$(cat a.txt)" = a && test -f "$VERIFIER_DIR/v.txt" && ! test -e "$1" '
                 '&& echo \'{"score": 1, "details": {"pwd": "\'"$PWD"\'"}}\'', verifier_files={"v.txt": "v"})
    ws = task.materialize(tmp_path / "ws")
    # The host path of the workspace is not visible inside (the sandbox has its own /tmp).
    task = _task(task.verifier.command.replace('"$1"', str(ws)), verifier_files={"v.txt": "v"})
    res = run_verifier(task, ws, runner)
    assert (res.status, res.score) == ("ok", 1.0), res
    assert res.details["pwd"].endswith("/workspace")


def test_sandboxed_verifier_errors(runner, tmp_path):
    ws = _task("true").materialize(tmp_path / "ws")
    crash = run_verifier(_task("echo oops >&2; exit 4"), ws, runner)
    assert (crash.status, crash.score) == ("verifier_error", 0.0) and "status 4" in crash.error
    assert "oops" in crash.stderr
    slow = run_verifier(_task("sleep 30 & sleep 30", timeout=0.5), ws, runner)
    assert (slow.status, slow.score) == ("verifier_error", 0.0) and "timed out" in slow.error
    assert slow.duration_s < 10


def test_verifier_whose_stdout_passes_the_cap_is_an_error_not_a_line_from_the_middle(runner, tmp_path):
    # The workspace file the verifier prints before its verdict ends in a valid score line at the 1 MiB
    # cut (16-byte lines: one ends exactly at 1 MiB): a runner that read the last line kept would score 1.0.
    line = '{"score": 1.0 }\n'
    assert (1 << 20) % len(line) == 0
    filler = line * ((1 << 20) // len(line) + 100)
    task = Task(id="t", instruction="x", verifier=CommandVerifier('cat out.txt; echo \'{"score": 0.0}\''),
                oracle=(), tags={"category": "test", "split": "train"}, files={"out.txt": filler})
    res = run_verifier(task, task.materialize(tmp_path / "ws"), runner)
    assert (res.status, res.score) == ("verifier_error", 0.0), res
    assert "exceeded 1048576 bytes" in res.error
    # Just under the cap, the verdict printed last is read.
    short = Task(id="t", instruction="x", verifier=CommandVerifier('cat out.txt; echo \'{"score": 0.5}\''),
                 oracle=(), tags={"category": "test", "split": "train"}, files={"out.txt": line * 1000})
    res = run_verifier(short, short.materialize(tmp_path / "ws2"), runner)
    assert (res.status, res.score) == ("ok", 0.5), res

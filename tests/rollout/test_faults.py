"""Fault injection through the real scheduler, proxy rollout registry and bubblewrap sandboxes.

200 rollouts of a trivial harness (its "CLI" is `/bin/sh -c INSTRUCTION`) with injected faults: the
harness killed by a signal, the sandbox's bwrap killed from outside, a harness past its timeout (with a
daemonised grandchild), a crashing verifier, sandbox starts that fail once or always, and a proxy that
refuses to open. Every rollout must end with the status its fault implies, and afterwards no process,
cgroup, temporary directory or open proxy rollout may be left.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import os
import signal
import shutil
import uuid
from pathlib import Path

import pytest

from clawfast.proxy.rollouts import RolloutRegistry
from clawfast.records import read_rollouts
from clawfast.rollout.scheduler import RolloutScheduler
from clawfast.rollout.spec import RolloutSpec
from clawfast.rollout.worker import RolloutConfig, RolloutWorker
from clawfast.sandbox.base import SandboxError
from clawfast.sandbox.probes import pids_with
from clawfast.tasks.task import CommandVerifier, Task

from .script_harness import ScriptHarness

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)

CHECK_OUT = 'test "$(cat out.txt 2>/dev/null)" = hi && echo \'{"score": 1}\' || echo \'{"score": 0}\''

# kind -> (instruction, verifier command, task timeout, expected status, expected reward)
KINDS = {
    "ok": ("echo hi > out.txt", CHECK_OUT, 20.0, "ok", 1.0),
    "harnesskill": ("echo hi > out.txt; kill -9 $$", CHECK_OUT, 20.0, "harness_error", 1.0),
    # A daemonised grandchild in a new session: it must die with the sandbox too.
    "timeout": ("(setsid sh -c ': daemon-{token}; sleep 300' &); sleep 300", CHECK_OUT, 1.0, "timeout", 0.0),
    "sandboxkill": ("echo hi > out.txt; sleep 300", CHECK_OUT, 60.0, "sandbox_error", 0.0),
    "verifiercrash": ("echo hi > out.txt", "echo partial; kill -9 $$", 20.0, "verifier_error", 0.0),
    "flakystart": ("echo hi > out.txt", CHECK_OUT, 20.0, "ok", 1.0),
    "deadstart": ("echo hi > out.txt", CHECK_OUT, 20.0, "sandbox_error", 0.0),
    "proxyfail": ("echo hi > out.txt", CHECK_OUT, 20.0, "proxy_error", 0.0),
}


class FaultyBackend:
    """The real bwrap backend, except that `create` raises SandboxError for chosen rollouts: always
    (deadstart) or on the first try only (flakystart)."""

    def __init__(self, real, registry: RolloutRegistry) -> None:
        self.real, self.registry = real, registry
        self.name = real.name
        self.failed_once: set[str] = set()
        self.attempts: dict[str, int] = {}

    def create(self, spec):
        task_id = self.registry.get(spec.name).task_id
        self.attempts[task_id] = self.attempts.get(task_id, 0) + 1
        if task_id.startswith("deadstart"):
            raise SandboxError("injected: sandbox never starts")
        if task_id.startswith("flakystart") and task_id not in self.failed_once:
            self.failed_once.add(task_id)
            raise SandboxError("injected: first start fails")
        return self.real.create(spec)


class FaultyControl:
    """The real registry, except that opening a `proxyfail` task raises (the proxy is down)."""

    def __init__(self, registry: RolloutRegistry) -> None:
        self.registry = registry

    def open(self, *, task_id, harness, sample_index, sampling=None):
        if task_id.startswith("proxyfail"):
            raise ConnectionError("injected: proxy unreachable")
        return self.registry.open(task_id=task_id, harness=harness, sample_index=sample_index, sampling=sampling)

    def close(self, rollout_id, *, reward, status, info):
        return self.registry.close(rollout_id, reward=reward, status=status, info=info)


async def _kill_sandboxes(token: str, stop: asyncio.Event, killed: set[int]) -> None:
    """Kill (SIGKILL) every bwrap launched by this process for a `sandboxkill` task, from outside."""
    me = os.getpid()
    while not stop.is_set():
        for pid in pids_with(f"sandboxkill-{token}"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if comm == "bwrap" and int(fields[1]) == me and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        await asyncio.sleep(0.02)


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return children


def _cgroups_of(pid: int) -> list[str]:
    """Sandbox groups of `pid` in any hierarchy (v1 controllers, a unified v2 tree)."""
    return [str(p) for p in Path("/sys/fs/cgroup").rglob(f"clawfast-{pid}-*")]


def _mounts_of(pid: int) -> list[str]:
    """The quota filesystems this process's sandboxes mounted on the host (other processes' are not
    this test's business)."""
    points = [line.split(" ", 5)[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if f"clawfast-sandbox-{pid}-" in p]


def test_200_rollouts_with_faults_end_truthfully_and_leave_nothing(tmp_path, private_tmp):
    from clawfast.sandbox.bwrap import BwrapBackend

    token = uuid.uuid4().hex[:12]

    tasks, expected = [], {}
    kinds = list(KINDS)
    for i in range(200):
        kind = kinds[i % len(kinds)]
        instruction, verifier, timeout, status, reward = KINDS[kind]
        task_id = f"{kind}-{token}-{i}"
        # The token in the instruction lets the test find every process a rollout started.
        tasks.append(Task(
            id=task_id, instruction=f": {kind}-{token}; {instruction.format(token=token)}",
            verifier=CommandVerifier(verifier, timeout=10), oracle=[instruction],
            tags={"category": "faults", "split": "train"}, timeout=timeout,
        ))  # fmt: skip
        expected[task_id] = (kind, status, reward)

    install_root = tmp_path / "install"
    install_root.mkdir()
    # Nothing listens there: the trivial harness never calls the proxy. (A port above 1023, since
    # the sandbox's forwarder has no capability to bind a privileged one.)
    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47321")
    real_backend = BwrapBackend()
    backend = FaultyBackend(real_backend, registry)
    worker = RolloutWorker(
        FaultyControl(registry), backend, {"script": ScriptHarness(install_root)},
        config=RolloutConfig(sandbox_retry_delay_s=0.01, logs_dir=tmp_path / "logs"),
    )  # fmt: skip
    specs = [RolloutSpec(t, "script", 0) for t in tasks]

    async def kill_while(run):
        stop, killed = asyncio.Event(), set()
        killer = asyncio.create_task(_kill_sandboxes(token, stop, killed))
        try:
            return await asyncio.to_thread(run), killed
        finally:
            stop.set()
            await killer

    try:
        with RolloutScheduler(worker, concurrency=12) as scheduler:
            results, killed = asyncio.run(kill_while(lambda: scheduler.run(specs)))
    finally:
        real_backend.close()

    assert len(results) == 200
    wrong = []
    for spec, result in zip(specs, results):
        kind, status, reward = expected[spec.task.id]
        assert result.task_id == spec.task.id
        if (result.status, result.reward) != (status, reward):
            wrong.append((spec.task.id, result.status, result.reward, result.info.get("error")))
    assert not wrong, wrong[:5]
    assert len(killed) == 25
    assert scheduler.running == 0
    assert Counter(r.status for r in results) == {"ok": 50, "harness_error": 25, "timeout": 25, "sandbox_error": 50,
                                                  "verifier_error": 25, "proxy_error": 25}
    for spec, result in zip(specs, results):
        kind = expected[spec.task.id][0]
        if kind == "flakystart":
            assert result.info["sandbox_attempts"] == 2
        if kind == "deadstart":
            assert result.info["sandbox_attempts"] == 3 and backend.attempts[spec.task.id] == 3
        if kind == "verifiercrash":
            assert result.info["verifier"]["status"] == "verifier_error"
        if kind in ("ok", "harnesskill", "timeout"):
            # The harness saw its key in HOME, and its log was kept with the rollout.
            log = Path(result.info["logs"]) / "home" / ".script" / "run.log"
            assert log.read_text().startswith("cf-")

    # Nothing left: processes, proxy rollouts, cgroups, mounts, temporary files.
    assert pids_with(token) == []
    assert _children_of(os.getpid()) == []
    assert registry.open_ids() == []
    on_disk = read_rollouts(tmp_path / "records")  # raises if any log lacks its result frame
    assert len(on_disk) == 175 and sorted(r.status for r in on_disk) == sorted(
        r.status for r in results if r.status != "proxy_error"
    )
    assert _cgroups_of(os.getpid()) == []
    assert _mounts_of(os.getpid()) == []
    assert list(private_tmp.iterdir()) == []  # sandbox dirs and verifier copies all removed


def test_a_harness_run_into_a_sandbox_limit_says_which(tmp_path):
    """The memory limit kills the harness (its status says why, not just 137), or one of its commands
    that the harness survives (the rollout is ok, and its info still names the limit)."""
    from clawfast.sandbox import Limits
    from clawfast.sandbox.bwrap import BwrapBackend

    hog = "python3 -c 'b = bytearray(256 << 20)'"
    tasks = [Task(id=name, instruction=instruction, verifier=CommandVerifier(CHECK_OUT, timeout=10), oracle=[],
                  tags={"category": "limits", "split": "train"}, timeout=60)
             for name, instruction in (("killed", f"echo hi > out.txt; exec {hog}"),
                                       ("survived", f"{hog}; echo hi > out.txt"))]
    install_root = tmp_path / "install"
    install_root.mkdir()
    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47321")
    backend = BwrapBackend()
    worker = RolloutWorker(registry, backend, {"script": ScriptHarness(install_root)},
                           config=RolloutConfig(limits=Limits(memory_bytes=64 << 20)))
    try:
        with RolloutScheduler(worker, concurrency=2) as scheduler:
            killed, survived = scheduler.run([RolloutSpec(t, "script", 0) for t in tasks])
    finally:
        backend.close()
    assert (killed.status, killed.info["exit_code"], killed.info["limit"]) == ("harness_error", 137, "memory")
    assert killed.info["error"] == ("harness exited with status 137: it was killed by the sandbox's memory "
                                    "limit (64 MiB)")
    assert (survived.status, survived.reward, survived.info["limit"]) == ("ok", 1.0, "memory")


class _BrokenReader(ScriptHarness):
    name = "script-broken-reader"

    def exit_reason(self, stdout: str) -> str | None:
        raise KeyError("error")


def test_a_failed_harness_run_carries_its_own_account(tmp_path):
    """After a non-zero exit the rollout's error ends with what the harness reported in its stdout
    (`Harness.exit_reason`, cut at EXIT_REASON_CHARS); a reader that fails, or a stdout cut at the
    output limit, is said instead, and the rollout is kept either way."""
    from clawfast.rollout.worker import EXIT_REASON_CHARS
    from clawfast.sandbox import Limits
    from clawfast.sandbox.bwrap import BwrapBackend

    long = "x" * (EXIT_REASON_CHARS + 500)
    runs = {
        "reported": ("script", f"""echo '{{"type": "progress"}}'; echo '{{"error": "{long}"}}'; exit 3"""),
        "silent": ("script", "exit 4"),
        "unread": ("script-broken-reader", "exit 5"),
        "cut": ("script", """head -c 8192 /dev/zero | tr '\\0' x; echo '{"error": "lost"}'; exit 6"""),
    }
    tasks = [Task(id=name, instruction=instruction, verifier=CommandVerifier(CHECK_OUT, timeout=10), oracle=[],
                  tags={"category": "exits", "split": "train"}, timeout=60)
             for name, (_, instruction) in runs.items()]
    install_root = tmp_path / "install"
    install_root.mkdir()
    registry = RolloutRegistry(tmp_path / "records", base_url="http://127.0.0.1:47321")
    backend = BwrapBackend()
    harnesses = {"script": ScriptHarness(install_root), "script-broken-reader": _BrokenReader(install_root)}
    worker = RolloutWorker(registry, backend, harnesses, config=RolloutConfig(limits=Limits(max_output_bytes=4096)))
    try:
        with RolloutScheduler(worker, concurrency=2) as scheduler:
            results = scheduler.run([RolloutSpec(t, runs[t.id][0], 0) for t in tasks])
    finally:
        backend.close()
    errors = {r.task_id: r.info["error"] for r in results}
    assert all(r.status == "harness_error" for r in results), errors
    assert errors == {
        "reported": f"harness exited with status 3; it reported {long[:EXIT_REASON_CHARS]}",
        "silent": "harness exited with status 4",
        "unread": "harness exited with status 5; _BrokenReader.exit_reason failed on its stdout: KeyError: 'error'",
        "cut": "harness exited with status 6; its stdout passed the sandbox's output limit, so its own account "
               "of the exit was not read",
    }

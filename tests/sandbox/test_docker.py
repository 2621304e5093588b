"""The docker backend's contract, on a local engine and the image named by CLAWFAST_TEST_DOCKER_IMAGE
(default clawfast-sandbox:bookworm, which scripts/docker_engine.sh builds for the README's test
command); nothing is pulled. A missing engine or image FAILS every test here: the docker backend is
required: nothing skips them."""

from __future__ import annotations

import os

import pytest

from clawfast.sandbox import SandboxError, SandboxSpec

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("CLAWFAST_TEST_DOCKER_IMAGE") or "clawfast-sandbox:bookworm"


def docker_backend():
    """A DockerBackend on IMAGE; the test fails without an engine or the image."""
    from clawfast.sandbox.docker_backend import DockerBackend, connect

    unavailable = pytest.fail
    try:
        client = connect()
    except SandboxError as exc:
        unavailable(f"docker backend not tested: {exc}")
    try:
        client.images.get(IMAGE)
    except Exception as exc:
        unavailable(f"docker backend not tested: image {IMAGE} is not present locally ({exc})")
    finally:
        client.close()
    return DockerBackend(image=IMAGE)


@pytest.fixture
def backend():
    b = docker_backend()
    yield b
    b.close()
    assert not os.path.exists(b.base_dir)


def test_run_and_read_back(backend):
    with backend.create(SandboxSpec(files={"a.txt": "A"})) as sb:
        r = sb.run(["sh", "-c", 'cat a.txt; pwd; echo "$HOME"; echo x > b.txt; echo e >&2; exit 3'])
        assert r.exit_code == 3 and r.stdout == b"A/run/ws\n/run/home\n" and r.stderr == b"e\n"
        assert sb.read_files() == {"a.txt": b"A", "b.txt": b"x\n"}
        assert sb.run(["cat"], stdin=b"in").stdout == b"in"


def test_read_only_root_and_no_network(backend):
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(["sh", "-c", "echo x > /etc/probe || echo ro; cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '"])
        assert r.stdout == b"ro\nlo\n"


def test_timeout_kills_and_sandbox_stays_usable(backend):
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(["sh", "-c", "sleep 300 & exec sleep 300"], timeout=1)
        assert r.timed_out and r.exit_code is None
        assert sb.run(["echo", "ok"]).stdout == b"ok\n"


def test_allowed_port_reaches_host_loopback(backend, echo_server):
    with backend.create(SandboxSpec()) as sb:
        check = sb.run(["sh", "-c", "command -v socat && command -v bash"])
        if check.exit_code != 0:
            pytest.fail(f"image {IMAGE} lacks socat (needed for allow_ports) or bash (used by this test)")
    with backend.create(SandboxSpec(allow_ports=(echo_server.port,))) as sb:
        code = (
            "exec 3<>/dev/tcp/127.0.0.1/%d && printf ping >&3 && cat <&3" % echo_server.port
        )
        r = sb.run(["bash", "-c", code])
        assert r.stdout == b"echo:ping"
        r = sb.run(["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/1 || echo refused"])
        assert b"refused" in r.stdout


@pytest.mark.parametrize("workdir", ["/root/.openclaw/workspace", "/srv/task", "/tmp/ws"])
def test_workdir_places_the_workspace(backend, workdir):
    with backend.create(SandboxSpec(files={"a.txt": "A"}, workdir=workdir)) as sb:
        assert sb.workdir == workdir
        r = sb.run(["sh", "-c", f'pwd; cat {workdir}/a.txt; echo x > b.txt'])
        assert (r.exit_code, r.stdout) == (0, f"{workdir}\nA".encode())
        assert sb.read_files() == {"a.txt": b"A", "b.txt": b"x\n"}


def test_a_reward_script_verifies_at_its_mount_dir(backend, tmp_path):
    from clawfast.tasks import RewardScriptVerifier, Task, run_verifier
    from clawfast.tasks.sandbox_runner import SandboxRunner

    reward = tmp_path / "reward"
    reward.mkdir()
    (reward / "reward.sh").write_text('test "$PWD" = /root/.openclaw/workspace && test -f reward/reward.sh '
                                      '&& test "$(cat out.txt)" = ok && echo 1 || echo 0\n')
    task = Task(id="t", instruction="x", verifier=RewardScriptVerifier(reward), oracle=(),
                tags={"category": "c", "split": "eval"}, workdir="/root/.openclaw/workspace")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "out.txt").write_text("ok")
    v = run_verifier(task, ws, SandboxRunner(backend))
    assert (v.status, v.score) == ("ok", 1.0), v


def test_unprivileged_user_and_limits(backend):
    from clawfast.sandbox import Limits
    from clawfast.sandbox.base import SANDBOX_UID

    limits = Limits(memory_bytes=128 << 20, cpus=0.5, disk_bytes=8 << 20)
    with backend.create(SandboxSpec(limits=limits)) as sb:
        assert {"memory", "cpu", "processes", "user"} <= set(sb.enforced)
        r = sb.run(["sh", "-c", "id -u; id -un; grep CapEff /proc/self/status; cat /etc/shadow || echo no-shadow"])
        expected_uid = SANDBOX_UID if os.geteuid() == 0 else os.getuid()
        assert r.stdout.decode().splitlines() == [str(expected_uid), "agent", "CapEff:\t0000000000000000", "no-shadow"]
        if os.geteuid() == 0:
            assert "disk" in sb.enforced
            for target in ("big", "/tmp/big"):
                r = sb.run(["sh", "-c", f"dd if=/dev/zero of={target} bs=1M count=32 2>&1"])
                assert r.exit_code != 0 and b"No space left on device" in r.stdout, r
            assert sb.run(["echo", "ok"]).stdout == b"ok\n"


def test_without_root_the_missing_disk_quota_is_logged(monkeypatch, caplog):
    """A sized tmpfs needs root: a backend made without it says that disk_bytes goes unenforced
    (and its sandboxes leave "disk" out of `enforced`), never silently."""
    import logging

    monkeypatch.setattr("clawfast.sandbox.docker_backend.os.geteuid", lambda: 1000)
    with caplog.at_level(logging.WARNING, logger="clawfast.sandbox"):
        docker_backend().close()
    assert "clawfast docker backend: disk quota NOT enforced" in caplog.text

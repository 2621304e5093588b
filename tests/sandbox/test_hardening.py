"""The bwrap backend against what a sandbox (or a careless caller) could do to the host or to other
sandboxes through the seams between host and sandbox: the kernel keyring, the host's writes into a
workspace, runs in parallel, hidden paths, timeouts, the launcher's environment, reads back, a close
during a start, files the sandbox closed to its owner, relative directories, odd specs. Real bwrap."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from clawfast.sandbox import Limits, SandboxError, SandboxPool, SandboxSpec
from clawfast.sandbox.bwrap import BwrapBackend
from clawfast.sandbox.bwrap_supervise import Capture
from clawfast.sandbox.local import LocalBackend
from clawfast.sandbox.seccomp import program
from clawfast.sandbox.spec import NAME_LABEL_BYTES, name_label

PY = "/usr/bin/python3"
MiB = 1 << 20

KEYS = r"""
import ctypes, os, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
add_key, request_key, keyctl = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[platform.machine()]
USER_KEYRING = -4
if sys.argv[1] == "put":
    kid = libc.syscall(add_key, b"user", b"clawfast-test", b"answer=42", 9, USER_KEYRING)
    print("put", kid, os.strerror(ctypes.get_errno()) if kid < 0 else "")
else:
    kid = libc.syscall(request_key, b"user", b"clawfast-test", None, USER_KEYRING)
    buf = ctypes.create_string_buffer(64)
    n = libc.syscall(keyctl, 11, kid, buf, 64)  # KEYCTL_READ
    print("get", kid, buf.raw[:max(n, 0)])
    if kid >= 0:
        libc.syscall(keyctl, 21, kid)  # KEYCTL_INVALIDATE: leave the host as it was
"""


def test_sandboxes_share_no_kernel_keyring(backend):
    """Every sandbox runs as the same uid, whose user keyring outlives it: add_key, request_key and
    keyctl fail inside, so one rollout cannot leave a key for the next."""
    assert program() is not None, "this host's architecture has no filter"
    with backend.create(SandboxSpec(name="rollout-a")) as a:
        put = a.run([PY, "-c", KEYS, "put"])
        assert "keyring" in a.enforced
    with backend.create(SandboxSpec(name="rollout-b")) as b:
        get = b.run([PY, "-c", KEYS, "get"])
    assert put.stdout.decode().split()[:2] == ["put", "-1"], put
    assert "Operation not permitted" in put.stdout.decode(), put
    assert get.stdout == b"get -1 b''\n", get


def test_seccomp_program_blocks_x32_and_unknown_archs():
    """The filter's shape: on x86_64 it judges i386 by its own numbers and refuses x32."""
    code = program("x86_64")
    assert len(code) % 8 == 0
    assert program("sparc64") is None
    # keyctl's number on x86_64 (250), i386 (288) and the x32 bit all appear as jump constants.
    consts = {int.from_bytes(code[i + 4:i + 8], sys.byteorder) for i in range(0, len(code), 8)}
    assert {250, 288, 0x40000000, 0xC000003E, 0x40000003} <= consts


def test_write_files_never_follows_a_swapped_link(backend, tmp_path):
    """A command swaps a workspace directory and a link to a host directory without pause while the
    host writes into that directory: the host never writes outside the workspace."""
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    swap = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "os.makedirs('tests', exist_ok=True)\n"
        f"os.symlink({str(outside)!r}, 'tlink')\n"
        "while True:\n"
        "    libc.renameat2(-100, b'tests', -100, b'tlink', 2)  # RENAME_EXCHANGE\n"
    )
    with backend.create(SandboxSpec()) as sb:
        runner = threading.Thread(target=sb.run, args=([PY, "-c", swap],), kwargs={"timeout": 5})
        runner.start()
        time.sleep(0.5)
        writes = refused = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not os.listdir(outside):
            try:
                sb.write_files({"tests/test_hidden.py": "written by host"})
                writes += 1
            except (ValueError, FileNotFoundError):
                refused += 1
        runner.join()
    assert os.listdir(outside) == [], (writes, refused)
    assert refused > 0  # the swap really ran


def test_write_files_over_a_fifo_is_refused_at_once(backend):
    with backend.create(SandboxSpec()) as sb:
        assert sb.run(["sh", "-c", "mkdir tests && mkfifo tests/t.py"]).exit_code == 0
        outcome = []

        def write():
            try:
                sb.write_files({"tests/t.py": "x"})
                outcome.append("written")
            except ValueError as exc:
                outcome.append(str(exc))

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        writer.join(5)
        if writer.is_alive():  # unblock it (old behaviour) so that the sandbox can close
            fd = os.open(os.path.join(sb.host_workdir, "tests/t.py"), os.O_RDONLY | os.O_NONBLOCK)
            writer.join(2)
            os.close(fd)
            pytest.fail("write_files blocked on a FIFO")
        # A FIFO someone reads from opens: fstat refuses it.
        reader = os.open(os.path.join(sb.host_workdir, "tests/t.py"), os.O_RDONLY | os.O_NONBLOCK)
        try:
            with pytest.raises(ValueError, match="not a regular file"):
                sb.write_files({"tests/t.py": "x"})
        finally:
            os.close(reader)
        sb.write_files({"tests/ok.py": "fine"})
        assert sb.read_file("tests/ok.py") == b"fine"
    assert outcome == ["cannot write 'tests/t.py': it exists and is not a regular file"]


def test_parallel_runs_in_one_sandbox_never_kill_each_other(backend, monkeypatch):
    """A run that ends while it is the only one registered must not kill, through the sandbox's
    cgroup, a run another thread started a moment later. (The end and the start of each run are
    slowed down, so that a run often ends alone and the other thread's next run starts meanwhile.)"""
    import clawfast.sandbox.bwrap as bwrap

    real_wait, real_hand_over = bwrap.wait_namespace_gone, bwrap.HostDir.hand_over

    def slow_wait(*args):
        time.sleep(0.02)
        return real_wait(*args)

    def slow_hand_over(self):
        time.sleep(0.01)
        return real_hand_over(self)

    monkeypatch.setattr(bwrap, "wait_namespace_gone", slow_wait)
    monkeypatch.setattr(bwrap.HostDir, "hand_over", slow_hand_over)
    results: dict[str, list] = {"a": [], "b": []}
    with backend.create(SandboxSpec()) as sb:

        def loop(label, cmd, n):
            for _ in range(n):
                try:
                    results[label].append(sb.run(cmd, timeout=20).exit_code)
                except SandboxError as exc:
                    results[label].append(str(exc)[:80])

        threads = [threading.Thread(target=loop, args=("a", ["true"], 60)),
                   threading.Thread(target=loop, args=("b", ["sh", "-c", "sleep 0.05; echo ok"], 30))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == {"a": [0] * 60, "b": [0] * 30}


def test_hide_paths_cover_files_links_and_bind_sources(leak_check, outside_dir):
    """A hidden file, a directory named through a link, and a directory inside a ro_binds source
    (shown at the bind's target) are all covered; a path that resolves to / is refused."""
    tmp_path = outside_dir
    system = tmp_path / "sys"
    (system / "real" / "secrets").mkdir(parents=True)
    (system / "real" / "secrets" / "key").write_text("s3cret")
    (system / "real" / "note").write_text("private")
    (system / "real" / "kept").write_text("public")
    (system / "link").symlink_to("real")
    src = tmp_path / "harness"
    (src / "tasks").mkdir(parents=True)
    (src / "tasks" / "verifier.txt").write_text("answer")
    (src / "run.sh").write_text("echo harness")
    paths = ("/usr", "/bin", "/lib", "/lib64", "/etc", str(system / "real"), str(system / "link"))
    with BwrapBackend(system_paths=paths, hide_paths=[str(system / "real" / "note")]) as b:
        spec = SandboxSpec(
            ro_binds={str(src): "/opt/harness"},
            hide_paths=(str(system / "link" / "secrets"), str(src / "tasks")),
        )
        with b.create(spec) as sb:
            r = sb.run(["sh", "-c", f"cd {system}; cat link/kept; ls -A link/secrets real/secrets; cat real/note;"
                        " ls -A /opt/harness /opt/harness/tasks"])
        with pytest.raises(ValueError, match="resolves to /"):
            (tmp_path / "rootlink").symlink_to("/")
            b.create(SandboxSpec(hide_paths=(str(tmp_path / "rootlink"),)))
    out = r.stdout.decode()
    assert "public" in out and "s3cret" not in out and "private" not in out and "answer" not in out, r
    assert "verifier.txt" not in out and "run.sh" in out, r
    assert "Permission denied" in r.stderr.decode(), r  # the note is an unreadable empty file
    leak_check(base_dirs=[b.base_dir])


def test_timeouts_beyond_poll_range_work(leak_check):
    """30 days and inf are valid timeouts: poll() waits are capped, nothing overflows."""
    for use_cgroup in (True, False):
        with BwrapBackend(use_cgroup=use_cgroup) as b, b.create(SandboxSpec()) as sb:
            assert sb.run(["sh", "-c", "sleep 0.1; echo hi"], timeout=30 * 24 * 3600).stdout == b"hi\n"
            assert sb.run(["true"], timeout=float("inf")).exit_code == 0
        leak_check(base_dirs=[b.base_dir])
    with LocalBackend(allow_unsafe=True) as b, b.create(SandboxSpec()) as sb:
        assert sb.run(["sh", "-c", "echo hi"], timeout=float("inf")).stdout == b"hi\n"


def test_an_error_while_a_run_is_supervised_kills_it(leak_check, marker, host, monkeypatch):
    """Whatever raises while a run is watched, its processes do not outlive it (no cgroup: only the
    namespace's init can end them)."""

    def broken(self, proc, deadline):
        time.sleep(0.3)
        raise RuntimeError("supervision failed")

    with BwrapBackend(use_cgroup=False) as b, b.create(SandboxSpec()) as sb:
        monkeypatch.setattr(Capture, "pump_until_exit", broken)
        with pytest.raises(RuntimeError, match="supervision failed"):
            sb.run(["sh", "-c", f"sleep 1000 # {marker}"])
        assert host.pids_with(marker) == []
    leak_check(base_dirs=[b.base_dir], markers=[marker])


def test_command_environment_never_reaches_the_launcher(backend):
    """LD_PRELOAD naming a sandbox path is the command's business: the host-side launcher (sh, bwrap,
    setpriv; root processes) runs with a fixed environment, the command gets its own."""
    with backend.create(SandboxSpec(env={"FROM_SPEC": "1"})) as sb:
        r = sb.run(["sh", "-c", "echo $LD_PRELOAD $FROM_SPEC $HOME; env | grep -c ^SUDO_ || true"],
                   env={"LD_PRELOAD": "/run/ws/missing.so"})
    assert r.exit_code == 0, r
    assert r.stdout.splitlines()[0] == b"/run/ws/missing.so 1 /run/home", r


def test_reads_back_are_bounded_by_size_not_by_what_the_sandbox_paid(backend):
    with backend.create(SandboxSpec(limits=Limits(disk_bytes=16 * MiB))) as sb:
        assert sb.run(["sh", "-c", "truncate -s 100M sparse; head -c 600000 /dev/zero > a; cp a b"]).exit_code == 0
        with pytest.raises(ValueError, match="sparse"):
            sb.read_files(["sparse"], max_total_bytes=MiB)
        with pytest.raises(ValueError, match="sparse"):
            sb.read_file("sparse", max_bytes=MiB)
        with pytest.raises(ValueError, match="'b'"):
            sb.read_files(["a", "b"], max_total_bytes=MiB)  # each fits, not both
        assert len(sb.read_files(["a", "missing"], max_total_bytes=MiB)["a"]) == 600000


def test_backend_close_during_a_start_leaves_nothing(leak_check, monkeypatch):
    """backend.close() (a pool shutting down) while create() is half way: close waits for the start,
    so that what the start made (directory, quota mount, cgroup) is removed with it."""
    import clawfast.sandbox.bwrap as bwrap

    made, go_on = threading.Event(), threading.Event()
    real = bwrap.HostDir

    def slow_hostdir(*args, **kwargs):
        hostdir = real(*args, **kwargs)
        made.set()
        go_on.wait(5)
        return hostdir

    monkeypatch.setattr(bwrap, "HostDir", slow_hostdir)
    b = BwrapBackend()
    outcome = []

    def create():
        try:
            outcome.append(b.create(SandboxSpec(limits=Limits(disk_bytes=16 * MiB))))
        except SandboxError as exc:
            outcome.append(exc)

    creator = threading.Thread(target=create)
    creator.start()
    assert made.wait(10)
    closer = threading.Thread(target=b.close)
    closer.start()
    time.sleep(0.2)
    go_on.set()
    closer.join(30)
    creator.join(30)
    assert len(outcome) == 1 and (isinstance(outcome[0], SandboxError) or outcome[0].closed), outcome
    leak_check(base_dirs=[b.base_dir])


def test_pool_cancelled_start_keeps_its_slot_until_destroyed():
    """max_concurrency=1: a task cancelled while its sandbox starts keeps the slot until that sandbox
    is destroyed, so no second sandbox exists beside it."""

    async def main():
        pool = SandboxPool("bwrap", max_concurrency=1)
        try:
            async def first():
                async with pool.asandbox(SandboxSpec(files={f"f{i}": "x" for i in range(3000)})):
                    await asyncio.sleep(10)

            task = asyncio.create_task(first())
            await asyncio.sleep(0.05)
            task.cancel()
            async with pool.asandbox(SandboxSpec()):
                return len(pool.backend._live)
        finally:
            await pool.__aexit__(None, None, None)

    assert asyncio.run(main()) == 1


def test_sandbox_dirs_closed_by_the_sandbox_are_removed_without_root(outside_dir):
    """Not root, a directory the sandbox made unreadable (chmod 000) is still removed, by close() and
    by the sweep of a dead owner's directories. As root the code runs as uid 1000 (setpriv); otherwise
    it runs as this unprivileged user."""
    base = outside_dir / "base"
    base.mkdir()
    unprivileged = []
    if os.geteuid() == 0:
        os.chown(base, 1000, 1000)
        unprivileged = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    code = (
        "import os, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from clawfast.sandbox.hostdir import remove_tree, sweep_stale_dirs\n"
        "base = sys.argv[1]\n"
        "for top in ('own', 'clawfast-sandbox-999999999-x'):\n"
        "    os.makedirs(f'{base}/{top}/d/e/f'); open(f'{base}/{top}/d/e/f/g', 'w').close()\n"
        "    os.chmod(f'{base}/{top}/d/e', 0o500); os.chmod(f'{base}/{top}/d', 0)\n"
        "remove_tree(f'{base}/own')\n"
        "sweep_stale_dirs(base, 'clawfast-sandbox-')\n"
        "print(sorted(os.listdir(base)))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(unprivileged + [sys.executable, "-c", code, str(base), repo], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[]\n"


def test_relative_base_dir_survives_a_chdir(tmp_path, leak_check, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    b = BwrapBackend(base_dir="rel")
    try:
        assert os.path.isabs(b.base_dir)
        with b.create(SandboxSpec(files={"a": "1"}, limits=Limits(disk_bytes=16 * MiB))) as sb:
            monkeypatch.chdir("/")
            assert sb.run(["cat", "a"]).stdout == b"1"
    finally:
        b.close()
    assert os.listdir(tmp_path / "rel") == []
    leak_check(base_dirs=[b.base_dir])


def test_ro_binds_target_missing_in_a_system_dir_is_refused(backend, tmp_path):
    """A target bwrap would have to make inside a read-only system directory: ValueError from create,
    not a SandboxError each start (which a pool retries); one under /opt, or in the workdir's rebuilt
    directory, is fine."""
    tmp_path.chmod(0o755)
    with pytest.raises(ValueError, match="ro_binds"):
        backend.create(SandboxSpec(ro_binds={str(tmp_path): "/usr/clawfast-missing/harness"}))
    assert os.listdir(backend.base_dir) == ["view"]
    with backend.create(SandboxSpec(ro_binds={str(tmp_path): "/opt/harness"})) as sb:
        assert sb.run(["ls", "/opt/harness"]).exit_code == 0
    spec = SandboxSpec(workdir="/usr/clawfast-missing/app", ro_binds={str(tmp_path): "/usr/clawfast-missing/harness"})
    with backend.create(spec) as sb:
        assert sb.run(["ls", "/usr/clawfast-missing/harness"]).exit_code == 0


def test_long_names_fit_directory_and_socket_paths(backend, echo_server):
    """SandboxSpec.name is only a label: a 300-character one, or an 80-character one with a port
    (its socket path), starts like any other."""
    for name, ports in (("r" * 300, ()), ("r" * 80, (echo_server.port,)), ("é" * 100, ())):
        with backend.create(SandboxSpec(name=name, allow_ports=ports)) as sb:
            assert sb.run(["true"]).exit_code == 0


def test_the_longest_socket_path_fits_a_unix_socket():
    """What NAME_LABEL_BYTES leaves room for, made as the bwrap backend makes it: the default base
    directory of a 7-digit pid, a sandbox directory named by the longest label, the highest port."""
    base = tempfile.mkdtemp(prefix="clawfast-sandbox-9999999-")
    try:
        sandbox = tempfile.mkdtemp(prefix=name_label("é" * 100) + "-", dir=base)
        path = os.path.join(sandbox, "proxy", "65535.sock")
        assert len(name_label("é" * 100).encode()) == NAME_LABEL_BYTES
        assert len(path.encode()) <= 107, path
    finally:
        shutil.rmtree(base)


def test_max_file_bytes_does_not_bound_output(backend):
    """stdout and stderr are pipes: RLIMIT_FSIZE does not apply to them, max_output_bytes does."""
    limits = Limits(max_file_bytes=MiB, max_output_bytes=8 * MiB)
    with backend.create(SandboxSpec(limits=limits)) as sb:
        r = sb.run(["sh", "-c", "head -c 3000000 /dev/zero"])
        assert (r.exit_code, len(r.stdout), r.limit) == (0, 3000000, None)
        r = sb.run(["sh", "-c", "head -c 3000000 /dev/zero > f"])
        assert r.limit == "file size"


def test_the_commands_environment_is_on_no_long_lived_command_line(backend):
    # Host users can read every process's command line: a secret in the environment must not sit on
    # bwrap's (which lives as long as the run) or on any shell's.
    with backend.create(SandboxSpec(env={"ROLLOUT_KEY": "sk-never-on-a-command-line"})) as sb:
        result = sb.run(["sh", "-c", "printf %s \"$ROLLOUT_KEY\"; for f in /proc/[0-9]*/cmdline; do "
                                     "tr '\\0' ' ' < $f; echo; done >&2; ls /proc/self/fd >&2"], timeout=30)
        assert result.exit_code == 0 and result.stdout == b"sk-never-on-a-command-line"
        assert b"sk-never" not in result.stderr  # every process the sandbox shows, bwrap's init included
        assert result.stderr.split()[-4:] == [b"0", b"1", b"2", b"3"]  # the env file's fd is closed

"""The bwrap backend against the real kernel: isolation (files, network, processes), limits, faults,
and cleanup. bubblewrap and socat are required (Debian: apt-get install bubblewrap socat)."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawfast.sandbox import Limits, SandboxError, SandboxSpec
from clawfast.sandbox.bwrap import BwrapBackend

PY = "/usr/bin/python3"  # the host's system Python, visible in the minimal root (/usr)


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def connect_code(host: str, port: int) -> str:
    return (
        "import socket, sys\n"
        "try:\n"
        f"    s = socket.create_connection(({host!r}, {port}), timeout=5)\n"
        "    s.sendall(b'ping'); print(s.recv(100).decode())\n"
        "except OSError as e:\n"
        "    print('ERR', e.errno); sys.exit(1)\n"
    )


# -- contract basics ----------------------------------------------------------------------------


def test_provision_run_read_back(backend, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "keep.txt").write_text("from source_dir")
    spec = SandboxSpec(
        source_dir=str(src),
        files={"keep.txt": b"overridden", "data/in.bin": bytes(range(256))},
        home_files={".cfg/conf.toml": "k = 1"},
        env={"SPEC_VAR": "spec"},
    )
    with backend.create(spec) as sb:
        assert sb.workdir == "/run/ws" and sb.home == "/run/home"
        r = sb.run(
            [
                "sh",
                "-c",
                'pwd; echo "$HOME $SPEC_VAR $RUN_VAR"; cat "$HOME/.cfg/conf.toml"; echo; cat keep.txt;'
                " echo out > result.txt; echo oops >&2; exit 7",
            ],
            env={"RUN_VAR": "run"},
        )
        assert r.exit_code == 7 and not r.timed_out and not r.ok
        assert r.stdout == b"/run/ws\n/run/home spec run\nk = 1\noverridden"
        assert r.stderr == b"oops\n"
        assert r.duration_s > 0
        files = sb.read_files()
        assert files == {
            "pkg/mod.py": b"X = 1\n",
            "keep.txt": b"overridden",
            "data/in.bin": bytes(range(256)),
            "result.txt": b"out\n",
        }
        assert sb.read_files(["result.txt", "missing.txt"]) == {"result.txt": b"out\n"}
        # Files added after start (a verifier's tests) are visible to the next command.
        sb.write_files({"tests/t.sh": "echo verified"})
        assert sb.run(["sh", "tests/t.sh"]).stdout == b"verified\n"


def test_host_environment_not_inherited(backend, monkeypatch):
    monkeypatch.setenv("CLAWFAST_SECRET_TOKEN", "s3cret")
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(["env"])
    assert b"s3cret" not in r.stdout and b"CLAWFAST_SECRET_TOKEN" not in r.stdout
    assert b"HOME=/run/home" in r.stdout


def test_exit_codes_and_stdin(backend):
    with backend.create(SandboxSpec()) as sb:
        assert sb.run(["true"]).exit_code == 0
        assert sb.run(["sh", "-c", "kill -TERM $$"]).exit_code == 128 + signal.SIGTERM
        assert sb.run(["cat"], stdin=b"fed\x00in").stdout == b"fed\x00in"
        assert sb.run(["cat"]).stdout == b""  # no stdin: /dev/null, never the host's terminal
        r = sb.run(["/nonexistent/binary"])
        assert r.exit_code == 127 and b"nonexistent" in r.stderr  # a command failure, not a SandboxError


def test_output_is_capped(backend):
    spec = SandboxSpec(limits=Limits(max_output_bytes=1000))
    with backend.create(spec) as sb:
        r = sb.run(["sh", "-c", "head -c 5000 /dev/zero; head -c 10 /dev/zero >&2"])
    assert len(r.stdout) == 1000 and r.stdout_truncated
    assert len(r.stderr) == 10 and not r.stderr_truncated


def test_bad_input_is_rejected(backend):
    with pytest.raises(ValueError):
        backend.create(SandboxSpec(files={"../escape": b"x"}))
    with pytest.raises(ValueError):
        backend.create(SandboxSpec(files={"/abs": b"x"}))
    with pytest.raises(ValueError):
        backend.create(SandboxSpec(allow_ports=(0,)))
    with pytest.raises(ValueError):
        backend.create(SandboxSpec(ro_binds={"/usr": "/run/ws/usr"}))
    with backend.create(SandboxSpec()) as sb:
        with pytest.raises(ValueError):
            sb.run("echo hi")  # a string, not argv
        with pytest.raises(ValueError):
            sb.run(["true"], timeout=0)
        with pytest.raises(ValueError):
            sb.run(["true"], env={"A=B": "x"})


# -- filesystem isolation -----------------------------------------------------------------------


def test_writes_outside_workspace_fail(backend, tmp_path):
    outside = tmp_path / "host_dir"
    outside.mkdir()
    targets = ["/etc/clawfast_probe", "/usr/clawfast_probe", "/root/clawfast_probe", str(outside / "probe")]
    script = "".join(f"(echo x > {t}) 2>/dev/null && echo WROTE {t}\n" for t in targets)
    script += "echo private > /tmp/p && echo tmp-ok\necho ws > ws.txt && echo ws-ok\n"
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(["sh", "-c", script])
        assert b"WROTE" not in r.stdout
        assert r.stdout == b"tmp-ok\nws-ok\n"
        assert sb.read_files() == {"ws.txt": b"ws\n"}
        # /tmp is private: the next command (a fresh sandbox start) does not see the last one's /tmp.
        assert sb.run(["cat", "/tmp/p"]).exit_code != 0
    for t in targets:
        assert not os.path.exists(t)
    if os.path.exists("/tmp/p"):  # someone else's file; ours never left the sandbox
        with open("/tmp/p") as f:
            assert f.read() != "private\n"


def test_no_capabilities_no_remount(backend):
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(["sh", "-c", "grep CapEff /proc/self/status; mount -o remount,rw / 2>&1; echo rc=$?"])
    assert b"CapEff:\t0000000000000000" in r.stdout
    assert not r.stdout.endswith(b"rc=0\n")


def test_other_sandboxes_and_pool_dir_invisible(backend):
    with backend.create(SandboxSpec(files={"secret.txt": "answer"})) as a, backend.create(SandboxSpec()) as b:
        r = b.run(["sh", "-c", f"ls -A {backend.base_dir}; cat {a.host_workdir}/secret.txt"])
        assert b"answer" not in r.stdout
        assert r.stdout == b""  # the pool directory is an empty tmpfs inside


def test_ro_binds_and_hide_paths(tmp_path, leak_check):
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "bin.sh").write_text("echo from-harness")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "s.txt").write_text("no")
    with BwrapBackend(hide_paths=[str(hidden)]) as b:
        with b.create(SandboxSpec(ro_binds={str(harness): "/run/harness"})) as sb:
            r = sb.run(["sh", "-c", f"sh /run/harness/bin.sh; echo x > /run/harness/w || echo ro; ls -A {hidden}"])
    assert r.stdout == b"from-harness\nro\n"
    assert not (harness / "w").exists()
    leak_check(base_dirs=[b.base_dir])


def test_read_back_never_follows_symlinks(backend):
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(["sh", "-c", "ln -s /etc/hostname leak; ln -s /etc linkdir; mkfifo fifo; echo ok > real"])
        assert r.exit_code == 0
        assert sb.read_files() == {"real": b"ok\n"}
        with pytest.raises(ValueError):
            sb.read_file("leak")
        with pytest.raises(ValueError):
            sb.read_file("linkdir/hostname")
        with pytest.raises(ValueError):
            sb.read_file("fifo")
        with pytest.raises(ValueError):
            sb.write_files({"linkdir/planted": "x"})
    assert not os.path.exists("/etc/planted")


names = st.text(alphabet="abcdefgh_-.0123", min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.lists(names, min_size=1, max_size=3).map("/".join), st.binary(max_size=300), max_size=6))
def test_files_round_trip_through_the_sandbox(backend, files):
    # Drop paths that are both a file and a directory prefix of another path.
    files = {p: c for p, c in files.items() if not any(q.startswith(p + "/") for q in files)}
    with backend.create(SandboxSpec(files=files)) as sb:
        # The command sees exactly these files (sha1 of each, in sorted order) ...
        r = sb.run(["sh", "-c", "find . -type f | sort | xargs -r sha1sum"])
        import hashlib

        want = "".join(f"{hashlib.sha1(files[p]).hexdigest()}  ./{p}\n" for p in sorted(files))
        assert r.stdout.decode() == want
        # ... and reading back returns them unchanged.
        assert sb.read_files() == files


# -- network isolation --------------------------------------------------------------------------


def test_network_isolation(backend, echo_server):
    other = type(echo_server)()  # a second host loopback service the sandbox must NOT reach
    try:
        # The host can reach both; that is what makes the refusals below meaningful.
        for port in (echo_server.port, other.port):
            assert subprocess.run([PY, "-c", connect_code("127.0.0.1", port)], capture_output=True).stdout == b"echo:ping\n"
        with backend.create(SandboxSpec(allow_ports=(echo_server.port,))) as sb:
            r = sb.run(py(connect_code("127.0.0.1", echo_server.port)))
            assert r.stdout == b"echo:ping\n", r
            r = sb.run(py(connect_code("127.0.0.1", other.port)))
            assert r.stdout == f"ERR {errno.ECONNREFUSED}\n".encode()
            # Another loopback address of the sandbox's own lo: the forwarder binds 127.0.0.1 only.
            r = sb.run(py(connect_code("127.0.0.2", echo_server.port)))
            assert r.stdout == f"ERR {errno.ECONNREFUSED}\n".encode()
            # Only lo exists and there is no route at all, so a non-loopback connect fails inside the
            # sandbox's own namespace before any packet could leave (checked first, then tried).
            r = sb.run(["sh", "-c", "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; tail -n +2 /proc/net/route"])
            assert r.stdout == b"lo\n"
            r = sb.run(py(connect_code("10.255.255.1", 80)))
            assert r.stdout == f"ERR {errno.ENETUNREACH}\n".encode()
        assert other.connections == 1  # only the host's own check above
    finally:
        other.close()


def test_several_allowed_ports(backend, echo_server):
    second = type(echo_server)()
    try:
        with backend.create(SandboxSpec(allow_ports=(echo_server.port, second.port))) as sb:
            for port in (echo_server.port, second.port):
                assert sb.run(py(connect_code("127.0.0.1", port))).stdout == b"echo:ping\n"
    finally:
        second.close()


def test_allowed_port_with_nothing_listening_is_a_refusal_not_a_hang(backend, echo_server):
    port = echo_server.port
    echo_server.close()
    with backend.create(SandboxSpec(allow_ports=(port,))) as sb:
        r = sb.run(py(connect_code("127.0.0.1", port) + "\n"), timeout=30)
    # The forwarder accepts, fails upstream and closes: the client sees an empty reply, not a hang.
    assert not r.timed_out
    assert r.stdout in (b"\n", f"ERR {errno.ECONNRESET}\n".encode())


# -- processes, timeouts, faults ----------------------------------------------------------------


def with_marker(marker: str, script: str) -> list[str]:
    """`sh -c script` where $SLEEP runs a long sleep whose command line carries `marker`. The marker
    is assembled inside, so bwrap's own command line (which holds the script) never matches it."""
    head = f'M={marker[:4]}; M="${{M}}{marker[4:]}"; SLEEP="{PY} -c \'import time; time.sleep(300)\' $M"\n'
    return ["sh", "-c", head + script]


def test_timeout_kills_the_whole_tree(backend, marker, host):
    with backend.create(SandboxSpec()) as sb:
        seen = []
        watcher = threading.Thread(target=lambda: [seen.append(len(host.pids_with(marker))) or time.sleep(0.05) for _ in range(15)])
        watcher.start()
        t0 = time.monotonic()
        # A daemonised grandchild in its own session, a plain background child, and a foreground wait.
        r = sb.run(
            with_marker(marker, "setsid sh -c \"$SLEEP\" & sh -c \"$SLEEP\" & eval exec $SLEEP"),
            timeout=1.0,
        )
        elapsed = time.monotonic() - t0
        watcher.join()
        assert r.timed_out and r.exit_code is None
        assert elapsed < 10
        assert max(seen) >= 3  # all three sleepers (and their sh wrappers) were running before the timeout
        assert host.pids_with(marker) == []  # gone when run() returns, not eventually
        assert sb.run(["echo", "still usable"]).stdout == b"still usable\n"


def test_background_processes_die_with_the_command(backend, marker, host):
    with backend.create(SandboxSpec()) as sb:
        r = sb.run(with_marker(marker, "setsid sh -c \"$SLEEP\" & sh -c \"$SLEEP\" & sleep 1; echo started"))
        assert b"started" in r.stdout
        assert r.exit_code == 0
        assert host.pids_with(marker) == []


def test_process_killed_mid_run_is_a_command_failure(backend, marker, host):
    with backend.create(SandboxSpec()) as sb:
        def killer():
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                pids = host.pids_with(marker)
                if pids:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    return
                time.sleep(0.01)

        t = threading.Thread(target=killer)
        t.start()
        r = sb.run(with_marker(marker, "eval exec $SLEEP"), timeout=30)
        t.join()
        assert r.exit_code == 128 + signal.SIGKILL and not r.timed_out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def test_killed_sandbox_is_a_sandbox_error(backend, marker, host):
    with backend.create(SandboxSpec()) as sb:
        def killer():
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                bwraps = [p for p in host.children() if sb.hostdir.dir.encode() in _cmdline(p)]
                if bwraps and host.pids_with(marker):
                    os.kill(bwraps[0], signal.SIGKILL)
                    return
                time.sleep(0.01)

        t = threading.Thread(target=killer)
        t.start()
        with pytest.raises(SandboxError, match="killed by signal 9"):
            sb.run(with_marker(marker, "sh -c \"$SLEEP\" & eval exec $SLEEP"), timeout=30)
        t.join()
        assert host.pids_with(marker) == []


def test_start_failure_is_a_sandbox_error_and_leaves_nothing(backend, host):
    # A bwrap that fails at once (the missing mount point this test used, /usr/clawfast/x, is now
    # refused by create with ValueError: test_ro_binds_target_missing_in_a_system_dir_is_refused).
    backend.bwrap = "/bin/false"
    with pytest.raises(SandboxError, match="failed to start"):
        backend.create(SandboxSpec())
    assert os.listdir(backend.base_dir) == ["view"]
    assert host.own_cgroups() == []


def test_missing_forwarder_binary_is_a_sandbox_error(backend, echo_server):
    backend.socat = "/nonexistent/socat"
    with pytest.raises(SandboxError, match="not found"):
        backend.create(SandboxSpec(allow_ports=(echo_server.port,)))
    assert os.listdir(backend.base_dir) == ["view"]


def test_closed_sandbox_refuses_commands(backend):
    sb = backend.create(SandboxSpec())
    sb.close()
    sb.close()  # idempotent
    assert sb.closed
    with pytest.raises(SandboxError):
        sb.run(["true"])


def run_in_thread(sb, marker: str) -> tuple[threading.Thread, list[SandboxError]]:
    """Start a long marked command in `sb` from another thread; the SandboxError it ends with (the
    sandbox closed under it) is appended to the returned list."""
    errors: list[SandboxError] = []

    def runner():
        try:
            sb.run(with_marker(marker, "eval exec $SLEEP"), timeout=60)
        except SandboxError as exc:
            errors.append(exc)

    t = threading.Thread(target=runner)
    t.start()
    return t, errors


def test_close_during_a_run_kills_it(backend, marker, host):
    sb = backend.create(SandboxSpec())
    t, errors = run_in_thread(sb, marker)
    deadline = time.monotonic() + 10
    while not host.pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    sb.close()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1
    assert host.pids_with(marker) == []


def test_close_while_a_run_is_starting_kills_it(backend, marker, host, monkeypatch):
    """close() while bwrap is being spawned (Popen has forked but not yet returned): the run is
    registered before close() can look, so close() kills it and removes the cgroup at once instead of
    finding nothing, and the command does not outlive the sandbox. The spawn is slowed to 300 ms to
    hold that window open (bench/bench_sandbox_faults.py met it at concurrency 16)."""
    import subprocess as sp

    spawned = threading.Event()

    class SlowPopen(sp.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spawned.set()
            time.sleep(0.3)

    sb = backend.create(SandboxSpec())
    groups = list(sb.cgroup.procs_files) if sb.cgroup else []
    monkeypatch.setattr("clawfast.sandbox.bwrap.subprocess.Popen", SlowPopen)
    t, errors = run_in_thread(sb, marker)
    assert spawned.wait(10)
    t0 = time.monotonic()
    sb.close()
    assert time.monotonic() - t0 < 3
    t.join(10)
    assert not t.is_alive() and len(errors) == 1
    assert host.pids_with(marker) == [] and not any(os.path.exists(g) for g in groups)


def test_a_cgroup_removed_under_a_reader_has_no_members():
    """close() destroys the cgroup while a run may be reading its members: a group removed between
    open and read (the kernel answers ENODEV) or before the open (ENOENT) counts as empty."""
    from clawfast.sandbox.spec import Limits
    from clawfast.sandbox.cgroup import Cgroup, CgroupHost

    cgroup = Cgroup.create(Limits(), CgroupHost.detect())
    # the race is one of cgroup files, so the test needs a hierarchy (as root, as CI runs)
    assert cgroup is not None, "no writable cgroup hierarchy: run the sandbox tests as root"
    held = [open(path) for path in cgroup.procs_files]
    removed = list(cgroup.procs_files)
    cgroup.destroy()
    try:
        # /proc/self/fd/N reopens the removed group's file: the state a reader racing destroy() sees
        cgroup.procs_files = [f"/proc/self/fd/{f.fileno()}" for f in held] + removed
        assert cgroup.pids() == set()
        assert cgroup.kill_all(0.1)
    finally:
        for f in held:
            f.close()


# -- limits -------------------------------------------------------------------------------------


def test_file_size_limit(backend):
    with backend.create(SandboxSpec(limits=Limits(max_file_bytes=1 << 20))) as sb:
        assert sb.enforced["file_size"] == "RLIMIT_FSIZE"
        r = sb.run(["sh", "-c", "head -c 2000000 /dev/zero > big"])
        assert (r.exit_code, r.limit) == (128 + signal.SIGXFSZ, "file size")
        assert len(sb.read_file("big")) == 1 << 20


def test_memory_limit(backend):
    with backend.create(SandboxSpec(limits=Limits(memory_bytes=64 << 20))) as sb:
        # The suite runs as root on a host with cgroups (as CI does): the limit must hold.
        assert "memory" in sb.enforced, sb.enforced
        small = sb.run(py("b = bytearray(16 << 20); print(len(b))"))
        assert (small.stdout, small.limit) == (b"16777216\n", None)
        big = sb.run(py("b = bytearray(256 << 20); print(len(b))"))
        assert (big.exit_code, big.limit) == (128 + signal.SIGKILL, "memory")
        # A command that survives the kill of one of its children still reports the limit.
        child = sb.run(["sh", "-c", f"{shlex.join(py('b = bytearray(256 << 20)'))}; echo survived"])
        assert (child.exit_code, child.stdout, child.limit) == (0, b"survived\n", "memory")
        assert sb.run(["true"]).limit is None  # the counter is read per run


def test_process_limit(backend):
    with backend.create(SandboxSpec(limits=Limits(max_processes=16))) as sb:
        assert "processes" in sb.enforced, sb.enforced
        code = (
            "import os, time\n"
            "n = 0\n"
            "for _ in range(40):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except BlockingIOError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(30); os._exit(0)\n"
            "    n += 1\n"
            "print(n)\n"
        )
        r = sb.run(py(code), timeout=60)
        # bwrap's init, the python parent and the children share the 16: fork fails before 40.
        assert 5 <= int(r.stdout) < 16
        assert r.limit == "processes"


def test_disk_limit_and_timeout_are_named(backend):
    with backend.create(SandboxSpec(limits=Limits(disk_bytes=8 << 20, memory_bytes=512 << 20))) as sb:
        full = sb.run(["sh", "-c", "head -c 32000000 /dev/zero > big"])
        assert (full.exit_code != 0, full.limit) == (True, "disk") and b"No space left" in full.stderr
        # Space freed: a command that fails for its own reasons names no limit.
        assert sb.run(["sh", "-c", "rm big; exit 3"]).limit is None
        assert sb.run(["sleep", "5"], timeout=0.5).limit == "time"


def test_address_space_limit(backend):
    with backend.create(SandboxSpec(limits=Limits(address_space_bytes=256 << 20))) as sb:
        r = sb.run(py("b = bytearray(512 << 20)"))
        assert r.exit_code == 1 and b"MemoryError" in r.stderr
        assert sb.run(py("b = bytearray(16 << 20)")).exit_code == 0


def test_owner_killed_takes_its_sandboxes_along(tmp_path, marker, host):
    """The process that owns a pool is SIGKILLed mid-run (no close()): its sandbox processes die with
    it (--die-with-parent), and the next backend made on the host sweeps the cgroups and directories
    it left."""
    from clawfast.sandbox.cgroup import CgroupHost, sandbox_groups
    from clawfast.sandbox.hostdir import mounts_under

    owner_code = (
        "import sys\n"
        "from clawfast.sandbox import SandboxSpec\n"
        "from clawfast.sandbox.bwrap import BwrapBackend\n"
        f"b = BwrapBackend(base_dir={str(tmp_path)!r})\n"
        "sb = b.create(SandboxSpec())\n"
        "print('ready', flush=True)\n"
        f"sb.run([{PY!r}, '-c', 'import time; time.sleep(300)', {marker!r}])\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE)
    assert owner.stdout.readline() == b"ready\n"
    def command_started():
        # The sandboxed python itself, not just bwrap (whose own PDEATHSIG is set a moment after it
        # forks: an owner killed within that window leaves an orphan that only the cgroup sweep ends).
        return any(_cmdline(p).startswith(PY.encode()) for p in host.pids_with(marker))

    deadline = time.monotonic() + 20
    while not command_started() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert command_started()
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while host.pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [_cmdline(p) for p in host.pids_with(marker)] == []
    leftovers = [e for e in os.listdir(tmp_path) if e.startswith(f"clawfast-sandbox-{owner.pid}-")]
    assert leftovers  # it could not clean up ...
    cgroups = sandbox_groups(CgroupHost.detect(), owner.pid)
    assert cgroups  # (the suite runs as root, as CI does: a cgroup hierarchy is writable)
    assert mounts_under(str(tmp_path))  # the workspace quota's tmpfs
    with BwrapBackend(base_dir=str(tmp_path)) as b:  # ... and the next backend sweeps it
        assert not any(e.startswith(f"clawfast-sandbox-{owner.pid}-") for e in os.listdir(tmp_path))
        assert not any(os.path.exists(c) for c in cgroups)
        assert mounts_under(str(tmp_path)) == []
        b.create(SandboxSpec()).close()


def test_forwarder_moves_large_random_payloads_intact(backend):
    """4 MiB of seeded random bytes through socat -> Unix socket -> host forwarder -> a host server
    that sends them back after the client's EOF (the client half-closes after sending)."""
    import hashlib
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def echo_all():
        conn, _ = server.accept()
        with conn:
            received = bytearray()
            while data := conn.recv(65536):
                received += data
            # Reply only after the client's EOF and a silence longer than socat's default -t 0.5 (a
            # model generating the whole reply before streaming it, as the proxy does).
            time.sleep(1.5)
            conn.sendall(received)

    t = threading.Thread(target=echo_all, daemon=True)
    t.start()
    seed, size = 1234, 4 << 20
    expected = hashlib.sha256(random_bytes(seed, size)).hexdigest()
    client = (
        "import hashlib, random, socket, threading\n"
        f"data = random.Random({seed}).randbytes({size})\n"
        f"s = socket.create_connection(('127.0.0.1', {port}))\n"
        "def send():\n"
        "    s.sendall(data); s.shutdown(socket.SHUT_WR)\n"
        "threading.Thread(target=send).start()\n"
        "h = hashlib.sha256(); n = 0\n"
        "while chunk := s.recv(65536):\n"
        "    h.update(chunk); n += len(chunk)\n"
        "print(n, h.hexdigest())\n"
    )
    try:
        with backend.create(SandboxSpec(allow_ports=(port,))) as sb:
            r = sb.run(py(client), timeout=120)
    finally:
        server.close()
    assert r.stdout.decode().split() == [str(size), expected], r.stderr


def random_bytes(seed: int, size: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)

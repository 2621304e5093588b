"""The default backend: bubblewrap (`bwrap`), one fresh set of namespaces per command.

A sandbox is a host directory (workspace, private home, proxy sockets) plus a per-sandbox cgroup.
Each `run` starts `bwrap` with:

- the host root read-only (`--ro-bind / /`), fresh /dev, /proc, a private /tmp and /run (tmpfs), the
  pool's own directory hidden (so a sandbox cannot read another sandbox's workspace), the workspace
  read-write at /run/ws (or `SandboxSpec.workdir`), the private home read-write at /run/home,
  `ro_binds` read-only, and the backend's and the spec's `hide_paths` covered by empty tmpfs;
- new user, PID, IPC, UTS, cgroup, mount and network namespaces (`--unshare-all`), so the only network
  is the sandbox's own loopback; `--cap-drop ALL` (bwrap keeps every capability for root otherwise),
  `--new-session` (no terminal injection), `--die-with-parent`;
- for each allowed port, a socat listening on the sandbox's 127.0.0.1:<port> and connecting to a Unix
  socket bound in from the host, where `HostForwarder` forwards to the host's 127.0.0.1:<port>.
  Without allowed ports no forwarder is started at all.

A `workdir` needs a mount point, which bwrap cannot create in the read-only root. So:
- a workdir that is a directory on the host, or lies under /tmp or /run, is bound onto directly (the
  host directory is covered, not changed);
- a workdir that exists on the host as anything but a directory, or below a component that does (a
  symlink included: bwrap would follow it), is refused (ValueError from `create`);
- otherwise its deepest existing ancestor A is rebuilt: a tmpfs on A (with the host's mode) holding
  each entry of the host's A at the same path, read-only (directories and files bound, symlinks
  recreated, never followed), the missing directories made in it, then A remounted read-only. When A
  is /, the root itself is built that way instead of `--ro-bind / /` (bwrap's own tmpfs, mode 0755),
  without /proc, /dev, /tmp and /run, which the sandbox mounts itself. Inside, A holds what the host's
  A held when the sandbox was created (an entry made later is missing, one removed later is left
  out) and is owned by the sandbox's root. Everything else is as without a workdir: the pool
  directory and `hide_paths` are hidden and `ro_binds` mounted after this, so they apply inside A too.

Limits and how they are enforced (`Sandbox.enforced` lists what this host gives):
- memory: cgroup v1 `memory.limit_in_bytes` (+ memsw) when the hierarchy is writable; else none.
- processes: cgroup v1 `pids.max` when writable; else none (RLIMIT_NPROC is not used: the kernel
  ignores it for uid 0, which the sandbox runs as when the host runs as root).
- file size: RLIMIT_FSIZE (`ulimit -f` inside; stdout/stderr capture files count too).
- address space: RLIMIT_AS (`ulimit -v`), only if `Limits.address_space_bytes` is set.
- wall time: the run's timeout; the sandbox's PID-namespace init is SIGKILLed, which makes the
  kernel kill every process of the namespace (daemonised, re-parented, new-session ones included);
  `run` returns only once all of them are gone.

Not guaranteed: Unix sockets of the host that lie under the read-only root stay connectable (a
read-only mount does not block `connect`); /tmp, /run and the pool directory are hidden, pass
`hide_paths` for others. A SIGKILL sent to the sandbox's init from outside reads as the command being
killed (exit 137), like an OOM kill; a killed `bwrap` process reads as `SandboxError`. If the owning
Python process is killed (no `close()`), `--die-with-parent` ends its sandboxes, except one whose bwrap
was started within the ~1 ms before bwrap arms its parent-death signal; such an orphan (when it has a
cgroup), and the cgroups and directories any killed owner leaves, are removed by the next
`BwrapBackend` made on the host (cgroup and directory names carry the owner's pid).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from clawfast.sandbox.base import (
    HOMEDIR,
    PROXYDIR,
    TMPFS_DIRS,
    WORKDIR,
    RunResult,
    Sandbox,
    SandboxError,
    SandboxSpec,
    rlimit_enforced,
    wait_exit,
)
from clawfast.sandbox.cgroup import Cgroup, sweep_stale
from clawfast.sandbox.hostdir import (
    READY,
    ForwardingBackend,
    HostDir,
    merge_env,
    start_script,
    sweep_stale_dirs,
)

KILL_GRACE_S = 5.0
# Mounted fresh in every sandbox, so never copied from the host when the root is rebuilt.
OWN_MOUNTS = ("/proc", "/dev") + TMPFS_DIRS


class BwrapBackend(ForwardingBackend):
    """Options:
    base_dir: where sandbox directories are made (default: the system temp dir). It is hidden inside.
        A tmpfs such as /dev/shm makes create+destroy cheaper where the disk is slow (each rmdir was
        ~2.4 ms on this machine's ext4), at the price of workspaces held in RAM.
    use_cgroup: create a per-sandbox cgroup for memory/process limits when the host allows it.
    probe: start `true` in every new sandbox so that `create` fails (SandboxError) rather than the
        first real command; costs one sandbox start (see bench/bench_sandbox.py).
    hide_paths: extra host paths to cover with an empty tmpfs inside (e.g. a directory of sockets).
    """

    name = "bwrap"

    def __init__(
        self,
        *,
        base_dir: str | None = None,
        use_cgroup: bool = True,
        probe: bool = True,
        hide_paths: Sequence[str] = (),
    ) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("bubblewrap is not installed (Debian: apt-get install bubblewrap socat)")
        self.socat = shutil.which("socat")
        for path in hide_paths:
            if not os.path.isabs(path) or os.path.normpath(path) == "/":
                raise ValueError(f"hide_paths: {path!r} must be an absolute path other than /")
        self.hide_paths = tuple(hide_paths)
        self.use_cgroup = use_cgroup
        self.probe = probe
        # What an owner killed before close() left behind (its processes died with it: --die-with-parent).
        if use_cgroup:
            sweep_stale()
        sweep_stale_dirs(base_dir, "clawfast-sandbox-")
        self.base_dir = tempfile.mkdtemp(prefix=f"clawfast-sandbox-{os.getpid()}-", dir=base_dir)
        super().__init__()

    def create(self, spec: SandboxSpec) -> BwrapSandbox:
        self._check_can_create(spec)
        if spec.allow_ports and self.socat is None:
            raise SandboxError("allow_ports needs socat inside the sandbox (Debian: apt-get install socat)")
        sandbox = BwrapSandbox(self, spec)
        self._start_tracked(sandbox, sandbox.start)
        return sandbox

    def close(self) -> None:
        if not self._close_live():
            return
        self._close_forwarder()
        shutil.rmtree(self.base_dir, ignore_errors=True)


class BwrapSandbox(Sandbox):
    def __init__(self, backend: BwrapBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.workdir = spec.workdir or WORKDIR
        # Checked before anything exists on the host, so a refused workdir leaves nothing to clean up.
        self._room = _room_for(self.workdir)
        self.home = HOMEDIR
        self.hostdir: HostDir | None = None
        self.enforced: dict[str, str] = {"wall": "SIGKILL of the PID namespace at the timeout"}
        self.cgroup: Cgroup | None = None
        self._argv: list[str] = []
        self._counter = itertools.count()
        self._closed = False
        self._lock = threading.Lock()
        self._running: dict[int, tuple[subprocess.Popen, _Status]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.hostdir = HostDir(self.spec, self.backend.base_dir, self.backend.forwarder)
        self.host_workdir = self.hostdir.workspace
        self.host_home = self.hostdir.home
        if self.backend.use_cgroup:
            self.cgroup = Cgroup.create(self.spec.limits)
            if self.cgroup is not None:
                self.enforced.update(self.cgroup.enforced)
        self.enforced.update(rlimit_enforced(self.spec.limits))
        self._argv = self._bwrap_argv(forwarders=True)
        if self.backend.probe:
            # The probe checks that bwrap starts with these mounts and namespaces and that socat
            # exists, without starting the forwarders (they start with every run anyway): with them,
            # create+destroy with a port allowed cost 30-50 ms more in bench/bench_sandbox.py.
            result = self._run(self._bwrap_argv(forwarders=False), ["true"], None, 30, None)
            if result.exit_code != 0:
                raise SandboxError(f"sandbox probe failed: {result}")

    def _bwrap_argv(self, forwarders: bool) -> list[str]:
        spec, room = self.spec, self._room
        argv = [self.backend.bwrap]
        argv += _copy_of("/", skip=OWN_MOUNTS) if room == "/" else ["--ro-bind", "/", "/"]
        argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        if room not in (None, "/"):
            argv += ["--perms", _mode_of(room), "--tmpfs", room] + _copy_of(room)
        # After the rebuilt room, so that what it re-exposes of these stays hidden.
        if not any(self.backend.base_dir.startswith(d) for d in ("/tmp/", "/run/", "/dev/")):
            argv += ["--tmpfs", self.backend.base_dir]  # else already hidden by the tmpfs/dev above
        for path in self.backend.hide_paths:
            argv += ["--tmpfs", path]
        # bwrap cannot make a mount point in the read-only root, and a missing path hides nothing.
        argv += [arg for path in spec.hide_paths if os.path.isdir(path) for arg in ("--tmpfs", path)]
        argv += ["--bind", self.hostdir.workspace, self.workdir, "--bind", self.hostdir.home, HOMEDIR]
        if spec.allow_ports:
            argv += ["--ro-bind", self.hostdir.proxy, PROXYDIR]
        for host_path, target in spec.ro_binds.items():
            argv += ["--ro-bind", os.path.abspath(host_path), target]
        if room is not None:
            # Read-only like the host root it stands for, once every mount point in it is made; not
            # recursive, so the workspace and home mounted in it stay writable.
            argv += ["--remount-ro", room]
        argv += ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        argv += ["--hostname", "sandbox", "--chdir", self.workdir]
        argv += ["--", "/bin/sh", "-c", start_script(spec, self.backend.socat or "socat", forwarders), "sh"]
        if self.cgroup is not None:
            # Join the cgroup before bwrap exists, so no sandbox process is ever outside it.
            joins = " && ".join(f"echo $$ > {shlex.quote(p)}" for p in self.cgroup.procs_files)
            argv = ["/bin/sh", "-c", joins + ' && exec "$@"', "sh"] + argv
        return argv

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = list(self._running.values())
        try:
            for proc, status in running:
                _kill_tree(proc, status, self.cgroup)
            if self.cgroup is not None:
                self.cgroup.destroy()
        finally:
            if self.hostdir is not None:
                self.hostdir.close()
            self.backend.forget(self)

    # -- commands ------------------------------------------------------------------------------

    def _run_command(
        self, argv: list[str], env: Mapping[str, str] | None, timeout: float, stdin: bytes | None
    ) -> RunResult:
        return self._run(self._argv, argv, env, timeout, stdin)

    def _run(
        self, bwrap_argv: list[str], argv: list[str], env: Mapping[str, str] | None, timeout: float, stdin: bytes | None
    ) -> RunResult:
        full_env = merge_env(self.spec, env)
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            n = next(self._counter)
        io_base = os.path.join(self.hostdir.dir, f"run{n}")
        status_r, status_w = os.pipe()
        argv_full = list(bwrap_argv)
        # bwrap writes {"child-pid": N} (the namespace's init, as the host sees it) to this fd.
        i = argv_full.index("--unshare-all")
        argv_full[i:i] = ["--json-status-fd", str(status_w)]
        try:
            with open(io_base + ".out", "wb+") as out, open(io_base + ".err", "wb+") as err:
                stdin_f = None
                if stdin is not None:
                    stdin_f = open(io_base + ".in", "wb+")
                    stdin_f.write(stdin)
                    stdin_f.seek(0)
                t0 = time.monotonic()
                try:
                    proc = subprocess.Popen(
                        argv_full + argv,
                        stdin=stdin_f if stdin_f is not None else subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env=full_env,
                        pass_fds=(status_w,),
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise SandboxError(f"cannot start bwrap: {exc}") from exc
                finally:
                    os.close(status_w)
                    if stdin_f is not None:
                        stdin_f.close()
                status = _Status(status_r)
                with self._lock:
                    self._running[n] = (proc, status)
                timed_out = False
                try:
                    if not wait_exit(proc, timeout):
                        timed_out = True
                        _kill_tree(proc, status, self.cgroup)
                    _wait_namespace_gone(status, self.cgroup)
                finally:
                    with self._lock:
                        self._running.pop(n, None)
                duration = time.monotonic() - t0
                returncode = proc.returncode
                cap = self.spec.limits.max_output_bytes
                stdout, stdout_trunc = _read_capped(out, 0, cap)
                err.seek(0)
                ready = err.read(len(READY)) == READY
                stderr, stderr_trunc = _read_capped(err, len(READY) if ready else 0, cap)
        finally:
            os.close(status_r)
            for suffix in (".out", ".err", ".in"):
                try:
                    os.unlink(io_base + suffix)
                except FileNotFoundError:
                    pass
        if self._closed:
            raise SandboxError("sandbox was closed while the command ran")
        if returncode is not None and returncode < 0 and not timed_out:
            raise SandboxError(f"bwrap was killed by signal {-returncode}; stderr: {stderr[-2000:]!r}")
        if not ready and not timed_out:
            raise SandboxError(f"sandbox failed to start (exit {returncode}): {stderr[-2000:].decode(errors='replace')}")
        return RunResult(
            exit_code=None if timed_out else returncode,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            duration_s=duration,
            stdout_truncated=stdout_trunc,
            stderr_truncated=stderr_trunc,
        )


def _room_for(workdir: str) -> str | None:
    """The directory to rebuild so that bwrap can make the mount point `workdir` (see the module
    docstring): its deepest ancestor that exists on the host, or None when none is needed. ValueError
    when `workdir` or one of its ancestors exists on the host as something other than a directory."""
    if any(workdir.startswith(d + "/") for d in TMPFS_DIRS):
        return None
    existing = "/"
    for part in workdir.split("/")[1:]:
        path = os.path.join(existing, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return existing
        except OSError as exc:
            raise SandboxError(f"cannot inspect {path!r} for the workdir {workdir!r}: {exc}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(
                f"SandboxSpec.workdir {workdir!r}: {path!r} exists on the host and is not a directory"
                " (a symlink is refused too), so the workspace cannot be mounted there"
            )
        existing = path
    return None


def _copy_of(directory: str, skip: Sequence[str] = ()) -> list[str]:
    """bwrap arguments that show each entry of the host's `directory` at the same path, read-only:
    directories and files bound (`-try`: an entry removed after this listing is left out rather than
    failing every run), symlinks recreated, never followed."""
    argv = []
    try:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if path in skip:
                continue
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            else:
                argv += ["--ro-bind-try", path, path]
    except OSError as exc:
        raise SandboxError(f"cannot list {directory!r} to make room for the workdir: {exc}") from exc
    return argv


def _mode_of(directory: str) -> str:
    try:
        return f"{stat.S_IMODE(os.stat(directory).st_mode):04o}"
    except OSError as exc:
        raise SandboxError(f"cannot stat {directory!r} to make room for the workdir: {exc}") from exc


def _read_capped(f, start: int, cap: int) -> tuple[bytes, bool]:
    f.seek(start)
    data = f.read(cap + 1)
    return data[:cap], len(data) > cap


class _Status:
    """bwrap's --json-status-fd pipe: `{"child-pid": N}` (the PID namespace's init, as the host sees
    it) arrives right after bwrap forks it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pid: int | None = None
        self._buf = b""
        os.set_blocking(fd, False)

    def child_pid(self) -> int | None:
        if self._pid is None:
            try:
                while chunk := os.read(self.fd, 65536):
                    self._buf += chunk
            except (BlockingIOError, OSError):
                pass
            for line in self._buf.decode(errors="replace").splitlines():
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("child-pid"), int):
                    self._pid = obj["child-pid"]
        return self._pid


def _kill_tree(proc: subprocess.Popen, status: _Status, cgroup: Cgroup | None) -> None:
    """Kill everything a run started and reap bwrap: SIGKILL to the namespace's init makes the kernel
    kill every other process of the namespace."""
    pid = status.child_pid()
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if cgroup is not None:
        cgroup.kill_all()
    if not wait_exit(proc, KILL_GRACE_S if pid is not None else 0.05):
        # No init pid known (killed before bwrap reported it): kill bwrap, --die-with-parent does the rest.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _wait_namespace_gone(status: _Status, cgroup: Cgroup | None) -> None:
    """Return once no process of the run's namespace is left.

    bwrap exits as soon as the command does; only then does its init get SIGKILL (--die-with-parent)
    and the kernel kill the rest of the namespace, a moment later (seen: background processes still
    alive right after bwrap was reaped). The init becomes a zombie only after every other process of
    its namespace is gone, so waiting for the init to exit (a pidfd turns readable) is exactly enough."""
    if cgroup is not None:
        cgroup.kill_all(KILL_GRACE_S)
    pid = status.child_pid()
    if pid is None:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already exited and reaped
    except (AttributeError, OSError):
        _poll_gone(pid)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(KILL_GRACE_S * 1000):
            os.kill(pid, signal.SIGKILL)  # PDEATHSIG did not do it: do it here
            poller.poll(KILL_GRACE_S * 1000)
    finally:
        os.close(fd)


def _poll_gone(pid: int) -> None:
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.001)

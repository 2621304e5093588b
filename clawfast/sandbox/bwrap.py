"""The default backend: bubblewrap (`bwrap`), one fresh set of namespaces per command.

A sandbox is a host directory (workspace and private home on a sized tmpfs, proxy sockets) plus a
per-sandbox cgroup. Each `run` starts `bwrap` with:

- a minimal root (`clawfast.sandbox.view`, which lists what is visible): the system directories
  (/usr, /bin, /sbin, /lib*) and /etc read-only, with /etc's entries that others may not read covered
  and its passwd/group generated; fresh /dev and /proc; a private /tmp and /dev/shm (tmpfs of
  `Limits.disk_bytes` each) and /run; the workspace read-write at /run/ws (or `SandboxSpec.workdir`),
  the private home read-write at /run/home, `ro_binds` read-only; nothing else of the host. The root
  itself is bwrap's own tmpfs, read-only once every mount point in it is made;
- an unprivileged user: when this process is root, bwrap keeps the host's user namespace and the
  command is started by `setpriv` as `uid` (default `SANDBOX_UID`) with no supplementary groups, an
  empty capability bounding set and no-new-privileges, so a file the host keeps root-only stays
  unreadable even where a path is bound by mistake; otherwise bwrap makes a user namespace and the
  command runs as the calling user (bwrap is then not setuid: nothing about it needs privileges);
- new PID, IPC, UTS, cgroup, mount and network namespaces, so the only network is the sandbox's own
  loopback; `--new-session` (no terminal injection), `--die-with-parent`;
- for each allowed port, a socat listening on the sandbox's 127.0.0.1:<port> and connecting to a Unix
  socket bound in from the host, where `HostForwarder` forwards to the host's 127.0.0.1:<port>.
  Without allowed ports no forwarder is started at all.

A `workdir` needs a mount point. Outside the system directories bwrap makes it in its root tmpfs. In
one of them (e.g. /usr/src/app), which are read-only binds:
- a workdir that is a directory on the host is bound onto directly (the host directory is covered, not
  changed);
- a workdir that exists on the host as anything but a directory, or below a component that does (a
  symlink included: bwrap would follow it, and so a workdir below /bin when /bin is a link), is
  refused (ValueError from `create`);
- otherwise its deepest existing ancestor A is rebuilt: a tmpfs on A (with the host's mode) holding
  each entry of the host's A at the same path, read-only (directories and files bound, symlinks
  recreated, never followed), the missing directories made in it, then A remounted read-only. Inside,
  A holds what the host's A held when the sandbox was created. The /etc covers and `hide_paths` are
  mounted after this, so they apply inside A too.

Limits and how they are enforced (`Sandbox.enforced` lists what this host gives; what it cannot give is
logged once when the backend is made):
- memory, processes, CPU: a cgroup v2 or v1 group per sandbox (`clawfast.sandbox.cgroup`).
- disk: the workspace and home share a tmpfs of `Limits.disk_bytes` mounted on the host (root only),
  /tmp and /dev/shm are tmpfs of that size each.
- file size: RLIMIT_FSIZE (`ulimit -f` inside; stdout/stderr capture files count too).
- address space: RLIMIT_AS (`ulimit -v`), only if `Limits.address_space_bytes` is set.
- wall time: the run's timeout; the sandbox's PID-namespace init is SIGKILLed, which makes the
  kernel kill every process of the namespace (daemonised, re-parented, new-session ones included);
  `run` returns only once all of them are gone.

Not guaranteed: that the sandbox user cannot make user namespaces of its own (the host's setting
decides; inside one it gains nothing over host files, which stay owned by users it is not). A SIGKILL
sent to the sandbox's init from outside reads as the command being killed (exit 137), like an OOM
kill; a killed `bwrap` process reads as `SandboxError`. If the owning Python process is killed (no
`close()`), `--die-with-parent` ends its sandboxes, except one whose bwrap was started within the ~1 ms
before bwrap arms its parent-death signal; such an orphan (when it has a cgroup), and the cgroups,
quota mounts and directories any killed owner leaves, are removed by the next `BwrapBackend` made on
the host (cgroup and directory names carry the owner's pid).
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
    SANDBOX_UID,
    TMPFS_DIRS,
    WORKDIR,
    RunResult,
    Sandbox,
    SandboxError,
    SandboxSpec,
    rlimit_enforced,
    wait_exit,
)
from clawfast.sandbox.cgroup import Cgroup, CgroupHost, sweep_stale
from clawfast.sandbox.hostdir import (
    READY,
    ForwardingBackend,
    HostDir,
    log,
    merge_env,
    split_ready,
    start_script,
    sweep_stale_dirs,
)
from clawfast.sandbox.view import SYSTEM_PATHS, RootView, ancestors

KILL_GRACE_S = 5.0
# What setpriv needs to drop to the sandbox user and empty the bounding set; all of it is gone once the
# command runs (a change of every uid away from 0 clears the capabilities).
_SWITCH_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


class BwrapBackend(ForwardingBackend):
    """Options:
    base_dir: where sandbox directories are made (default: the system temp dir). It is never visible
        inside. A tmpfs such as /dev/shm makes create+destroy cheaper where the disk is slow (each
        rmdir was ~2.4 ms on this machine's ext4).
    use_cgroup: create a per-sandbox cgroup for memory/process/CPU limits when the host allows it.
    probe: start `true` in every new sandbox so that `create` fails (SandboxError) rather than the
        first real command; costs one sandbox start (see bench/bench_sandbox.py).
    hide_paths: host paths inside the visible system directories to cover with an empty tmpfs.
    uid: the host uid (and gid) sandboxed processes run as when this process is root.
    system_paths: the host directories shown read-only (see `clawfast.sandbox.view`).
    """

    name = "bwrap"

    def __init__(
        self,
        *,
        base_dir: str | None = None,
        use_cgroup: bool = True,
        probe: bool = True,
        hide_paths: Sequence[str] = (),
        uid: int = SANDBOX_UID,
        system_paths: Sequence[str] = SYSTEM_PATHS,
    ) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("bubblewrap is not installed (Debian: apt-get install bubblewrap socat)")
        self.socat = shutil.which("socat")
        for path in hide_paths:
            if not os.path.isabs(path) or os.path.normpath(path) == "/":
                raise ValueError(f"hide_paths: {path!r} must be an absolute path other than /")
        if not isinstance(uid, int) or isinstance(uid, bool) or not 0 < uid < 2**32 - 1:
            raise ValueError(f"uid must be a non-zero host uid, got {uid!r}")
        self.hide_paths = tuple(hide_paths)
        self.use_cgroup = use_cgroup
        self.probe = probe
        self.as_root = os.geteuid() == 0
        # Who the sandbox runs as: (uid, gid) to hand its files to, or None for this process's own user.
        self.owner = (uid, uid) if self.as_root else None
        self.setpriv = None
        if self.as_root:
            self.setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
            if self.setpriv is None:
                raise SandboxError("running sandboxes as an unprivileged user needs setpriv (Debian: util-linux)")
        self.cgroups = CgroupHost.detect() if use_cgroup else CgroupHost(None)
        # What an owner killed before close() left behind (its processes died with it: --die-with-parent).
        if use_cgroup:
            sweep_stale(self.cgroups)
            if message := self.cgroups.report():
                log.warning("clawfast bwrap backend: %s", message)
        if not self.as_root:
            log.warning("clawfast bwrap backend: disk quota NOT enforced (mounting a sized tmpfs needs root)")
        sweep_stale_dirs(base_dir, "clawfast-sandbox-")
        self.base_dir = tempfile.mkdtemp(prefix=f"clawfast-sandbox-{os.getpid()}-", dir=base_dir)
        try:
            view_dir = os.path.join(self.base_dir, "view")
            os.mkdir(view_dir)
            uid_inside = uid if self.as_root else os.getuid()
            self.view = RootView(view_dir, uid_inside, uid_inside if self.as_root else os.getgid(), system_paths)
        except BaseException:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            raise
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
        self._room = _room_for(self.workdir, backend.view)
        self.home = HOMEDIR
        self.hostdir: HostDir | None = None
        self.enforced: dict[str, str] = {"wall": "SIGKILL of the PID namespace at the timeout"}
        if backend.as_root:
            self.enforced["user"] = f"uid {backend.owner[0]} via setpriv"
        else:
            self.enforced["user"] = f"the calling user (uid {os.getuid()}) in a user namespace"
        self.cgroup: Cgroup | None = None
        self._argv: list[str] = []
        self._counter = itertools.count()
        self._closed = False
        self._lock = threading.Lock()
        self._running: dict[int, tuple[subprocess.Popen, _Status]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.hostdir = HostDir(self.spec, self.backend.base_dir, self.backend.forwarder, owner=self.backend.owner)
        self.host_workdir = self.hostdir.workspace
        self.host_home = self.hostdir.home
        if self.hostdir.quota is not None:
            self.enforced["disk"] = f"tmpfs of {self.hostdir.quota} bytes (workspace and home; /tmp, /dev/shm each)"
        if self.backend.use_cgroup:
            self.cgroup = Cgroup.create(self.spec.limits, self.backend.cgroups)
            if self.cgroup is not None:
                self.enforced.update(self.cgroup.enforced)
        self.enforced.update(rlimit_enforced(self.spec.limits))
        self._argv = self._bwrap_argv(forwarders=True)
        if self.backend.probe:
            # The probe checks that bwrap starts with these mounts and namespaces and that socat
            # exists, without starting the forwarders (they start with every run anyway): with them,
            # create+destroy with a port allowed cost 30-50 ms more in bench/bench_sandbox.py. Nor
            # does it join the cgroup, whose limits are no part of that check: on an idle host a
            # cgroup v1 attach waits for an RCU grace period, 10-20 ms here (bench/RESULTS.md).
            result = self._run(self._bwrap_argv(forwarders=False, join_cgroup=False), ["true"], None, 30, None)
            if result.exit_code != 0:
                raise SandboxError(f"sandbox probe failed: {result}")

    def _bwrap_argv(self, forwarders: bool, join_cgroup: bool = True) -> list[str]:
        spec, room, view, backend = self.spec, self._room, self.backend.view, self.backend
        disk = spec.limits.disk_bytes
        sized = ["--size", str(disk)] if disk is not None else []
        argv = [backend.bwrap] + view.system_argv
        argv += ["--dev", "/dev", "--proc", "/proc"]
        argv += ["--perms", "1777", *sized, "--tmpfs", "/tmp", "--perms", "1777", *sized, "--tmpfs", "/dev/shm"]
        argv += ["--tmpfs", "/run"]
        if room is not None:
            argv += ["--perms", _mode_of(room), "--tmpfs", room] + _copy_of(room)
        # After the rebuilt room, so that what it re-exposes of these stays covered.
        hidden = (backend.base_dir, *backend.hide_paths, *spec.hide_paths)
        # bwrap cannot make a mount point in a read-only bind, and a missing path hides nothing.
        argv += [arg for path in hidden if view.shows(path) and os.path.isdir(path) for arg in ("--tmpfs", path)]
        argv += view.cover_argv
        # bwrap would make the missing parents of a mount point mode 0700 (root's): the user could
        # not reach what is mounted there.
        for path in _parents_to_make([self.workdir, *spec.ro_binds.values()], view):
            argv += ["--perms", "0755", "--dir", path]
        argv += ["--bind", self.hostdir.workspace, self.workdir, "--bind", self.hostdir.home, HOMEDIR]
        if spec.allow_ports:
            argv += ["--ro-bind", self.hostdir.proxy, PROXYDIR]
        for host_path, target in spec.ro_binds.items():
            argv += ["--ro-bind", os.path.abspath(host_path), target]
        if room is not None:
            # Read-only like the host directory it stands for; not recursive, so what is mounted in
            # it stays as it is.
            argv += ["--remount-ro", room]
        argv += ["--remount-ro", "/"]
        if backend.as_root:
            # No user namespace: it would map the sandbox's uid to root's; setpriv switches instead.
            argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        else:
            argv += ["--unshare-all"]
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        chdir = self.workdir if backend.as_root else None
        inner = ["/bin/sh", "-c", start_script(spec, backend.socat or "socat", forwarders, chdir), "sh"]
        if backend.as_root:
            argv += [arg for cap in _SWITCH_CAPS for arg in ("--cap-add", cap)]
            uid, gid = backend.owner
            inner = [
                backend.setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
            ] + inner  # fmt: skip
        argv += ["--hostname", "sandbox"] + ([] if backend.as_root else ["--chdir", self.workdir]) + ["--"] + inner
        if self.cgroup is not None and join_cgroup:
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
        try:
            self.hostdir.hand_over()
        except OSError as exc:
            raise SandboxError(f"cannot hand the workspace to the sandbox user: {exc}") from exc
        stdin_path = os.path.join(self.hostdir.dir, f"run{n}.in")
        status_r, status_w = os.pipe()
        argv_full = list(bwrap_argv)
        # bwrap writes {"child-pid": N} (the namespace's init, as the host sees it) to this fd.
        i = argv_full.index("--die-with-parent")
        argv_full[i:i] = ["--json-status-fd", str(status_w)]
        capture = _Capture(self.spec.limits.max_output_bytes)
        try:
            stdin_f = None
            if stdin is not None:
                stdin_f = open(stdin_path, "wb+")
                stdin_f.write(stdin)
                stdin_f.seek(0)
            t0 = time.monotonic()
            # Started and registered under the lock that close() takes: a close() in between would
            # find nothing to kill and the cgroup still empty, while the launcher joined it a moment
            # later and outlived the sandbox.
            with self._lock:
                try:
                    if self._closed:
                        raise SandboxError("sandbox is closed")
                    proc = subprocess.Popen(
                        argv_full + argv,
                        stdin=stdin_f if stdin_f is not None else subprocess.DEVNULL,
                        stdout=capture.out_w,
                        stderr=capture.err_w,
                        env=full_env,
                        pass_fds=(status_w,),
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise SandboxError(f"cannot start bwrap: {exc}") from exc
                finally:
                    os.close(status_w)
                    capture.close_write_ends()
                    if stdin_f is not None:
                        stdin_f.close()
                status = _Status(status_r)
                self._running[n] = (proc, status)
            try:
                timed_out = not capture.pump_until_exit(proc, t0 + timeout)
                with self._lock:
                    # The cgroup holds every run of the sandbox: kill through it only when this run is
                    # the only one, else the PID namespace's init (this run's alone) does it.
                    alone = len(self._running) == 1
                cgroup = self.cgroup if alone else None
                if timed_out:
                    _kill_tree(proc, status, cgroup)
                _wait_namespace_gone(status, cgroup)
                capture.drain(time.monotonic() + KILL_GRACE_S)
            finally:
                with self._lock:
                    self._running.pop(n, None)
            duration = time.monotonic() - t0
            returncode = proc.returncode
        finally:
            os.close(status_r)
            capture.close()
            try:
                os.unlink(stdin_path)
            except FileNotFoundError:
                pass
        stdout, stdout_trunc = capture.result(capture.out_r)
        ready, stderr = split_ready(bytes(capture.data[capture.err_r]))
        cap = self.spec.limits.max_output_bytes
        stderr, stderr_trunc = stderr[:cap], len(stderr) > cap or capture.dropped[capture.err_r] > 0
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


def _room_for(workdir: str, view: RootView) -> str | None:
    """The directory to rebuild so that bwrap can make the mount point `workdir` (see the module
    docstring): its deepest ancestor that exists on the host, when that lies in a directory the view
    binds read-only; None when none is needed. ValueError when `workdir` or one of its ancestors there
    exists on the host as something other than a directory."""
    if any(workdir.startswith(d + "/") for d in TMPFS_DIRS):
        return None
    for link in view.system_paths:
        if workdir.startswith(link + "/") and link not in view.mounted:
            raise ValueError(f"SandboxSpec.workdir {workdir!r}: {link!r} is a symbolic link in the sandbox")
    top = next((p for p in view.mounted if workdir.startswith(p + "/")), None)
    if top is None:
        return None  # bwrap makes it in its own root tmpfs
    existing = top
    for part in workdir[len(top) + 1:].split("/"):
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


def _parents_to_make(targets: Sequence[str], view: RootView) -> list[str]:
    """The ancestors of `targets` that bwrap would make, outermost first, each once: those in its root
    tmpfs, in a private tmpfs (/tmp, /run) or in a rebuilt room, not those a view directory holds."""
    out: dict[str, None] = {}
    for target in targets:
        for path in ancestors(os.path.dirname(os.path.normpath(target))):
            if path in TMPFS_DIRS or path in view.system_paths or (view.shows(path) and os.path.isdir(path)):
                continue  # mounted by the sandbox itself, or present in a view directory
            out[path] = None
    return list(out)


def _copy_of(directory: str) -> list[str]:
    """bwrap arguments that show each entry of the host's `directory` at the same path, read-only:
    directories and files bound (`-try`: an entry removed after this listing is left out rather than
    failing every run), symlinks recreated, never followed."""
    argv = []
    try:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
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


class _Capture:
    """A run's stdout and stderr through pipes: the first `cap` bytes of each are kept (stderr's after
    the readiness marker), the rest read and dropped, so that a command printing without end costs
    the host neither disk nor memory."""

    def __init__(self, cap: int) -> None:
        self.out_r, self.out_w = os.pipe()
        self.err_r, self.err_w = os.pipe()
        self.keep = {self.out_r: cap + 1, self.err_r: cap + 1 + len(READY)}
        self.data = {self.out_r: bytearray(), self.err_r: bytearray()}
        self.dropped = {self.out_r: 0, self.err_r: 0}
        self.cap = cap
        self._open = {self.out_r, self.err_r}
        self._writers_closed = False

    def close_write_ends(self) -> None:
        if not self._writers_closed:
            os.close(self.out_w)
            os.close(self.err_w)
            self._writers_closed = True

    def pump_until_exit(self, proc: subprocess.Popen, deadline: float) -> bool:
        """Read output until `proc` exits (True; it is reaped) or `deadline` passes (False)."""
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd: look at the process every 50 ms
            pidfd = None
        try:
            while True:
                if self._pump(deadline, pidfd, 50 if pidfd is None else None) or proc.poll() is not None:
                    proc.wait()
                    return True
                if time.monotonic() >= deadline:
                    return False
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def drain(self, deadline: float) -> None:
        """Read what is left until every writer is gone (end of file on both pipes) or `deadline`."""
        while self._open and time.monotonic() < deadline:
            self._pump(deadline, None, None)

    def _pump(self, deadline: float, pidfd: int | None, tick_ms: int | None) -> bool:
        """One wait and read; True when `pidfd` turned readable (the process exited)."""
        poller = select.poll()
        for fd in self._open:
            poller.register(fd, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        wait_ms = max(0.0, deadline - time.monotonic()) * 1000
        exited = False
        for fd, _ in poller.poll(wait_ms if tick_ms is None else min(wait_ms, tick_ms)):
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._open.discard(fd)
                continue
            room = self.keep[fd] - len(self.data[fd])
            self.data[fd] += chunk[:max(room, 0)]
            self.dropped[fd] += max(len(chunk) - max(room, 0), 0)
        return exited

    def result(self, fd: int) -> tuple[bytes, bool]:
        data = bytes(self.data[fd])
        return data[: self.cap], len(data) > self.cap or self.dropped[fd] > 0

    def close(self) -> None:
        self.close_write_ends()
        for fd in (self.out_r, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass


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

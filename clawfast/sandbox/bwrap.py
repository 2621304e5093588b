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
- a seccomp filter (`clawfast.sandbox.seccomp`) under which add_key, request_key and keyctl fail: all
  sandboxes share one uid, and with it the kernel's user keyring, which outlives them;
- the command's environment set by `env -i` right before it, read from a file bwrap writes on the
  run's own /run (not a command line: host users can read those); the launcher (/bin/sh, bwrap, setpriv:
  host root processes as root) and the start script run with a fixed one (`LAUNCH_ENV`);
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
A `ro_binds` target missing on the host inside a system directory (e.g. /usr/local/harness) cannot be
made there (read-only): it is refused (ValueError from `create`) unless it lies in the workdir's rebuilt
directory; a target elsewhere (/opt/harness) is made in bwrap's root tmpfs.

`hide_paths` (the backend's and the spec's): each path is resolved on the host (`realpath`, so /lib/x
where /lib -> usr/lib is /usr/lib/x) and covered wherever the sandbox would show it: in a view directory
and inside each `ro_binds` source, at the bind's target. A directory is covered by an empty tmpfs, a
file by an unreadable empty file; a path that does not exist or that nothing shows needs nothing; one
that resolves to / is refused (ValueError). A `ro_binds` source inside a hidden directory is still
shown at its target: the bind asks for it explicitly.

Limits and how they are enforced (`Sandbox.enforced` lists what this host gives; what it cannot give is
logged once when the backend is made):
- memory, processes, CPU: a cgroup v2 or v1 group per sandbox (`clawfast.sandbox.cgroup`).
- disk: the workspace and home share a tmpfs of `Limits.disk_bytes` mounted on the host (root only),
  /tmp and /dev/shm are tmpfs of that size each.
- file size: RLIMIT_FSIZE (`ulimit -f` inside). stdout and stderr are pipes, which it does not bound:
  `Limits.max_output_bytes` bounds what the host keeps of them.
- address space: RLIMIT_AS (`ulimit -v`), only if `Limits.address_space_bytes` is set.
- wall time: the run's timeout; the sandbox's PID-namespace init is SIGKILLed, which makes the
  kernel kill every process of the namespace (daemonised, re-parented, new-session ones included);
  `run` returns only once all of them are gone.

Guaranteed besides: a command's environment never acts in a host-side process; runs in parallel in one
sandbox never end each other (the cgroup is killed through only at a run's timeout or error, and then
only while that run is the only one, under the lock new runs start under, or at `close`); any timeout
works (each poll() wait is capped); an exception while a run is watched kills the run before it
propagates; `close` (the backend's too) during a `create` waits for the start, then removes all of it.

Not guaranteed: on an architecture other than x86_64 and aarch64 there is no seccomp filter (logged
when the backend is made; no "keyring" in `Sandbox.enforced`), so sandboxes share the keyring. The
command's environment reaches the sandbox in a file, never on bwrap's or setpriv's command line, but
`env -i` holds it on its own for the instant before it execs the command: host users who list
processes at that instant can see it. That the sandbox user cannot make user namespaces of its own
(the host's setting decides; inside one it gains nothing over host files, which stay owned by users it is not). A SIGKILL
sent to the sandbox's init from outside reads as the command being killed (exit 137), like an OOM
kill; a killed `bwrap` process reads as `SandboxError`. If the owning Python process is killed (no
`close()`), `--die-with-parent` ends its sandboxes, except one whose bwrap was started within the ~1 ms
before bwrap arms its parent-death signal; such an orphan (when it has a cgroup), and the cgroups,
quota mounts and directories any killed owner leaves, are removed by the next `BwrapBackend` made on
the host (cgroup and directory names carry the owner's pid).
"""

from __future__ import annotations

import itertools
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

from clawfast.sandbox.base import SANDBOX_UID, Sandbox, SandboxError
from clawfast.sandbox.bwrap_argv import (SWITCH_CAPS, check_bind_targets, copy_of, hide_argv, mode_of, parents_to_make,
                                         room_for)
from clawfast.sandbox.bwrap_supervise import KILL_GRACE_S, Capture, StatusPipe, kill_tree, wait_namespace_gone
from clawfast.sandbox.cgroup import Cgroup, CgroupHost, sweep_stale
from clawfast.sandbox.hostdir import (ForwardingBackend, HostDir, log, merge_env, remove_tree, split_ready,
                                      start_script, sweep_stale_dirs)
from clawfast.sandbox.result import EXIT_FILE_SIZE, RunResult
from clawfast.sandbox.seccomp import DENIED, program as seccomp_program
from clawfast.sandbox.spec import HOMEDIR, PROXYDIR, WORKDIR, SandboxSpec, rlimit_enforced
from clawfast.sandbox.view import SYSTEM_PATHS, RootView


# What the host-side launcher (/bin/sh, bwrap, setpriv) runs with: fixed, nothing of the command's.
LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# Where each run's environment file lies inside (bwrap writes it there: `env_exec_line`), and
# what runs last, in place of the command, to exec the command under exactly that environment.
ENV_FILE = "/run/.clawfast-env"
ENV_EXEC = f". {ENV_FILE}"


def memory_file(name: str, data: bytes) -> int:
    """A descriptor of an anonymous in-memory file holding `data`, at its start: what bwrap's
    ``--file FD`` and ``--seccomp FD`` read to their end (no size limit, unlike a pipe written in full
    before its reader starts)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def env_exec_line(env_path: str, env: Mapping[str, str]) -> bytes:
    """The line `ENV_EXEC` sources: exec the command ("$@") under `env` alone. bwrap writes it to
    `ENV_FILE` (``--file``, on the run's own /run tmpfs). Only this exec of `env` holds the values on
    its command line, for the instant before it execs the command; bwrap's, setpriv's and the
    shells' command lines never do."""
    pairs = " ".join(shlex.quote(f"{key}={value}") for key, value in env.items())
    return f'exec {shlex.quote(env_path)} -i -- {pairs} "$@"\n'.encode()


class BwrapSandbox(Sandbox):
    def __init__(self, backend: BwrapBackend, spec: SandboxSpec) -> None:
        super().__init__(backend, spec)
        self.workdir = spec.workdir or WORKDIR
        # The directory rebuilt to make room for the workdir, or None (`room_for`). Checked before
        # anything exists on the host, so a refused workdir leaves nothing to clean up.
        self.room = room_for(self.workdir, backend.view)
        # The covers of the hidden paths, before and after the ro_binds (`hide_argv`); also checked
        # before anything exists on the host. The backend's own directory is never visible either.
        hidden = (backend.base_dir, *backend.hide_paths, *spec.hide_paths)
        self.hide_in_view, self.hide_in_binds = hide_argv(hidden, backend.view, spec.ro_binds)
        check_bind_targets(list(spec.ro_binds.values()), backend.view, self.room, hidden)
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
        self._running: dict[int, tuple[subprocess.Popen, StatusPipe]] = {}

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
        if self.backend.seccomp is not None:
            self.enforced["keyring"] = f"seccomp: {', '.join(DENIED)} fail with EPERM"
        self._argv = self._launch_argv(forwarders=True)
        if self.backend.probe:
            # The probe checks that bwrap starts with these mounts and namespaces and that socat
            # exists, without starting the forwarders (they start with every run anyway): with them,
            # create+destroy with a port allowed cost 30-50 ms more in bench/bench_sandbox.py. Nor
            # does it join the cgroup, whose limits are no part of that check: on an idle host a
            # cgroup v1 attach waits for an RCU grace period, 10-20 ms here (bench/RESULTS.md).
            result = self._run(self._launch_argv(forwarders=False, join_cgroup=False), ["true"], None, 30, None)
            if result.exit_code != 0:
                raise SandboxError(f"sandbox probe failed: {result}")

    def _launch_argv(self, *, forwarders: bool, join_cgroup: bool = True) -> list[str]:
        """The command line that starts one run of this sandbox (its command comes after it). `forwarders`:
        start the proxy forwarders inside; `join_cgroup`: join the sandbox's cgroup first."""
        spec, room, view, backend = self.spec, self.room, self.backend.view, self.backend
        disk = spec.limits.disk_bytes
        sized = ["--size", str(disk)] if disk is not None else []
        argv = [backend.bwrap] + view.system_argv
        argv += ["--dev", "/dev", "--proc", "/proc"]
        argv += ["--perms", "1777", *sized, "--tmpfs", "/tmp", "--perms", "1777", *sized, "--tmpfs", "/dev/shm"]
        argv += ["--tmpfs", "/run"]
        if room is not None:
            argv += ["--perms", mode_of(room), "--tmpfs", room] + copy_of(room)
        # After the rebuilt room, so that what it re-exposes of these stays covered.
        argv += self.hide_in_view
        argv += view.cover_argv
        # bwrap would make the missing parents of a mount point mode 0700 (root's): the user could
        # not reach what is mounted there.
        for path in parents_to_make([self.workdir, *spec.ro_binds.values()], view):
            argv += ["--perms", "0755", "--dir", path]
        argv += ["--bind", self.hostdir.workspace, self.workdir, "--bind", self.hostdir.home, HOMEDIR]
        if spec.allow_ports:
            argv += ["--ro-bind", self.hostdir.proxy, PROXYDIR]
        for host_path, target in spec.ro_binds.items():
            argv += ["--ro-bind", os.path.abspath(host_path), target]
        # On what the binds show, so after them.
        argv += self.hide_in_binds
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
        # The command's environment is set last, by `env -i` right before the command: the launcher,
        # bwrap, setpriv (as root these are host root processes) and the start script (whose stderr
        # must begin with the readiness marker) run with `LAUNCH_ENV`, so that no LD_PRELOAD or other
        # variable of the command acts in them. It comes in a file (`_run` adds it), not on a command
        # line: host users can read every process's command line.
        inner += ["/bin/sh", "-c", ENV_EXEC, "sh"]
        if backend.as_root:
            argv += [arg for cap in SWITCH_CAPS for arg in ("--cap-add", cap)]
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

    def _in_flight(self) -> list[tuple[subprocess.Popen, StatusPipe]]:
        return list(self._running.values())

    def _stop(self, in_flight: list[tuple[subprocess.Popen, StatusPipe]]) -> None:
        for proc, status in in_flight:
            kill_tree(proc, status, self.cgroup)
        if self.cgroup is not None:
            self.cgroup.destroy()

    def _remove(self) -> None:
        if self.hostdir is not None:
            self.hostdir.close()

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
        if "=" in argv[0]:
            # env would take a program named a=b for one more variable: a shell runs it instead.
            argv = ["/bin/sh", "-c", 'exec "$@"', "sh"] + argv
        # bwrap writes {"child-pid": N} (the namespace's init, as the host sees it) to this fd.
        i = argv_full.index("--die-with-parent")
        argv_full[i:i] = ["--json-status-fd", str(status_w)]
        capture = Capture(self.spec.limits.max_output_bytes)
        filter_r = env_r = None
        try:
            stdin_f = None
            if stdin is not None:
                stdin_f = open(stdin_path, "wb+")
                stdin_f.write(stdin)
                stdin_f.seek(0)
            counts = self._limit_counts()
            t0 = time.monotonic()
            # Started and registered under the lock that close() takes: a close() in between would
            # find nothing to kill and the cgroup still empty, while the launcher joined it a moment
            # later and outlived the sandbox.
            with self._lock:
                try:
                    if self._closed:
                        raise SandboxError("sandbox is closed")
                    env_r = memory_file("clawfast-env", env_exec_line(self.backend.env, full_env))
                    # Readable by the sandbox's user, whose own environment it holds; the run's /run
                    # is its own tmpfs, so no other run sees it.
                    argv_full[i:i] = ["--perms", "0444", "--file", str(env_r), ENV_FILE]
                    pass_fds = [status_w, env_r]
                    if self.backend.seccomp is not None:
                        filter_r = memory_file("clawfast-seccomp", self.backend.seccomp)
                        argv_full[i:i] = ["--seccomp", str(filter_r)]
                        pass_fds.append(filter_r)
                    proc = subprocess.Popen(
                        argv_full + argv,
                        stdin=stdin_f if stdin_f is not None else subprocess.DEVNULL,
                        stdout=capture.out_w,
                        stderr=capture.err_w,
                        env=LAUNCH_ENV,
                        pass_fds=pass_fds,
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise SandboxError(f"cannot start bwrap: {exc}") from exc
                finally:
                    os.close(status_w)
                    for fd in (filter_r, env_r):
                        if fd is not None:
                            os.close(fd)
                    capture.close_write_ends()
                    if stdin_f is not None:
                        stdin_f.close()
                status = StatusPipe(status_r)
                self._running[n] = (proc, status)
            try:
                timed_out = not capture.pump_until_exit(proc, t0 + timeout)
                if timed_out:
                    self._kill_run(proc, status)
                # After the command exited by itself, its namespace's init takes the rest of the run
                # with it (--die-with-parent): no cgroup kill here, the cgroup holds other threads'
                # runs too.
                wait_namespace_gone(status)
                capture.drain(time.monotonic() + KILL_GRACE_S)
            except BaseException:
                # Whatever went wrong here (KeyboardInterrupt included), the run must not outlive it.
                self._kill_run(proc, status)
                raise
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
            limit=self._limit_hit(counts, returncode, timed_out),
        )

    def _kill_run(self, proc: subprocess.Popen, status: StatusPipe) -> None:
        """End one run (its timeout, or an error while it ran) and whatever it started."""
        kill_tree(proc, status, None)
        with self._lock:
            # An init that bwrap had not reported yet escapes `kill_tree`; the cgroup holds it. The
            # cgroup holds every run of the sandbox, so it is killed only while this run is the only
            # one registered, and under the lock a new run starts under, so none joins meanwhile.
            if self.cgroup is not None and list(self._running.values()) == [(proc, status)]:
                self.cgroup.kill_all(KILL_GRACE_S)

    def _limit_counts(self) -> tuple[int, int]:
        """The cgroup's OOM kills and refused forks so far (zeros without a cgroup)."""
        if self.cgroup is None:
            return 0, 0
        return self.cgroup.oom_kills(), self.cgroup.fork_refusals()

    def _limit_hit(self, before: tuple[int, int], returncode: int | None, timed_out: bool) -> str | None:
        """Which limit the run ran into (`RunResult.limit`). The cgroup's counters are the sandbox's, so
        with runs in parallel a kill is put on each run that saw it."""
        if timed_out:
            return "time"
        oom, forks = self._limit_counts()
        if oom > before[0]:
            return "memory"
        if forks > before[1]:
            return "processes"
        if returncode == EXIT_FILE_SIZE:
            return "file size"
        if returncode and self.hostdir.quota is not None:
            fs = os.statvfs(self.hostdir.data)
            # A failed command beside a full workspace filesystem: what is left is less than a page.
            if fs.f_bavail * fs.f_frsize < 4096:
                return "disk"
        return None


class BwrapBackend(ForwardingBackend):
    """Options:
    base_dir: where sandbox directories are made (default: the system temp dir; a relative one is made
        absolute at once). It is never visible inside. A tmpfs such as /dev/shm makes create+destroy cheaper where the disk is slow (each
        rmdir was ~2.4 ms on this machine's ext4).
    use_cgroup: create a per-sandbox cgroup for memory/process/CPU limits when the host allows it.
    probe: start `true` in every new sandbox so that `create` fails (SandboxError) rather than the
        first real command; costs one sandbox start (see bench/bench_sandbox.py).
    hide_paths: host paths to cover wherever the sandbox would show them (see the module docstring;
        ValueError for one that cannot be hidden).
    uid: the host uid (and gid) sandboxed processes run as when this process is root.
    system_paths: the host directories shown read-only (see `clawfast.sandbox.view`).
    """

    name = "bwrap"
    sandbox_type = BwrapSandbox

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
        self.hide_paths = tuple(os.path.normpath(p) for p in hide_paths)
        self.use_cgroup = use_cgroup
        self.probe = probe
        self.as_root = os.geteuid() == 0
        # Who the sandbox runs as: (uid, gid) to hand its files to, or None for this process's own user.
        self.owner = (uid, uid) if self.as_root else None
        # The filter every sandbox runs under (`clawfast.sandbox.seccomp`); None on an architecture
        # it does not know, said once here.
        self.seccomp = seccomp_program()
        if self.seccomp is None:
            log.warning("clawfast bwrap backend: kernel keyrings NOT closed (no seccomp filter for %s)",
                        platform.machine())
        self.env = shutil.which("env", path="/usr/bin:/bin")
        if self.env is None:
            raise SandboxError("the bwrap backend needs env (coreutils) in /usr/bin or /bin")
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
        # Absolute: a relative one would name another directory once the process changed directory
        # (every run would fail, and close() would leave the quota mounts).
        self.base_dir = os.path.abspath(tempfile.mkdtemp(prefix=f"clawfast-sandbox-{os.getpid()}-", dir=base_dir))
        try:
            view_dir = os.path.join(self.base_dir, "view")
            os.mkdir(view_dir)
            uid_inside = uid if self.as_root else os.getuid()
            self.view = RootView(view_dir, uid_inside, uid_inside if self.as_root else os.getgid(), system_paths)
            hide_argv(self.hide_paths, self.view, {})  # a path that cannot be hidden: ValueError now
        except BaseException:
            remove_tree(self.base_dir)
            raise
        super().__init__()

    def _check_spec(self, spec: SandboxSpec) -> None:
        if spec.allow_ports and self.socat is None:
            raise SandboxError("allow_ports needs socat inside the sandbox (Debian: apt-get install socat)")

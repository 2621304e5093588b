"""The sandbox contract: one isolated workspace per rollout, commands run inside it, files read back.

A `SandboxBackend` turns a `SandboxSpec` into a started `Sandbox` (or raises `SandboxError`). A
`Sandbox` runs commands (`run` -> `RunResult`), exposes its workspace for scoring (`read_file`,
`read_files`) and is destroyed by `close()`. The concrete backends (`bwrap`, `docker`, `local`) say in
their own docstrings what they isolate and which limits they enforce; this module holds what they share.

Guaranteed by every backend:
- `SandboxError` means the sandbox itself failed (did not start, died, its forwarder broke), never that
  the command failed: a command's failure is a `RunResult` with its exit code. Callers mark the rollout
  `sandbox_error` on the former and score the latter.
- `run` returns within `timeout` plus a bounded kill grace; on timeout the whole process tree of the
  command is killed and `timed_out` is set.
- `close()` is idempotent and leaves no process, mount or temporary directory behind.
- Files are read back without following symbolic links, so a sandbox cannot make the host read a file
  outside its workspace.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import os
import select
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import PurePosixPath

# Where the workspace (unless `SandboxSpec.workdir` says otherwise), the private home and the proxy
# sockets appear inside the isolating backends (bwrap, docker). The local backend uses the host paths
# instead.
WORKDIR = "/run/ws"
HOMEDIR = "/run/home"
PROXYDIR = "/run/proxy"
RESERVED_TARGETS = (WORKDIR, HOMEDIR, PROXYDIR)
# What the isolating backends mount themselves: a workspace may not cover or sit inside the first, and
# may lie under the second (their private tmpfs) but not replace them.
SYSTEM_DIRS = ("/proc", "/dev", "/sys")
TMPFS_DIRS = ("/tmp", "/run")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The host uid and gid every sandboxed process runs as when clawfast runs as root (the isolating
# backends' `uid` option changes it). Not a login account: outside the ranges Debian gives to users
# (1000-59999) and to system accounts, so no host file belongs to it unless a sandbox wrote it. Inside
# it is called "agent" (see clawfast.sandbox.view).
SANDBOX_UID = 61000

MiB = 1 << 20
GiB = 1 << 30


class SandboxError(RuntimeError):
    """The sandbox failed to start, died, or lost its proxy forwarder. The rollout is `sandbox_error`."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. `None` disables a limit. Which ones a backend actually enforces,
    and by what mechanism, is reported per sandbox in `Sandbox.enforced` (see the backend docstrings).

    memory_bytes: memory of all processes together (a cgroup memory limit; the OOM killer ends the
        largest process when it is exceeded).
    max_processes: number of processes/threads alive at once (a pids cgroup).
    max_file_bytes: largest file any process may write (RLIMIT_FSIZE; captured stdout/stderr count too,
        a process that exceeds it gets SIGXFSZ).
    disk_bytes: size of each filesystem the sandbox can write: the workspace and private home together
        (one sized tmpfs on the host), and its /tmp and /dev/shm (each its own). A write past it fails
        with ENOSPC. The pages are RAM, charged to the sandbox's memory limit when it writes them.
    cpus: CPU time as a number of cores (a cgroup CPU quota: 0.5 is half of one core); None: no quota.
    address_space_bytes: RLIMIT_AS per process. Off by default because V8 (Node harnesses) reserves
        tens of GiB of virtual address space it never touches.
    max_output_bytes: how much of stdout and of stderr `RunResult` carries; the rest is dropped and
        the `*_truncated` flag set.
    """

    memory_bytes: int | None = 4 * GiB
    max_processes: int | None = 1024
    max_file_bytes: int | None = 1 * GiB
    disk_bytes: int | None = 4 * GiB
    cpus: float | None = None
    address_space_bytes: int | None = None
    max_output_bytes: int = 8 * MiB

    def validate(self) -> None:
        for name in ("memory_bytes", "max_processes", "max_file_bytes", "disk_bytes", "address_space_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"Limits.{name} must be a positive int or None, got {value!r}")
        if self.cpus is not None and (isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float))
                                      or not 0.01 <= self.cpus <= 4096):
            raise ValueError(f"Limits.cpus must be a number of cores between 0.01 and 4096 or None, got {self.cpus!r}")
        if not isinstance(self.max_output_bytes, int) or self.max_output_bytes < 0:
            raise ValueError(f"Limits.max_output_bytes must be an int >= 0, got {self.max_output_bytes!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox starts from.

    files: workspace files, relative POSIX path -> content (bytes, or str written as UTF-8).
    source_dir: a host directory copied into the workspace first (symlinks copied as links);
        `files` are written over it.
    home_files: files of the private HOME, same form as `files` (harness configs such as
        `.codex/config.toml`).
    allow_ports: TCP ports of host loopback services (the proxy) the sandbox may reach, each at the
        same port on its own 127.0.0.1 (IPv4 only: give harnesses `http://127.0.0.1:PORT`, not
        `localhost`, which Node may resolve to ::1). Nothing else on the network is reachable.
    ro_binds: host path -> absolute path inside, bound read-only (e.g. the harness install at
        /run/harness). Not allowed on /, nor on or under /run/ws, /run/home, /run/proxy.
    env: environment of every command (the host environment is never inherited); `run(env=...)` adds
        to it. PATH, HOME and TMPDIR have defaults.
    limits: see `Limits`.
    default_timeout: seconds, for `run` calls that give none.
    name: a label (e.g. the rollout id) used in temporary directory and container names.
    workdir: the absolute path inside where the workspace is mounted read-write and where commands
        start (None: /run/ws), for tasks whose files name their workspace's absolute path (e.g.
        /root/.openclaw/workspace). It must be normalised, and may not be / or /tmp or /run themselves
        (a path under /tmp or /run is fine), lie on or under /proc, /dev or /sys, or lie on, under or
        above /run/home, /run/proxy or a `ro_binds` target. The local backend refuses it (it cannot
        place a workspace at an absolute path); the others leave the rest of the sandbox's filesystem
        as it is without one (see each backend's docstring).
    hide_paths: host directories the sandbox must not see (a task suite's own folder, which holds
        its verifiers' files); absolute and normalised, not /. bwrap's minimal root shows no host
        directory outside its system paths anyway (docs/SANDBOX.md); one inside them is covered by an
        empty tmpfs. A path that does not exist on the host has nothing to hide and is skipped. A
        docker container sees its image, and the local backend (no isolation) sees everything.
    """

    files: Mapping[str, bytes | str] = field(default_factory=dict)
    source_dir: str | None = None
    home_files: Mapping[str, bytes | str] = field(default_factory=dict)
    allow_ports: tuple[int, ...] = ()
    ro_binds: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    default_timeout: float = 600.0
    name: str = "sandbox"
    workdir: str | None = None
    hide_paths: tuple[str, ...] = ()

    def validate(self) -> None:
        for label, files in (("files", self.files), ("home_files", self.home_files)):
            for path, content in files.items():
                check_relative_path(path, what=f"SandboxSpec.{label} key")
                if not isinstance(content, (bytes, str)):
                    raise ValueError(f"SandboxSpec.{label}[{path!r}] must be bytes or str")
        if self.source_dir is not None and not os.path.isdir(self.source_dir):
            raise ValueError(f"SandboxSpec.source_dir {self.source_dir!r} is not a directory")
        if len(set(self.allow_ports)) != len(self.allow_ports):
            raise ValueError(f"SandboxSpec.allow_ports has duplicates: {self.allow_ports}")
        for port in self.allow_ports:
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"SandboxSpec.allow_ports: {port!r} is not a TCP port")
        for host_path, target in self.ro_binds.items():
            if not os.path.exists(host_path):
                raise ValueError(f"SandboxSpec.ro_binds: host path {host_path!r} does not exist")
            norm = os.path.normpath(target)
            if not target.startswith("/") or norm == "/":
                raise ValueError(f"SandboxSpec.ro_binds: target {target!r} must be an absolute path other than /")
            for reserved in RESERVED_TARGETS:
                if norm == reserved or norm.startswith(reserved + "/"):
                    raise ValueError(f"SandboxSpec.ro_binds: target {target!r} is reserved ({reserved})")
        if self.workdir is not None:
            check_workdir(self.workdir, [os.path.normpath(t) for t in self.ro_binds.values()])
        for path in self.hide_paths:
            if not isinstance(path, str) or not path.startswith("/") or os.path.normpath(path) != path or path == "/":
                raise ValueError(f"SandboxSpec.hide_paths: {path!r} must be a normalised absolute path other than /")
            if any(_on_or_under(path, d) for d in ("/proc", "/dev")):
                raise ValueError(f"SandboxSpec.hide_paths: {path!r} lies on or under /proc or /dev")
        for key, value in self.env.items():
            check_env_entry(key, value)
        if not self.default_timeout > 0:
            raise ValueError(f"SandboxSpec.default_timeout must be > 0, got {self.default_timeout!r}")
        if not self.name or "/" in self.name or "\0" in self.name:
            raise ValueError(f"SandboxSpec.name {self.name!r} must be a non-empty label without '/'")
        self.limits.validate()


@dataclass
class RunResult:
    """The outcome of one command.

    exit_code: the command's exit status; 128+N when signal N ended it (the shell convention; e.g. 137
        after the OOM killer); None when it was killed for running past its timeout.
    stdout, stderr: what it wrote, at most `Limits.max_output_bytes` of each (the beginning).
    timed_out: the command ran past `timeout` and its whole process tree was killed.
    duration_s: wall time from start to exit (or kill), including sandbox start-up.
    stdout_truncated, stderr_truncated: output beyond the cap was dropped.
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def check_relative_path(path: str, *, what: str = "path") -> PurePosixPath:
    """A workspace-relative path: non-empty, relative, no '..', no NUL. Returns it normalised."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"{what} {path!r} must be a non-empty string")
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or str(p) == ".":
        raise ValueError(f"{what} {path!r} must be relative and stay inside the workspace")
    return p


def check_workdir(workdir: str, ro_targets: Sequence[str]) -> None:
    """ValueError unless `workdir` is a place the isolating backends can mount a workspace at (see
    `SandboxSpec.workdir`); `ro_targets` are the normalised `ro_binds` targets."""
    what = f"SandboxSpec.workdir {workdir!r}"
    if not isinstance(workdir, str) or "\0" in workdir:
        raise ValueError(f"{what} must be a str without NUL")
    # normpath keeps a leading '//' (POSIX leaves its meaning open), so it is refused separately.
    if not workdir.startswith("/") or workdir.startswith("//") or os.path.normpath(workdir) != workdir:
        raise ValueError(f"{what} must be a normalised absolute path")
    if workdir == "/":
        raise ValueError(f"{what}: the workspace cannot replace the whole filesystem")
    if workdir in TMPFS_DIRS:
        raise ValueError(f"{what} is a private tmpfs of every sandbox; a directory under it is fine")
    for system in SYSTEM_DIRS:
        if _on_or_under(workdir, system):
            raise ValueError(f"{what} lies on or under {system}, which the sandbox mounts itself")
    for reserved in (HOMEDIR, PROXYDIR):
        if _on_or_under(workdir, reserved) or _on_or_under(reserved, workdir):
            raise ValueError(f"{what} overlaps {reserved}, which is reserved")
    for target in ro_targets:
        if _on_or_under(workdir, target) or _on_or_under(target, workdir):
            raise ValueError(f"{what} overlaps the ro_binds target {target!r}")


def _on_or_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + "/")


def check_env_entry(key: str, value: str) -> None:
    if not isinstance(key, str) or not key or "=" in key or "\0" in key:
        raise ValueError(f"environment variable name {key!r} is invalid")
    if not isinstance(value, str) or "\0" in value:
        raise ValueError(f"environment variable {key} must be a str without NUL")


def check_command(cmd: Sequence[str]) -> list[str]:
    if isinstance(cmd, (str, bytes)) or not cmd:
        raise ValueError("command must be a non-empty list of arguments (use ['sh', '-c', ...] for a shell line)")
    out = list(cmd)
    for arg in out:
        if not isinstance(arg, str) or "\0" in arg:
            raise ValueError(f"command argument {arg!r} must be a str without NUL")
    return out


def write_files(root: str, files: Mapping[str, bytes | str]) -> None:
    """Write `files` under `root`, refusing to follow symlinks the sandbox may have planted."""
    for rel, content in files.items():
        p = check_relative_path(rel)
        parent = root
        for part in p.parts[:-1]:
            parent = os.path.join(parent, part)
            if os.path.islink(parent):
                raise ValueError(f"cannot write {rel!r}: {part!r} is a symbolic link")
            os.makedirs(parent, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        fd = os.open(os.path.join(root, *p.parts), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def populate(root: str, source_dir: str | None, files: Mapping[str, bytes | str]) -> None:
    os.makedirs(root, exist_ok=True)
    if source_dir is not None:
        shutil.copytree(source_dir, root, symlinks=True, dirs_exist_ok=True)
    write_files(root, files)


def read_file(root: str, path: str) -> bytes:
    """Read one regular file under `root` without following any symlink (FileNotFoundError if absent,
    ValueError if it is not a regular file or a component is a link)."""
    p = check_relative_path(path)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in p.parts[:-1]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except NotADirectoryError:
                raise ValueError(f"{path!r}: {part!r} is not a directory") from None
            except OSError as exc:
                if exc.errno == 40:  # ELOOP: the component is a symlink
                    raise ValueError(f"{path!r}: {part!r} is a symbolic link") from None
                raise
            os.close(dir_fd)
            dir_fd = nxt
        try:
            fd = os.open(p.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == 40:
                raise ValueError(f"{path!r} is a symbolic link") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path!r} is not a regular file")
            return f.read()
    finally:
        os.close(dir_fd)


def read_tree(root: str, max_total_bytes: int) -> dict[str, bytes]:
    """Every regular file under `root` (symlinks and special files skipped), relative path -> bytes."""
    out: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            if total > max_total_bytes:
                raise ValueError(f"workspace holds more than {max_total_bytes} bytes; read files by path")
            rel = os.path.relpath(full, root)
            out[rel] = read_file(root, rel)
    return out


def warm_key(spec: SandboxSpec) -> SandboxSpec:
    """What a sandbox must have been started with to be handed out for `spec` after `provision`."""
    return dataclasses.replace(spec, files={}, source_dir=None, home_files={}, name="warm")


def capped_result(
    exit_code: int | None, stdout: bytes, stderr: bytes, cap: int, *, timed_out: bool, duration_s: float
) -> RunResult:
    """A RunResult keeping the first `cap` bytes of each output; pass a little more than `cap` of each
    so that truncation is detected."""
    return RunResult(
        exit_code=exit_code,
        stdout=stdout[:cap],
        stderr=stderr[:cap],
        timed_out=timed_out,
        duration_s=duration_s,
        stdout_truncated=len(stdout) > cap,
        stderr_truncated=len(stderr) > cap,
    )


def rlimit_enforced(limits: Limits) -> dict[str, str]:
    """The `Sandbox.enforced` entries of the limits a backend applies with `ulimit` before the command."""
    enforced = {}
    if limits.max_file_bytes is not None:
        enforced["file_size"] = "RLIMIT_FSIZE"
    if limits.address_space_bytes is not None:
        enforced["address_space"] = "RLIMIT_AS"
    return enforced


def wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for `proc` to exit (and reap it); False if it still runs after `timeout` seconds.

    Popen.wait(timeout) polls with sleeps that grow to 50 ms, which added ~8 ms to every 25 ms sandbox
    start in bench/bench_sandbox.py; a pidfd wakes exactly at exit."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # old kernel or Python without pidfd: fall back to polling
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                return False
    finally:
        os.close(fd)
    proc.wait()
    return True


class Sandbox(abc.ABC):
    """One started sandbox. Thread-safe for `run` from several threads; `close` ends everything.

    workdir: the workspace as commands see it (the initial directory of every command; the spec's
        `workdir` where it has one).
    home: HOME as commands see it.
    host_workdir: the same workspace on the host (read it only while no command runs).
    host_home: the private home on the host.
    enforced: limit name -> how it is enforced here (e.g. {"memory": "cgroup v2 memory", "user": "uid 61000 via setpriv"});
        a limit absent from the dict is not enforced by this sandbox.
    """

    spec: SandboxSpec
    workdir: str
    home: str
    host_workdir: str
    host_home: str
    enforced: dict[str, str]
    # Set by SandboxPool so that `arun` never competes for the small default executor.
    executor: Executor | None = None

    def run(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> RunResult:
        """Run `cmd` (argv, no shell) in `workdir`. Raises SandboxError if the sandbox failed,
        ValueError on a bad command or a timeout that is not > 0 (None: the spec's default)."""
        argv = check_command(cmd)
        timeout = self.spec.default_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        return self._run_command(argv, env, timeout, stdin)

    @abc.abstractmethod
    def _run_command(
        self, argv: list[str], env: Mapping[str, str] | None, timeout: float, stdin: bytes | None
    ) -> RunResult:
        """`run` after its arguments were checked: the backend's way of running one command."""

    async def arun(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> RunResult:
        """`run` in an executor thread (the pool's, if this sandbox came from a pool)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, lambda: self.run(cmd, env=env, timeout=timeout, stdin=stdin)
        )

    def read_file(self, path: str) -> bytes:
        """A workspace file by relative path (no symlinks followed)."""
        return read_file(self.host_workdir, path)

    def read_files(self, paths: Sequence[str] | None = None, *, max_total_bytes: int = 256 * MiB) -> dict[str, bytes]:
        """The given workspace files (missing ones omitted), or every regular file when `paths` is None."""
        if paths is None:
            return read_tree(self.host_workdir, max_total_bytes)
        out = {}
        for path in paths:
            try:
                out[path] = self.read_file(path)
            except FileNotFoundError:
                pass
        return out

    def provision(self, spec: SandboxSpec) -> None:
        """Add `spec`'s source_dir, files and home_files to this (empty, idle) sandbox and adopt `spec`.
        Only for a sandbox made from a spec equal to `spec` but for those fields (the warm pool)."""
        if warm_key(spec) != warm_key(self.spec):
            raise ValueError("provision: the spec differs in more than files/source_dir/home_files/name")
        populate(self.host_workdir, spec.source_dir, spec.files)
        populate(self.host_home, None, spec.home_files)
        self.spec = spec

    def write_files(self, files: Mapping[str, bytes | str]) -> None:
        """Add or overwrite workspace files (e.g. a verifier's tests after the harness ran)."""
        write_files(self.host_workdir, files)

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once `close` ran."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill everything still running, remove every temporary file. Idempotent. Raises OSError only
        when something could not be removed (a cgroup whose processes would not die, a container the
        engine would not delete); a command still running in another thread gets SandboxError."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SandboxBackend(abc.ABC):
    """Creates sandboxes of one kind. `close()` releases backend-wide resources (forwarder thread,
    Docker client) and closes sandboxes still open."""

    name: str

    def __init__(self) -> None:
        # The sandboxes created and not yet closed, so that `close()` can close them.
        self._live: set[Sandbox] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _check_can_create(self, spec: SandboxSpec) -> None:
        """ValueError on a bad spec, SandboxError once the backend is closed."""
        spec.validate()
        if self._closed:
            raise SandboxError("backend is closed")

    def _start_tracked(self, sandbox: Sandbox, start: Callable[[], None]) -> None:
        """Remember `sandbox` as live and call `start`; if that raises, close the sandbox and re-raise."""
        with self._lock:
            self._live.add(sandbox)
        try:
            start()
        except BaseException:
            sandbox.close()
            raise

    def forget(self, sandbox: Sandbox) -> None:
        """Called by a sandbox's `close()`: it is no longer live."""
        with self._lock:
            self._live.discard(sandbox)

    def _close_live(self) -> bool:
        """Mark the backend closed and close its live sandboxes. False if it was already closed."""
        if self._closed:
            return False
        self._closed = True
        with self._lock:
            live = list(self._live)
        for sandbox in live:
            sandbox.close()
        return True

    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> Sandbox:
        """Provision and start a sandbox; SandboxError if it cannot start, ValueError on a bad spec."""

    @abc.abstractmethod
    def close(self) -> None:
        """Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

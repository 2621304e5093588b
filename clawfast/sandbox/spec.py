"""What a sandbox starts from: `SandboxSpec`, its `Limits`, and the paths inside that they name.

A spec is plain data, checked by `validate()` (ValueError naming the bad field) before any backend
makes anything of it; `clawfast.sandbox.base` says what a backend does with it. The paths below are
where the isolating backends (bwrap, docker) place things inside a sandbox, and a spec's own paths are
checked against them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
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

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. `None` disables a limit. Which ones a backend actually enforces,
    and by what mechanism, is reported per sandbox in `Sandbox.enforced` (see the backend docstrings).

    memory_bytes: memory of all processes together (a cgroup memory limit; the OOM killer ends the
        largest process when it is exceeded).
    max_processes: number of processes/threads alive at once (a pids cgroup).
    max_file_bytes: largest file any process may write (RLIMIT_FSIZE: a process that exceeds it gets
        SIGXFSZ). stdout and stderr are pipes, not files: `max_output_bytes` bounds them instead.
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


def rlimit_enforced(limits: Limits) -> dict[str, str]:
    """The `Sandbox.enforced` entries of the limits a backend applies with `ulimit` before the command."""
    enforced = {}
    if limits.max_file_bytes is not None:
        enforced["file_size"] = "RLIMIT_FSIZE"
    if limits.address_space_bytes is not None:
        enforced["address_space"] = "RLIMIT_AS"
    return enforced


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
        /run/harness). Not allowed on /, nor on or under /run/ws, /run/home, /run/proxy. bwrap also
        refuses (ValueError from `create`) a target missing on the host inside a read-only system
        directory (/usr/local/harness where the host has none): use /opt/... or /run/... instead.
    env: environment of every command (the host environment is never inherited); `run(env=...)` adds
        to it. PATH, HOME and TMPDIR have defaults.
    limits: see `Limits`.
    default_timeout: seconds, for `run` calls that give none.
    name: a label (e.g. the rollout id) used in temporary directory and container names; only its first
        32 bytes are (`name_label`: a longer one would not fit in a directory name or a socket path).
    workdir: the absolute path inside where the workspace is mounted read-write and where commands
        start (None: /run/ws), for tasks whose files name their workspace's absolute path (e.g.
        /root/.openclaw/workspace). It must be normalised, and may not be / or /tmp or /run themselves
        (a path under /tmp or /run is fine), lie on or under /proc, /dev or /sys, or lie on, under or
        above /run/home, /run/proxy or a `ro_binds` target. The local backend refuses it (it cannot
        place a workspace at an absolute path); the others leave the rest of the sandbox's filesystem
        as it is without one (see each backend's docstring).
    hide_paths: host paths the sandbox must not see (a task suite's own folder, which holds its
        verifiers' files); absolute and normalised, not /. bwrap's minimal root shows no host path
        outside its system paths and `ro_binds` anyway (docs/SANDBOX.md); bwrap resolves each path
        on the host and covers it wherever it shows it (in a system directory, inside a `ro_binds`
        source at the bind's target): a directory with an empty tmpfs, a file with an unreadable
        empty one. A path that does not exist has nothing to hide; one that resolves to / is refused
        (ValueError from `create`). A docker container sees its image, and the local backend (no
        isolation) sees everything.
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


# How much of `SandboxSpec.name`, in bytes of UTF-8, names a sandbox's directory (and so its container
# and proxy sockets): a Unix socket path holds at most 107 bytes, and the longest one (the default base
# directory of a 7-digit pid, the sandbox directory's own suffix, /proxy/65535.sock) must fit with it
# (tests/sandbox/test_hardening.py checks it with the prefixes and suffixes tempfile makes).
NAME_LABEL_BYTES = 32


def name_label(name: str) -> str:
    """The start of `name` (whole characters) that a sandbox's directory name begins with."""
    return name.encode()[:NAME_LABEL_BYTES].decode(errors="ignore")


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


def warm_key(spec: SandboxSpec) -> SandboxSpec:
    """What a sandbox must have been started with to be handed out for `spec` after `provision`."""
    return dataclasses.replace(spec, files={}, source_dir=None, home_files={}, name="warm")

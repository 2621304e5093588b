"""Per-sandbox cgroups for the limits rlimits cannot express: memory, processes, CPU.

`CgroupHost.detect()` finds what this host gives:
- cgroup v2 (the unified hierarchy mounted at /sys/fs/cgroup, as on current GPU nodes): sandbox groups
  are made below one delegated parent, `$CLAWFAST_CGROUP` if set, else the cgroup this process lives
  in. The parent must have the controllers in its `cgroup.subtree_control`; they are enabled there
  when missing. The kernel refuses that while the parent itself holds processes (the "no internal
  processes" rule), so when the only process in it is this one, this process first moves into a leaf
  of its own (`clawfast-trainer-<pid>`, logged); when others share it, v2 limits are not available and
  the message says to set CLAWFAST_CGROUP to a delegated, empty cgroup. Limits: `memory.max` (and
  `memory.swap.max` = 0), `pids.max`, `cpu.max`; kill: `cgroup.kill`.
- cgroup v1 (the `memory`, `pids` and `cpu` hierarchies under /sys/fs/cgroup): a group per controller
  below the one this process lives in, with `memory.limit_in_bytes` (+ memsw), `pids.max`,
  `cpu.cfs_quota_us`.
- neither (no writable hierarchy: not root, read-only /sys): `CgroupHost.missing` says why for each
  limit, and the backends log it when they are made; nothing is silently skipped (`Sandbox.enforced`
  lists what a sandbox really has).
A hybrid host (v1 controllers plus an empty unified hierarchy, like this machine's) uses v1.

A sandbox's launcher joins its group before it execs bwrap, so every process of the sandbox is counted
from its first instruction. Guaranteed: `destroy()` kills every process still in the group and removes
its directories; groups left by a process that died without cleaning up are removed by `sweep_stale()`
(their names carry the owner's pid).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field

from clawfast.sandbox.base import SandboxError
from clawfast.sandbox.spec import Limits

CGROUP_ROOT = "/sys/fs/cgroup"
# Limit name (as in Sandbox.enforced) -> controller.
CONTROLLERS = {"memory": "memory", "processes": "pids", "cpu": "cpu"}
CPU_PERIOD_US = 100_000
_PREFIX = "clawfast-"
_counter = itertools.count()
log = logging.getLogger("clawfast.sandbox")


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


@dataclass
class CgroupHost:
    """Where sandbox groups go. version: 1 or 2 (None: no usable hierarchy). parents: controller ->
    the directory sandbox groups are made in (v2: the same one for all). missing: limit name -> why it
    cannot be enforced on this host."""

    version: int | None
    parents: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def detect(cls) -> CgroupHost:
        if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
            return cls.unified(CGROUP_ROOT)
        host = cls.legacy()
        if host.parents:
            return host
        return cls(None, missing={limit: f"no writable cgroup hierarchy ({reason})" for limit, reason in host.missing.items()})

    @classmethod
    def legacy(cls) -> CgroupHost:
        own = _own_paths()
        parents, missing = {}, {}
        for limit, controller in CONTROLLERS.items():
            base = os.path.join(CGROUP_ROOT, controller)
            if controller not in own or not os.path.exists(os.path.join(base, "cgroup.procs")):
                missing[limit] = f"cgroup v1 {controller} controller not mounted at {base}"
                continue
            parent = os.path.normpath(base + own[controller])
            if not os.access(parent, os.W_OK):
                missing[limit] = f"cgroup v1 {parent} is not writable by this process"
                continue
            parents[controller] = parent
        return cls(1, parents, missing)

    @classmethod
    def unified(cls, root: str) -> CgroupHost:
        """The v2 hierarchy mounted at `root`, delegated as the module docstring says."""
        parent = os.environ.get("CLAWFAST_CGROUP") or os.path.normpath(root + _own_paths().get("", "/"))
        wanted = set(CONTROLLERS.values())
        try:
            available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
            if not os.access(parent, os.W_OK):
                raise PermissionError(f"{parent} is not writable by this process")
            _enable(parent, wanted & available)
        except OSError as exc:
            return cls(2, missing={limit: f"cgroup v2 at {parent}: {exc}" for limit in CONTROLLERS})
        enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
        host = cls(2)
        for limit, controller in CONTROLLERS.items():
            if controller in enabled:
                host.parents[controller] = parent
            else:
                host.missing[limit] = (
                    f"cgroup v2 controller {controller} is not available in {parent} "
                    f"(its cgroup.controllers: {' '.join(sorted(available)) or 'none'})"
                )
        # v2 keeps membership and cgroup.kill without any controller: the group is made regardless.
        host.parents.setdefault("", parent)
        return host

    def report(self) -> str | None:
        """One line for the log when some limit cannot be enforced here, else None."""
        if not self.missing:
            return None
        return "sandbox limits NOT enforced on this host: " + "; ".join(f"{k}: {v}" for k, v in self.missing.items())


def _enable(parent: str, controllers: set[str]) -> None:
    """Enable `controllers` for the children of `parent` (cgroup v2)."""
    control = os.path.join(parent, "cgroup.subtree_control")
    missing = controllers - set(_read(control).split())
    if not missing:
        return
    try:
        _write(control, " ".join(f"+{c}" for c in sorted(missing)))
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        members = {int(p) for p in _read(os.path.join(parent, "cgroup.procs")).split()}
        if members - {os.getpid()}:
            raise OSError(
                errno.EBUSY,
                f"it holds other processes ({len(members)}), so its controllers cannot be given to sandboxes;"
                " set CLAWFAST_CGROUP to an empty cgroup delegated to this user",
            ) from exc
        leaf = os.path.join(parent, f"{_PREFIX}trainer-{os.getpid()}")
        os.makedirs(leaf, exist_ok=True)
        _write(os.path.join(leaf, "cgroup.procs"), os.getpid())
        log.info("cgroup v2: moved this process into %s so that %s can delegate controllers", leaf, parent)
        _write(control, " ".join(f"+{c}" for c in sorted(missing)))


class Cgroup:
    """One sandbox's groups: `procs_files` are the files a launcher writes its pid into."""

    def __init__(self, dirs: dict[str, str], enforced: dict[str, str], version: int = 1) -> None:
        self.dirs = dirs
        self.enforced = enforced
        self.version = version
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(dirs.values())]

    @classmethod
    def create(cls, limits: Limits, host: CgroupHost) -> Cgroup | None:
        """The sandbox's groups with `limits` applied, or None when the host has no usable hierarchy
        or (v1) none of these limits is set."""
        wanted = {
            "memory": limits.memory_bytes,
            "pids": limits.max_processes,
            "cpu": None if limits.cpus is None else round(limits.cpus * CPU_PERIOD_US),
        }
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        if host.version == 2:
            dirs = {"": os.path.join(host.parents[""], name)}
            dirs.update({c: dirs[""] for c, v in wanted.items() if v is not None and c in host.parents})
        elif host.version == 1:
            dirs = {c: os.path.join(host.parents[c], name) for c, v in wanted.items() if v is not None and c in host.parents}
            if not dirs:
                return None
        else:
            return None
        group = cls({}, {}, host.version)
        try:
            for controller, path in dirs.items():
                if not os.path.isdir(path):
                    os.mkdir(path)
                group.dirs[controller] = path
            group.procs_files = [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(group.dirs.values())]
            for controller in wanted:
                if controller in dirs:
                    group._limit(controller, wanted[controller])
        except OSError as exc:
            group.destroy()
            raise SandboxError(f"cannot set up cgroup {name}: {exc}") from exc
        return group

    def _limit(self, controller: str, value: int) -> None:
        path, v = self.dirs[controller], self.version
        if controller == "memory":
            if v == 2:
                _write(os.path.join(path, "memory.max"), value)
                # Without it a sandbox could page its excess out to swap.
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(os.path.join(path, "memory.swap.max"), 0)
            else:
                _write(os.path.join(path, "memory.limit_in_bytes"), value)
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), value)
        elif controller == "pids":
            _write(os.path.join(path, "pids.max"), value)
        elif v == 2:
            _write(os.path.join(path, "cpu.max"), f"{value} {CPU_PERIOD_US}")
        else:
            _write(os.path.join(path, "cpu.cfs_period_us"), CPU_PERIOD_US)
            _write(os.path.join(path, "cpu.cfs_quota_us"), value)
        limit = {"memory": "memory", "pids": "processes", "cpu": "cpu"}[controller]
        self.enforced[limit] = f"cgroup v{v} {controller}"

    def pids(self) -> set[int]:
        out: set[int] = set()
        for procs in self.procs_files:
            try:
                with open(procs) as f:
                    out.update(int(x) for x in f.read().split())
            except OSError as exc:
                # A group removed meanwhile (a concurrent destroy()) has no members: ENOENT when it
                # went before the open, ENODEV when it went between the open and the read.
                if exc.errno not in (errno.ENOENT, errno.ENODEV):
                    raise
        return out

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed so far (0 without a memory group)."""
        path = self.dirs.get("memory")
        if path is None:
            return 0
        name, key = ("memory.events", "oom_kill") if self.version == 2 else ("memory.oom_control", "oom_kill")
        try:
            for line in _read(os.path.join(path, name)).splitlines():
                k, _, value = line.partition(" ")
                if k == key:
                    return int(value)
        except OSError:
            pass
        return 0

    def fork_refusals(self) -> int:
        """How many forks the process limit has refused so far (0 without a pids group)."""
        path = self.dirs.get("pids")
        if path is None:
            return 0
        try:
            for line in _read(os.path.join(path, "pids.events")).splitlines():
                k, _, value = line.partition(" ")
                if k == "max":
                    return int(value)
        except OSError:
            pass
        return 0

    def kill_all(self, timeout: float = 5.0) -> bool:
        """SIGKILL every member until none is left (members may fork meanwhile). True when empty."""
        if self.version == 2:
            for path in dict.fromkeys(self.dirs.values()):
                try:
                    _write(os.path.join(path, "cgroup.kill"), 1)  # the kernel kills forks in flight too
                except OSError:
                    pass  # before Linux 5.14, or removed meanwhile: the loop below does it
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def destroy(self) -> None:
        """Kill the members and remove the directories. Idempotent; raises OSError if one remains."""
        self.kill_all()
        errors = []
        for path in dict.fromkeys(self.dirs.values()):
            if not _rmdir_retry(path):
                errors.append(path)
        self.dirs = {}
        if errors:
            raise OSError(f"cgroups still present after kill: {errors}")


def _rmdir_retry(path: str, timeout: float = 5.0) -> bool:
    # A killed process leaves its cgroup a moment after it is reaped: EBUSY until then.
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)


def sweep_stale(host: CgroupHost) -> list[str]:
    """Remove the sandbox groups of owners that are no longer alive. Returns what was removed."""
    removed = []
    for parent in dict.fromkeys(host.parents.values()):
        for entry in os.listdir(parent):
            m = re.fullmatch(_PREFIX + r"(\d+)-\d+", entry)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                path = os.path.join(parent, entry)
                Cgroup({"": path}, {}, host.version or 1).kill_all(1.0)
                if _rmdir_retry(path, 1.0):
                    removed.append(path)
    return removed


def sandbox_groups(host: CgroupHost, pid: int) -> list[str]:
    """The sandbox groups that process `pid` made and has not removed (for leak checks)."""
    out = []
    for parent in dict.fromkeys(host.parents.values()):
        out += [os.path.join(parent, e) for e in os.listdir(parent) if e.startswith(f"{_PREFIX}{pid}-")]
    return out

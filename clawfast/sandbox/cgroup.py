"""Per-sandbox cgroups (v1 `memory` and `pids` controllers) for limits that rlimits cannot express.

A `Cgroup` is created below the cgroup the current process lives in (so the host's own limits still
nest around it), gets `memory.limit_in_bytes` (and the swap-inclusive limit when present) and
`pids.max`, and is joined by each sandbox launcher before it execs bwrap, so every process of the
sandbox is counted from its first instruction.

Guaranteed: `destroy()` kills every process still in the cgroup and removes its directories; groups
left by a process that died without cleaning up are removed by `sweep_stale()` (their names carry the
owner's pid). Not supported: the unified (v2) hierarchy; where only v2 is mounted, or the hierarchy is
not writable (not root, read-only /sys), `Cgroup.create` returns None and the caller falls back to
rlimits and reports the memory/process limits as not enforced.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import signal
import time

from clawfast.sandbox.base import Limits, SandboxError

CGROUP_ROOT = "/sys/fs/cgroup"
_PREFIX = "clawfast-"
_counter = itertools.count()


def _own_path(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of `controller`, or None if it is not mounted."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def _hierarchy(controller: str) -> str | None:
    path = _own_path(controller)
    base = os.path.join(CGROUP_ROOT, controller)
    if path is None or not os.path.exists(os.path.join(base, "cgroup.procs")):
        return None
    parent = os.path.normpath(base + path)
    return parent if os.access(parent, os.W_OK) else None


class Cgroup:
    """One sandbox's cgroups: `procs_files` are the files a launcher writes its pid into."""

    def __init__(self, dirs: dict[str, str], enforced: dict[str, str]) -> None:
        self.dirs = dirs
        self.enforced = enforced
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs.values()]

    @classmethod
    def create(cls, limits: Limits) -> Cgroup | None:
        wanted = {}
        if limits.memory_bytes is not None:
            wanted["memory"] = limits.memory_bytes
        if limits.max_processes is not None:
            wanted["pids"] = limits.max_processes
        if not wanted:
            return None
        parents = {c: _hierarchy(c) for c in wanted}
        if any(p is None for p in parents.values()):
            return None
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        dirs: dict[str, str] = {}
        try:
            for controller, parent in parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                dirs[controller] = path
            if "memory" in dirs:
                _write(dirs["memory"], "memory.limit_in_bytes", wanted["memory"])
                # Without the swap-inclusive limit a sandbox could page its excess out to swap.
                memsw = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(dirs["memory"], "memory.memsw.limit_in_bytes", wanted["memory"])
            if "pids" in dirs:
                _write(dirs["pids"], "pids.max", wanted["pids"])
        except OSError as exc:
            cls(dirs, {}).destroy()
            raise SandboxError(f"cannot set up cgroup {name}: {exc}") from exc
        enforced = {"memory": "cgroup v1 memory"} if "memory" in dirs else {}
        if "pids" in dirs:
            enforced["processes"] = "cgroup v1 pids"
        return cls(dirs, enforced)

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
        """How many processes the memory limit has killed so far (0 without a memory cgroup)."""
        path = self.dirs.get("memory")
        if path is None:
            return 0
        try:
            with open(os.path.join(path, "memory.oom_control")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def kill_all(self, timeout: float = 5.0) -> bool:
        """SIGKILL every member until none is left (members may fork meanwhile). True when empty."""
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
        for path in self.dirs.values():
            if not _rmdir_retry(path):
                errors.append(path)
        self.dirs = {}
        if errors:
            raise OSError(f"cgroups still present after kill: {errors}")


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


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


def sweep_stale() -> list[str]:
    """Remove the sandbox cgroups of owners that are no longer alive. Returns what was removed."""
    removed = []
    for controller in ("memory", "pids"):
        parent = _hierarchy(controller)
        if parent is None:
            continue
        for entry in os.listdir(parent):
            m = re.fullmatch(_PREFIX + r"(\d+)-\d+", entry)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                path = os.path.join(parent, entry)
                Cgroup({controller: path}, {}).kill_all(1.0)
                if _rmdir_retry(path, 1.0):
                    removed.append(path)
    return removed

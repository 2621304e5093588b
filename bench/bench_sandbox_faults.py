"""Fault-injected rollouts through the real bwrap backend, then a count of everything left behind.

N rollouts (default 1000; `--quick`: 50) run through one `SandboxPool("bwrap")` at `--concurrency`
(default 8), each in a fresh small sandbox (memory 256 MiB, 256 processes, 64 MiB files, one CPU
where `Limits` has `cpus`, unless the fault asks for less). Each rollout draws one fault at random (`--seed`, so a run can be repeated):

- normal: write a file, read it back from the host (status `ok`).
- timeout_bg: the command starts background children (a double fork, a `setsid` one, one that
  ignores SIGTERM and SIGHUP) and then runs past a 0.5 s timeout (`timed_out`).
- oom: `tail /dev/zero` under a 32 MiB memory limit (`exit=137`). Skipped where the sandbox does not
  enforce a memory limit (`Sandbox.enforced`), since it would eat the host's memory.
- fork_bomb: a shell fork bomb under a 32-process limit, then a sleep, 2 s timeout (`timed_out`, or a
  failed exit when the sleep itself could not fork). Skipped where the process limit is not enforced.
- disk_full: `Limits.disk_bytes` = 1 MiB and a 4 MB write into the workspace, /tmp or /dev/shm
  (`enospc` when the write failed with ENOSPC, a workspace file stayed within the quota and the next
  command still runs). Skipped, with a note, when `Limits` has no `disk_bytes` (or the sandbox does not
  enforce it).
- close_mid_run: the sandbox is closed from another thread while a command sleeps in it (`run` is
  expected to raise SandboxError).
- sigkill: SIGKILL from outside, while a command sleeps, to the sandbox's outer `bwrap` process or to
  its PID-namespace init (the `bwrap` child of it), found in /proc by the rollout's marker.
- start_failure: a spec the backend cannot start: an `ro_binds` target it cannot make (under a
  missing directory of the read-only /usr), a `source_dir` holding a FIFO (the copy fails), or a
  `source_dir` that vanishes before the start (ValueError from the spec check); the pool retries
  the first two as it would any failed start.
- caller_exception: the caller raises between create and close (after one command or before any).

Every command line carries a marker made for this run (`cffault<hex>`, plus `r<i>x` per rollout). After
all N and `pool.close()` it counts strays, what this run left on the host:
- processes: host pids whose command line holds the marker, and live children of this process;
- mounts: lines of /proc/self/mountinfo added or removed since the start that lie under this run's
  directories (changes elsewhere, e.g. from other processes on a shared host, are listed apart);
- cgroups: directories named clawfast-<this pid>-* anywhere under the v1 memory, pids and cpu
  hierarchies and the cgroup2 mount;
- directories: the backend's base_dir, and clawfast-* entries of the temp dir (and /dev/shm) that
  carry this pid.
Also sandboxes the backend still counted as live just before `pool.close()`.

It prints a progress line every 100 rollouts, then a table of fault -> count and the statuses seen
(those not expected for the fault marked `!`), then the stray counts. Exit status: 0 when clean;
1 when some rollout ended in a status not expected for its fault (see the table); 2 when anything
strayed; 3 when both.

    python bench/bench_sandbox_faults.py [--rollouts 1000] [--quick] [--concurrency 8] [--seed 1]
Writes bench/results/bench_sandbox_faults.json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed

from clawfast.sandbox import Limits, SandboxPool, SandboxSpec
from clawfast.sandbox.probes import pids_with

MiB = 1 << 20
LIMIT_FIELDS = {f.name for f in dataclasses.fields(Limits)}
HAS_DISK = "disk_bytes" in LIMIT_FIELDS
# A CPU quota too where Limits has one, so that the cpu controller's groups are made (and counted).
SMALL = {"memory_bytes": 256 * MiB, "max_processes": 256, "max_file_bytes": 64 * MiB}
if "cpus" in LIMIT_FIELDS:
    SMALL["cpus"] = 1.0
FAULTS = ("normal", "timeout_bg", "oom", "fork_bomb", "disk_full", "close_mid_run", "sigkill",
          "start_failure", "caller_exception")
# What each fault is expected to end in; anything else is reported with a `!`.
EXPECTED = {
    "normal": {"ok"},
    "timeout_bg": {"timed_out"},
    "oom": {"exit=137", "skipped: memory not enforced"},
    "fork_bomb": {"timed_out", "exit!=0", "skipped: processes not enforced"},
    "disk_full": {"enospc", "skipped: Limits has no disk_bytes", "skipped: disk not enforced"},
    "close_mid_run": {"SandboxError: sandbox was closed while the command ran", "SandboxError: sandbox is closed"},
    "sigkill": {"SandboxError: bwrap was killed by signal 9", "exit=137"},
    "start_failure": {"SandboxError: sandbox probe failed", "SandboxError: sandbox failed to start",
                      "SandboxError: cannot provision the sandbox directory",
                      "ValueError: SandboxSpec.source_dir is not a directory"},
    "caller_exception": {"raised"},
}


class CallerError(Exception):
    """What the caller_exception fault raises inside the sandbox's `with` block."""


def status_of(exc: BaseException) -> str:
    """A short, groupable label of an exception: its type and the message up to the first detail."""
    msg = str(exc).split("\n", 1)[0]
    msg = re.split(r"[:;(]", msg, 1)[0].strip()
    msg = re.sub(r" '[^']*'", "", msg)  # paths and names
    return f"{type(exc).__name__}: {msg[:70]}"


def result_status(r) -> str:
    if r.timed_out:
        return "timed_out"
    return f"exit={r.exit_code}"


# -- host probes (as tests/sandbox/conftest.py, extended to the v1 cpu and v2 hierarchies) ------------


def stat_of(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a live pid, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    return comm, fields[0], int(fields[1])


def children() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat_of(int(entry))
            if st is not None and st[2] == os.getpid() and st[1] != "Z":
                out.append(int(entry))
    return out


def mountinfo() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.rstrip("\n").split(" ", 4)[4] for line in f]


def cgroup_roots() -> list[str]:
    """The v1 memory, pids and cpu hierarchies and every cgroup2 mount."""
    roots = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            fstype, _, opts = right.split(" ", 2)
            mount_point = left.split(" ")[4]
            if fstype == "cgroup2" or fstype == "cgroup" and set(opts.split(",")) & {"memory", "pids", "cpu"}:
                roots.append(mount_point)
    return sorted(set(roots))


def own_cgroups() -> list[str]:
    prefix = f"clawfast-{os.getpid()}-"
    found = []
    for root in cgroup_roots():
        for dirpath, dirnames, _ in os.walk(root):
            for name in list(dirnames):
                if name.startswith(prefix):
                    found.append(os.path.join(dirpath, name))
    return found


def own_temp_entries() -> list[str]:
    pid = os.getpid()
    out = []
    for parent in {tempfile.gettempdir(), "/dev/shm"}:
        try:
            entries = os.listdir(parent)
        except OSError:
            continue
        out += [os.path.join(parent, e) for e in entries
                if e.startswith("clawfast-") and re.search(rf"-{pid}-", e)]
    return out


# -- rollouts -------------------------------------------------------------------------------------


class Rollouts:
    def __init__(self, pool: SandboxPool, marker: str, seed: int) -> None:
        self.pool = pool
        self.marker = marker
        self.seed = seed
        self.scratch = tempfile.mkdtemp(prefix=f"clawfast-faults-{os.getpid()}-")
        self.limits = Limits(**SMALL)

    def spec(self, i: int, **limits) -> SandboxSpec:
        return SandboxSpec(name=f"f{i}", limits=dataclasses.replace(self.limits, **limits), default_timeout=30)

    def sh(self, i: int, script: str) -> list[str]:
        """`sh -c script MARK`: the marker is the shell's $0, so it is on the command line of the
        shell and of every subshell it forks."""
        return ["sh", "-c", script, f"{self.marker}r{i}x"]

    def one(self, i: int) -> tuple[str, str]:
        rng = random.Random(f"{self.seed}-{i}")
        fault = rng.choice(FAULTS)
        try:
            status = getattr(self, fault)(i, rng)
        except CallerError:
            status = "raised"
        except Exception as exc:  # noqa: BLE001 - every outcome is a row of the table
            status = status_of(exc)
        return fault, status

    def normal(self, i, rng):
        with self.pool.sandbox(self.spec(i)) as sb:
            r = sb.run(self.sh(i, f"echo rollout {i} > out.txt && cat out.txt"), timeout=30)
            ok = r.ok and r.stdout == f"rollout {i}\n".encode() and sb.read_file("out.txt") == r.stdout
            return "ok" if ok else f"wrong: {result_status(r)}"

    def timeout_bg(self, i, rng):
        loop = "while :; do sleep 1; done"
        script = (
            f"( ( sh -c '{loop}' {self.marker}r{i}x & ) & ); "
            f"setsid sh -c '{loop}' {self.marker}r{i}x & "
            f"sh -c \"trap '' TERM HUP; {loop}\" {self.marker}r{i}x & "
            "sleep 60"
        )
        with self.pool.sandbox(self.spec(i)) as sb:
            return result_status(sb.run(self.sh(i, script), timeout=0.5))

    def oom(self, i, rng):
        with self.pool.sandbox(self.spec(i, memory_bytes=32 * MiB)) as sb:
            if "memory" not in sb.enforced:
                return "skipped: memory not enforced"
            return result_status(sb.run(self.sh(i, "tail /dev/zero"), timeout=30))

    def fork_bomb(self, i, rng):
        with self.pool.sandbox(self.spec(i, max_processes=32)) as sb:
            if "processes" not in sb.enforced:
                return "skipped: processes not enforced"
            r = sb.run(self.sh(i, "b() { b | b & }; b; sleep 30"), timeout=2)
            return "timed_out" if r.timed_out else ("exit!=0" if r.exit_code else "exit=0")

    def disk_full(self, i, rng):
        if not HAS_DISK:
            return "skipped: Limits has no disk_bytes"
        where = rng.choice(("big", "/tmp/big", "/dev/shm/big"))
        with self.pool.sandbox(self.spec(i, disk_bytes=1 * MiB)) as sb:
            if "disk" not in sb.enforced:
                return "skipped: disk not enforced"
            r = sb.run(self.sh(i, f"head -c 4000000 /dev/zero > {where}"), timeout=30)
            size = 0
            if where == "big":
                try:
                    size = os.lstat(os.path.join(sb.host_workdir, "big")).st_size
                except FileNotFoundError:
                    pass
            after = sb.run(self.sh(i, "echo still works"), timeout=30)
            if r.exit_code not in (0, None) and b"No space left" in r.stderr and size <= 1 * MiB \
                    and after.ok and after.stdout == b"still works\n":
                return "enospc"
            return f"wrong ({where}): {result_status(r)}, file {size} bytes, next command {result_status(after)}"

    def _in_thread(self, sb, script: str, i: int):
        """Start `script` in `sb` from a helper thread; returns (thread, outcome dict)."""
        outcome: dict = {}

        def target():
            t0 = time.monotonic()
            try:
                outcome["status"] = result_status(sb.run(self.sh(i, script), timeout=30))
            except Exception as exc:  # noqa: BLE001
                outcome["status"] = status_of(exc)
            took = time.monotonic() - t0
            if took > 5:  # the fault should end the command at once, not at its 30 s timeout
                outcome["status"] += f" (after {took:.0f}s)"

        t = threading.Thread(target=target, daemon=True)
        t.start()
        return t, outcome

    def _wait_started(self, sb, t, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and t.is_alive():
            if os.path.exists(os.path.join(sb.host_workdir, "started")):
                return True
            time.sleep(0.005)
        return False

    def close_mid_run(self, i, rng):
        with self.pool.sandbox(self.spec(i)) as sb:
            t, outcome = self._in_thread(sb, "touch started; sleep 30", i)
            if rng.random() < 0.5:
                self._wait_started(sb, t)  # else close at once, wherever the start is
            time.sleep(rng.uniform(0, 0.05))
            sb.close()
            t.join(35)
            return "hung" if t.is_alive() else outcome.get("status", "no outcome")

    def sigkill(self, i, rng):
        target = rng.choice(("bwrap", "init"))
        with self.pool.sandbox(self.spec(i)) as sb:
            t, outcome = self._in_thread(sb, "touch started; sleep 30", i)
            if not self._wait_started(sb, t):
                t.join(35)
                return f"not started: {outcome.get('status')}"
            mine = {}
            for pid in pids_with(f"{self.marker}r{i}x"):
                st = stat_of(pid)
                if st is not None:
                    mine[pid] = st
            bwraps = {pid for pid, (comm, _, _) in mine.items() if comm == "bwrap"}
            outer = [p for p in bwraps if mine[p][2] not in bwraps]
            inner = [p for p in bwraps if mine[p][2] in bwraps]
            victims = outer if target == "bwrap" else inner
            if len(victims) != 1:
                t.join(35)
                return f"no {target} to kill: bwraps {sorted(bwraps)}, outer {outer}, inner {inner}"
            os.kill(victims[0], signal.SIGKILL)
            t.join(35)
            return "hung" if t.is_alive() else outcome.get("status", "no outcome")

    def start_failure(self, i, rng):
        kind = rng.choice(("ro_bind", "fifo", "vanished"))
        if kind == "ro_bind":
            spec = dataclasses.replace(
                self.spec(i), ro_binds={self.scratch: f"/usr/clawfast-missing-{self.marker}/r{i}x"})
        else:
            src = tempfile.mkdtemp(prefix=f"src{i}-", dir=self.scratch)
            with open(os.path.join(src, "task.txt"), "w") as f:
                f.write("t")
            if kind == "fifo":
                os.mkfifo(os.path.join(src, "pipe"))
            spec = dataclasses.replace(self.spec(i), source_dir=src)
            if kind == "vanished":
                shutil.rmtree(src)
        with self.pool.sandbox(spec) as sb:
            r = sb.run(self.sh(i, "true"))
            return f"started anyway ({kind}): {result_status(r)}"

    def caller_exception(self, i, rng):
        with self.pool.sandbox(self.spec(i)) as sb:
            if rng.random() < 0.5:
                sb.run(self.sh(i, "echo x > x.txt; (sleep 30 &)"), timeout=30)
            raise CallerError(f"rollout {i}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="50 rollouts, a smoke run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    n = 50 if args.quick else args.rollouts

    if not HAS_DISK:
        print("note: clawfast.sandbox.Limits has no disk_bytes: the disk_full fault is skipped")
    marker = f"cffault{uuid.uuid4().hex[:12]}"
    mounts_before = collections.Counter(mountinfo())
    load_before = os.getloadavg()
    t0 = time.monotonic()
    results: list[tuple[str, str]] = []
    pool = SandboxPool("bwrap", max_concurrency=args.concurrency)
    base_dir = getattr(pool.backend, "base_dir", None)
    rollouts = Rollouts(pool, marker, args.seed)
    try:
        with ThreadPoolExecutor(max_workers=args.concurrency) as ex:
            futures = [ex.submit(rollouts.one, i) for i in range(n)]
            for done, fut in enumerate(as_completed(futures), 1):
                results.append(fut.result())
                if done % 100 == 0 or done == n:
                    bad = sum(s not in EXPECTED[f] for f, s in results)
                    print(f"[{done}/{n}] {time.monotonic() - t0:6.1f}s  unexpected so far: {bad}  "
                          f"pool: {pool.stats}", flush=True)
        live_before_close = len(getattr(pool.backend, "_live", ()))
    finally:
        pool.close()
        shutil.rmtree(rollouts.scratch, ignore_errors=True)
    elapsed = time.monotonic() - t0
    load_after = os.getloadavg()

    # Strays. Processes die a moment after their namespace's init; give them a short grace first.
    deadline = time.monotonic() + 2
    while (pids_with(marker) or children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stray_pids = pids_with(marker)
    stray_children = children()
    mounts_after = collections.Counter(mountinfo())
    added = list((mounts_after - mounts_before).elements())
    removed = list((mounts_before - mounts_after).elements())
    own_top = re.compile(rf"^({re.escape(tempfile.gettempdir())}|/dev/shm)/clawfast-[^/]*-{os.getpid()}-")

    def is_ours(line: str) -> bool:
        mount_point = line.split(" ", 1)[0]
        under_base = base_dir is not None and (mount_point == base_dir or mount_point.startswith(base_dir + "/"))
        return under_base or bool(own_top.match(mount_point))

    stray_mounts = [("+", m) for m in added if is_ours(m)] + [("-", m) for m in removed if is_ours(m)]
    foreign_mounts = [("+", m) for m in added if not is_ours(m)] + [("-", m) for m in removed if not is_ours(m)]
    stray_cgroups = own_cgroups()
    stray_dirs = ([base_dir] if base_dir and os.path.exists(base_dir) else []) + [
        p for p in own_temp_entries() if p != base_dir]

    # Report.
    print()
    print(f"{n} rollouts in {elapsed:.1f}s at concurrency {args.concurrency}, seed {args.seed}, "
          f"cpus={os.cpu_count()} loadavg(1m) before={load_before[0]:.1f} after={load_after[0]:.1f}")
    by_fault: dict[str, collections.Counter] = {f: collections.Counter() for f in FAULTS}
    for fault, status in results:
        by_fault[fault][status] += 1
    unexpected = 0
    print(f"{'fault':17s} {'count':>5s}  statuses seen")
    for fault in FAULTS:
        counter = by_fault[fault]
        parts = []
        for status, count in counter.most_common():
            mark = "" if status in EXPECTED[fault] else "!"
            unexpected += count if mark else 0
            parts.append(f"{mark}{status} x{count}")
        print(f"{fault:17s} {sum(counter.values()):5d}  {'; '.join(parts) or '-'}")
    print()
    strays = {
        "processes (marker)": stray_pids,
        "processes (live children)": stray_children,
        "mounts": stray_mounts,
        "cgroups": stray_cgroups,
        "directories": stray_dirs,
        "sandboxes live before pool.close()": list(range(live_before_close)),
    }
    print("strays")
    for what, items in strays.items():
        print(f"  {what:36s} {len(items)}")
        for item in items[:10]:
            print(f"      {item}")
    if foreign_mounts:
        print(f"  (mount changes outside this run's directories, not counted: {len(foreign_mounts)})")
        for item in foreign_mounts[:10]:
            print(f"      {item}")
    print(f"pool: {pool.stats}")
    print(f"unexpected statuses: {unexpected}")
    n_strays = sum(len(v) for v in strays.values())
    print(f"strays: {n_strays}")

    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_sandbox_faults.json"), "w") as f:
        json.dump({
            "rollouts": n, "concurrency": args.concurrency, "seed": args.seed, "seconds": elapsed,
            "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
            "disk_bytes_supported": HAS_DISK,
            "faults": {f: dict(c) for f, c in by_fault.items()},
            "unexpected": unexpected,
            "strays": {k: [str(x) for x in v] for k, v in strays.items()},
            "foreign_mount_changes": [str(x) for x in foreign_mounts],
            "pool_stats": dataclasses.asdict(pool.stats),
        }, f, indent=2)
    return (1 if unexpected else 0) | (2 if n_strays else 0)


if __name__ == "__main__":
    raise SystemExit(main())

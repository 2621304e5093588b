"""Rollouts on a multi-raylet Ray cluster of this machine under faults, and rollouts/min on 1 vs 3 raylets.

Every rollout is real mini-swe-agent in a bubblewrap sandbox behind the proxy, the scripted engine
playing the task's oracle (clawbench-mini), through `RolloutService` on Ray as a training run uses it.
The clusters are `clawfast.rollout.local_cluster.LocalRayCluster` (`ray start` raylets, each in its own
process group).

Throughput (`--throughput N`, default 48; 0 skips it): N rollouts without faults, after a warm-up of 4,
with 4 rollout slots either way:
  1 raylet:  a head of 2 CPUs with two actors on it (2 rollouts each at once);
  3 raylets: a head with no CPU and two workers of 1 CPU, one actor on each (2 rollouts each at once).

Soak (`--rollouts N`, default 500; 0 skips it) on the 3-raylet cluster, in batches of `--batch` (8
tasks x 4 samples by default, as a training step asks), with `rollout.infra_retries` = `--retries`:
- each time the rollouts returned pass a multiple of `--kill-every` (counted as batches end), a
  worker raylet (0 and 1 in turn) is SIGKILLed with its whole process group, as a preemption would,
  under the next batch's rollouts, and started again `--down-s` seconds later (it joins as a new node);
- each sandbox (an outer bwrap under a worker raylet) is SIGKILLed from outside with probability
  `--sandbox-kill`, at a random moment of its first 2 seconds.

Checks: every rollout asked for (batch, task, sample index) came back exactly once, ``ok`` or an
infrastructure failure after its retries; the records directory holds exactly the returned
rollouts and ``retried/`` exactly the failed attempts their info lists (none lost, none twice); and
nothing is left: no open proxy rollout, no bwrap process, no clawfast cgroup, no process of the
cluster. Prints a line per batch and a summary; writes bench/results/bench_ray_soak.json. Exit 0
when every check holds, else 1.

    python bench/bench_ray_soak.py [--rollouts 500] [--throughput 48] [--kill-every 100] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the local cluster: loopback only, before Ray loads

from clawfast.embedded import ensure_embedded_model  # noqa: E402
from clawfast.proxy.rollouts import RETRIED_DIR  # noqa: E402
from clawfast.records import read_rollouts  # noqa: E402
from clawfast.rollout import ORACLE, HarnessConfig, OnRay, RolloutService, Sampling, SchedulingConfig  # noqa: E402
from clawfast.rollout.local_cluster import LocalRayCluster  # noqa: E402
from clawfast.rollout.retry import INFRA_STATUSES, infra_counts  # noqa: E402
from clawfast.rollout.spec import make_specs  # noqa: E402
from clawfast.tasks import clawbench_mini  # noqa: E402

OUT = Path(__file__).parent / "results" / "bench_ray_soak.json"
HARNESS = {"mini-swe-agent": {"max_turns": 8, "instance_template": "Task: {{task}}"}}


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, comm) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        table[int(entry)] = (int(stat.rsplit(")", 1)[1].split()[1]), comm)
    return table


def _under(pid: int, roots: set[int], table: dict[int, tuple[int, str]]) -> bool:
    while pid > 1 and pid in table:
        if pid in roots:
            return True
        pid = table[pid][0]
    return False


def bwrap_count() -> int:
    return sum(comm == "bwrap" for _, comm in _proc_table().values())


def clawfast_cgroups() -> set[str]:
    return {str(p) for p in Path("/sys/fs/cgroup").rglob("clawfast-*")} if Path("/sys/fs/cgroup").is_dir() else set()


class SandboxKiller:
    """Each outer bwrap under one of `roots()` (the worker raylets' pids), seen for the first time, is
    SIGKILLed with probability `p` at a random moment of its first 2 seconds."""

    def __init__(self, roots, p: float, rng: random.Random) -> None:
        self.roots, self.p, self.rng = roots, p, rng
        self.killed = 0
        self._seen: set[int] = set()
        self._due: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            table = _proc_table()
            roots = self.roots()
            for pid, (parent, comm) in table.items():
                if comm != "bwrap" or pid in self._seen or table.get(parent, (0, ""))[1] == "bwrap":
                    continue
                if not _under(pid, roots, table):
                    continue
                self._seen.add(pid)
                if self.rng.random() < self.p:
                    self._due[pid] = time.monotonic() + self.rng.uniform(0.0, 2.0)
            for pid, due in list(self._due.items()):
                if time.monotonic() >= due:
                    del self._due[pid]
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.killed += 1
                    except ProcessLookupError:
                        pass
            self._stop.wait(0.05)

    def __enter__(self) -> "SandboxKiller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def service_on(cluster: LocalRayCluster, work: Path, tasks, *, num_actors: int | None, retries: int) -> RolloutService:
    return RolloutService(ORACLE, ensure_embedded_model(), records_dir=work / "records",
                          harnesses=HarnessConfig(HARNESS, timeout_s=240),
                          scheduling=SchedulingConfig(concurrency=2, infra_retries=retries,
                                                      ray=OnRay(cluster.address, "clawbench-mini",
                                                                num_actors=num_actors)),
                          oracle_tasks=tasks)


def throughput(raylets: int, n: int, tasks, work: Path) -> dict:
    """rollouts/min of `n` rollouts on a cluster of `raylets` (1 or 3), after a warm-up of 4."""
    if raylets == 1:
        cluster = LocalRayCluster(work / "ray-logs", workers=0, head_cpus=2)
        num_actors = 2
    else:
        cluster = LocalRayCluster(work / "ray-logs", workers=2, cpus_per_worker=1)
        num_actors = None
    try:
        with service_on(cluster, work, tasks, num_actors=num_actors, retries=0) as service:
            service.run(make_specs(tasks[:1], ["mini-swe-agent"], k=4), Sampling(max_calls=20))
            specs = make_specs(tasks[: max(1, n // 4)], ["mini-swe-agent"], k=4)[:n]
            t0 = time.monotonic()
            results = service.run(specs, Sampling(max_calls=20))
            wall = time.monotonic() - t0
    finally:
        cluster.close()
    statuses = Counter(r.status for r in results)
    row = {"raylets": raylets, "rollouts": len(results), "wall_s": round(wall, 1),
           "per_min": round(60 * len(results) / wall, 1), "statuses": dict(statuses)}
    print(f"throughput, {raylets} raylet(s): {row['per_min']} rollouts/min ({len(results)} in {wall:.0f} s; "
          f"{dict(statuses)})", flush=True)
    return row


def soak(args, tasks, work: Path) -> dict:
    rng = random.Random(args.seed)
    bwraps, cgroups = bwrap_count(), clawfast_cgroups()
    cluster = LocalRayCluster(work / "ray-logs", workers=2, cpus_per_worker=1)
    port = cluster.port
    returned: list = []
    lock = threading.Lock()
    events: list[str] = []
    stop = threading.Event()
    per_batch = args.batch // 4

    def worker_pids() -> set[int]:
        return {p.pid for p in cluster.workers if p is not None}

    def faults() -> None:
        target, turn = args.kill_every, 0
        while not stop.is_set():
            with lock:
                n = len(returned)
            if n >= target and n < args.rollouts:
                i = turn % 2
                cluster.kill_worker(i)
                events.append(f"{time.strftime('%H:%M:%S')} after {n} rollouts: worker {i} killed")
                print(f"  [fault] worker raylet {i} SIGKILLed after {n} rollouts", flush=True)
                if stop.wait(args.down_s):
                    return
                cluster.start_worker(i)
                events.append(f"{time.strftime('%H:%M:%S')} worker {i} back as node {cluster.node_id(i)[:8]}")
                print(f"  [fault] worker raylet {i} started again (node {cluster.node_id(i)[:8]})", flush=True)
                turn += 1
                target += args.kill_every
            stop.wait(0.5)

    asked: list[tuple[int, str, int]] = []
    t0 = time.monotonic()
    try:
        with service_on(cluster, work, tasks, num_actors=None, retries=args.retries) as service, \
                SandboxKiller(worker_pids, args.sandbox_kill, rng) as killer:
            fault_thread = threading.Thread(target=faults, daemon=True)
            fault_thread.start()
            batch = 0
            while len(asked) < args.rollouts:
                chosen = rng.sample(tasks, per_batch)
                specs = make_specs(chosen, ["mini-swe-agent"], k=4)[: args.rollouts - len(asked)]
                asked += [(batch, s.task.id, s.sample_index) for s in specs]
                tb = time.monotonic()
                results = service.run(specs, Sampling(max_calls=20))
                with lock:
                    returned.extend((batch, r) for r in results)
                infra = infra_counts(results)
                print(f"batch {batch}: {len(results)} rollouts in {time.monotonic() - tb:.0f} s, "
                      f"{dict(Counter(r.status for r in results))}, retried {infra['retries']}, "
                      f"nodes lost {len(infra['nodes_lost'])}; total {len(returned)}/{args.rollouts}", flush=True)
                batch += 1
            stop.set()
            fault_thread.join()
            open_left = service.registry.open_ids()
            sandboxes_killed = killer.killed
    finally:
        stop.set()
        cluster.close()
    wall = time.monotonic() - t0
    ray_left = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout.split()

    results = [r for _, r in returned]
    got = Counter((b, r.task_id, r.sample_index) for b, r in returned)
    lost = [k for k in asked if got[k] == 0]
    twice = [k for k, n in got.items() if n > 1]
    unexpected = [r.status for r in results if r.status != "ok" and r.status not in INFRA_STATUSES]
    on_disk = {r.rollout_id for r in read_rollouts(work / "records")}
    aside_dir = work / "records" / RETRIED_DIR
    aside = {r.rollout_id for r in read_rollouts(aside_dir)} if aside_dir.is_dir() else set()
    noted = [n["rollout_id"] for r in results for n in r.info.get("retries", ())]
    infra = infra_counts(results)
    time.sleep(2.0)  # the kernel tears the last sandboxes' PID namespaces down
    left = {"open_rollouts": len(open_left), "bwrap": max(0, bwrap_count() - bwraps),
            "cgroups": len(clawfast_cgroups() - cgroups), "ray_processes": len(ray_left)}
    summary = {
        "asked": len(asked), "returned": len(results), "lost": len(lost), "duplicated": len(twice),
        "statuses": dict(Counter(r.status for r in results)), "unexpected_statuses": len(unexpected),
        "retries": infra["retries"], "infra_failures": infra["infra_failures"],
        "retried_rollouts": infra["retried_rollouts"], "nodes_lost": len(infra["nodes_lost"]),
        "sandboxes_killed": sandboxes_killed, "node_kills": sum("killed" in e for e in events),
        "records": {"returned_missing": len({r.rollout_id for r in results} - on_disk),
                    "extra_in_records": len(on_disk - {r.rollout_id for r in results}),
                    "retried_files": len(aside), "retried_noted": len(noted),
                    "retried_mismatch": len(aside ^ set(noted)) + (len(noted) - len(set(noted)))},
        "per_node": dict(Counter(r.info.get("ray_node_id", "none")[:8] for r in results)),
        "left": left, "wall_s": round(wall, 1), "per_min": round(60 * len(results) / wall, 1), "events": events,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=1), flush=True)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=500)
    p.add_argument("--throughput", type=int, default=48)
    p.add_argument("--batch", type=int, default=32, help="rollouts per batch (a multiple of 4: tasks x 4 samples)")
    p.add_argument("--kill-every", type=int, default=100)
    p.add_argument("--down-s", type=float, default=15.0)
    p.add_argument("--sandbox-kill", type=float, default=0.03)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="--rollouts 48 --throughput 8 --kill-every 20 --batch 16")
    args = p.parse_args(argv)
    if args.quick:
        args.rollouts, args.throughput, args.kill_every, args.batch = 48, 8, 20, 16
    if args.batch % 4 or args.batch < 4:
        p.error("--batch must be a positive multiple of 4")
    if shutil.which("bwrap") is None or shutil.which("socat") is None:
        p.error("needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)")
    tasks = clawbench_mini(0)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()}, {os.cpu_count()} cores",
              "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="cf-soak-") as tmp:
        work = Path(tmp)
        if args.throughput:
            report["throughput"] = [throughput(n, args.throughput, tasks, work / f"tp{n}") for n in (1, 3)]
        if args.rollouts:
            report["soak"] = soak(args, tasks, work / "soak")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    s = report.get("soak")
    ok = s is None or (s["lost"] == s["duplicated"] == s["unexpected_statuses"] == 0 and s["asked"] == s["returned"]
                       and not any(s["records"][k] for k in ("returned_missing", "extra_in_records", "retried_mismatch"))
                       and not any(s["left"].values()))
    print(f"{'every check holds' if ok else 'A CHECK FAILED'}; {OUT}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

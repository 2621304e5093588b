"""A multi-node Ray cluster on one machine, for the tests and `bench/ray_soak.py`: a head raylet (no
CPUs: no rollout actor lands there) and
worker raylets, each started with `ray start --block` in its own process group, with its own
`--num-cpus` and a resource ``clawfast_node_<i>``. Objects, actor placement and node death are Ray's
real mechanisms; `kill_worker` SIGKILLs a worker's whole process group, as a preemption would. The
same commands start a cluster of several machines (docs/DESIGN.md).

Every process group is waited for within bounded times and killed if it outlives them, so nothing is
left running. Token authentication (on by default for `ray start`) is off for this loopback-only
cluster: ``RAY_AUTH_MODE=disabled`` must be set for the whole process before Ray is first used (Ray
reads the mode once per process, so every Ray cluster of a process must share it; tests/conftest.py
sets it); a cluster across machines keeps it on.

    cluster = LocalRayCluster(Path("ray-logs"), workers=2)   # head + 2 workers; this process connected
    cluster.kill_worker(0); cluster.start_worker(0)          # preempted, and back as a new node
    cluster.close()
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
# How long `close` lets the cluster's processes end on SIGTERM before it kills their groups: a head's
# `ray start --block` took the whole 30 s every time (measured), and nothing of a throwaway cluster
# needs keeping.
GRACE_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    """A head raylet of `head_cpus` CPUs (0: it hosts no rollout actor) and `workers` worker raylets
    of `cpus_per_worker` CPUs each, their logs in `log_dir`; this process is connected to it
    (``ray.init``) until `close`."""

    def __init__(self, log_dir: Path, *, workers: int = 2, cpus_per_worker: int = 1, head_cpus: int = 0) -> None:
        import ray  # an optional dependency: imported where used

        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if os.environ.get("RAY_AUTH_MODE") != "disabled":
            raise RuntimeError("the local cluster runs without token authentication: set RAY_AUTH_MODE=disabled "
                               "for the whole process before Ray is first used (tests/conftest.py does)")
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        self.head: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = []
        self.node_ids: dict[int, str] = {}
        try:
            self.head = self._start("head", "--head", f"--port={self.port}", f"--num-cpus={head_cpus}",
                                    "--include-dashboard=false")
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    ray.init(address=self.address, log_to_driver=False)
                    break
                except ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            for i in range(workers):
                self.start_worker(i, cpus_per_worker)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        try:
            # `ray start` of this interpreter's Ray, whatever PATH holds.
            return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--block",
                                     "--disable-usage-stats"], stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        finally:
            log.close()

    def all_nodes(self) -> list[dict]:
        import ray

        return ray.nodes()

    def alive_nodes(self) -> list[dict]:
        return [n for n in self.all_nodes() if n["Alive"]]

    def node_id(self, i: int) -> str:
        """The Ray node id of worker `i`'s latest raylet (a restarted raylet is a new node; the cluster
        reports the killed one alive until its health checks fail)."""
        return self.node_ids[i]

    def start_worker(self, i: int, cpus: int = 1) -> None:
        """Start worker raylet `i` (again, after `kill_worker`) and wait until the cluster counts it."""
        known = {n["NodeID"] for n in self.all_nodes()}
        proc = self._start(f"worker{i}", f"--address={self.address}", f"--num-cpus={cpus}",
                           f"--resources={json.dumps({f'clawfast_node_{i}': 1})}")
        if i < len(self.workers):
            self.workers[i] = proc
        else:
            self.workers.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            joined = [n["NodeID"] for n in self.alive_nodes() if n["NodeID"] not in known]
            if joined:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker raylet {i} did not join (see {self.log_dir / f'worker{i}.log'})")
            time.sleep(0.3)
        self.node_ids[i] = joined[0]

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker `i`'s process group (its raylet, the actors' worker processes, their children)."""
        proc = self.workers[i]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
        self.workers[i] = None

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        procs = [p for p in (*self.workers, self.head) if p is not None]
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever of the group outlived SIGTERM (or the group leader's exit)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        # `ray start --head` left the address where a plain `ray.init()` looks for a running cluster
        # (as `ray stop` does, forget it: a later test starting its own cluster must not find this one).
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{self.port}"):
            current.unlink()

"""A multi-node Ray cluster on this machine: a head raylet (no CPUs: no rollout actor lands there) and
worker raylets, each started with `ray start --block` in its own process group, with its own
`--num-cpus` and a resource ``clawfast_node_<i>``. Objects, actor placement and node death are Ray's
real mechanisms; `kill_worker` SIGKILLs a worker's whole process group, as a preemption would. The
same commands start a cluster of several machines (docs/DESIGN.md).

Every process group is waited for within bounded times and killed if it outlives them, so nothing is
left running. Token authentication (on by default for `ray start`) is off for this loopback-only
cluster: ``RAY_AUTH_MODE=disabled``, set for the whole test process by tests/conftest.py (Ray reads the
mode once per process, so every Ray cluster of the tests must share it); a cluster across machines
keeps it on.
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

import ray

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    def __init__(self, log_dir: Path, *, workers: int = 2, cpus_per_worker: int = 1) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if os.environ.get("RAY_AUTH_MODE") != "disabled":
            raise RuntimeError("the test cluster runs without token authentication: set RAY_AUTH_MODE=disabled "
                               "for the whole process (tests/conftest.py does)")
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        self.head: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = []
        try:
            self.head = self._start("head", "--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false")
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

    def alive_nodes(self) -> list[dict]:
        return [n for n in ray.nodes() if n["Alive"]]

    def node_id(self, i: int) -> str:
        """The Ray node id of worker `i` (by its resource)."""
        [node] = [n for n in self.alive_nodes() if f"clawfast_node_{i}" in n["Resources"]]
        return node["NodeID"]

    def start_worker(self, i: int, cpus: int = 1) -> None:
        """Start worker raylet `i` (again, after `kill_worker`) and wait until the cluster counts it."""
        before = len(self.alive_nodes())
        proc = self._start(f"worker{i}", f"--address={self.address}", f"--num-cpus={cpus}",
                           f"--resources={json.dumps({f'clawfast_node_{i}': 1})}")
        if i < len(self.workers):
            self.workers[i] = proc
        else:
            self.workers.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.alive_nodes()) <= before:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker raylet {i} did not join (see {self.log_dir / f'worker{i}.log'})")
            time.sleep(0.3)

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker `i`'s process group (its raylet, the actors' worker processes, their children)."""
        proc = self.workers[i]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
        self.workers[i] = None

    def close(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        procs = [p for p in (*self.workers, self.head) if p is not None]
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
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

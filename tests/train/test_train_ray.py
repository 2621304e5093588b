"""`clawfast train` with ``distributed.rollouts = "ray"``: a one-step run whose rollouts run in a Ray
actor of a local cluster (started by the run: ``ray_address = "local"``), through the real proxy
(in the trainer's process, reached from the actor's node through its loopback relay), real
mini-swe-agent and the verifier, and are then trained on. The scripted engine plays each task's
oracle (the test is about where rollouts run, not about what the model says). The sandbox is
bubblewrap where it and socat are installed (the relayed port is then the sandbox's only peer), the
"local" backend elsewhere. Ray is installed by the test setup (the ``ray`` extra)."""

from __future__ import annotations

import os
import shutil

import pytest
import ray

from loop_fixtures import oracle_engine_factory

SANDBOX = "bwrap" if shutil.which("bwrap") and shutil.which("socat") else "local"


@pytest.mark.harness
@pytest.mark.slow
def test_one_step_with_rollouts_on_ray_actors(tmp_path, monkeypatch):
    from clawfast.records import read_rollouts
    from clawfast.tasks import clawbench_mini
    from clawfast.train import distributed, loop
    from clawfast.train.config_file import config_from_dict
    from clawfast.train.metrics_log import read_metrics

    config = config_from_dict({
        "run_dir": str(tmp_path / "run"), "steps": 1, "seed": 1,
        "tasks": {"difficulties": ["easy"]},
        "rollout": {"harnesses": ["mini-swe-agent"], "tasks_per_step": 1, "samples_per_task": 2, "concurrency": 2,
                    "sandbox": SANDBOX, "harness_max_turns": 8, "timeout_s": 240,
                    "harness_options": {"mini-swe-agent": {"instance_template": "Task: {{task}}"}}},
        "eval": {"before": False, "after": False},
        "optim": {"micro_batch_tokens": 4096},
        "distributed": {"rollouts": "ray", "ray_address": "local"},
    })
    tasks = [t for t in clawbench_mini(0) if t.split == "train"]

    seen = {}
    real_step = distributed.train_on_rollouts

    def spy(policy, optimizer, results, cfg, state, ref_policy=None):
        seen["results"] = list(results)
        seen["nodes"] = {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # the cluster is up during the step
        return real_step(policy, optimizer, results, cfg, state, ref_policy)

    monkeypatch.setattr(loop, "build_engine", oracle_engine_factory(config, tasks))
    monkeypatch.setattr(distributed, "train_on_rollouts", spy)
    summary = loop.train(config, progress=False)

    assert summary["steps"] == 1
    assert not ray.is_initialized()  # the cluster the run started is gone
    results = seen["results"]
    assert len(results) == 2 and {r.task_id for r in results} == {results[0].task_id}
    for r in results:
        assert (r.status, r.reward) == ("ok", 1.0), r.info
        # Run by a Ray actor on a node of the cluster, in another process than the trainer.
        assert r.info["ray_node_id"] in seen["nodes"] and r.info["ray_actor_id"]
        assert r.info["actor_pid"] != os.getpid()
        assert r.calls and {c.weight_version for c in r.calls} == {0}
    # The proxy's own records (written in the trainer's process) name the actor too.
    on_disk = {r.rollout_id: r for r in read_rollouts(tmp_path / "run" / "records")}
    assert {r.rollout_id for r in results} == set(on_disk)
    assert {on_disk[r.rollout_id].info["ray_actor_id"] for r in results} == {r.info["ray_actor_id"] for r in results}
    (record,) = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert record["rollouts"] == 2 and record["rollouts_trained"] == 2 and record["tokens_packed"] > 0
    assert record["stepped"] == 1.0 and record["weight_version"] == 1
    assert record["tasks"] == results[0].task_id


def test_loopback_relay_carries_bytes_both_ways_until_eof():
    """The relay each actor puts on its node's loopback: several connections at once, random
    payloads of up to 1 MB, each echoed back whole after the client half-closes."""
    import random
    import socket
    import socketserver
    import threading

    from clawfast.rollout.ray_backend import LoopbackRelay

    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            while data := self.request.recv(1 << 16):
                self.request.sendall(data)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = LoopbackRelay(f"127.0.0.1:{server.server_address[1]}")
    results = {}

    def client(i: int) -> None:
        payload = random.Random(i).randbytes(random.Random(i).randint(1, 1 << 20))
        with socket.create_connection(("127.0.0.1", relay.port), timeout=60) as s:
            sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
            sender.start()
            got = bytearray()
            while chunk := s.recv(1 << 16):
                got += chunk
            sender.join()
        results[i] = bytes(got) == payload

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == {i: True for i in range(4)}
    finally:
        relay.close()
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="host:port"):
        LoopbackRelay("no-port")

"""`clawfast train` on a cluster of three raylets on this machine (`LocalRayCluster`: a head and two
worker nodes, one rollout actor on each) that loses a worker node under a step's rollouts: those on
the dead node end as ``sandbox_error``, run again on the live node with the same task and sample
index, and every step trains its group whole; the run completes its three steps, and its metrics say
what happened. Synchronous (the node dies under step 2's group) and asynchronous with
``max_staleness = 1`` (it dies under the first two groups, which run at once: the producer counts the
retried groups and the bound holds). The scripted engine plays each task's oracle through real
mini-swe-agent in bubblewrap (the test is about where rollouts run and what survives a node, not
about the model)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

from loop_fixtures import oracle_engine_factory, record_trained

pytestmark = [
    pytest.mark.harness,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("socat") is None,
                       reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)"),
]


@pytest.mark.parametrize("staleness", [None, 1], ids=["sync", "async"])
def test_a_run_loses_a_node_and_trains_its_groups_whole(tmp_path, monkeypatch, capsys, staleness):
    from clawfast.proxy.rollouts import RETRIED_DIR
    from clawfast.records import read_rollouts
    from clawfast.rollout.local_cluster import LocalRayCluster
    from clawfast.tasks import clawbench_mini
    from clawfast.train import loop
    from clawfast.train.config_file import config_from_dict
    from clawfast.train.metrics_log import read_metrics

    cluster = LocalRayCluster(tmp_path / "ray-logs", workers=2, cpus_per_worker=1)
    try:
        doomed, survivor = cluster.node_id(0), cluster.node_id(1)
        run_dir = tmp_path / "run"
        config = config_from_dict({
            "run_dir": str(run_dir), "steps": 3, "seed": 1,
            "tasks": {"difficulties": ["easy"]},
            "rollout": {"harnesses": ["mini-swe-agent"], "tasks_per_step": 1, "samples_per_task": 4,
                        "concurrency": 2, "sandbox": "bwrap", "harness_max_turns": 8, "timeout_s": 240,
                        "harness_options": {"mini-swe-agent": {"instance_template": "Task: {{task}}"}}, "infra_retries": 2},
            "eval": {"before": False, "after": False},
            "optim": {"micro_batch_tokens": 4096},
            "distributed": {"rollouts": "ray", "ray_address": cluster.address},
            **({"algorithm": {"max_staleness": staleness}} if staleness is not None else {}),
        })
        tasks = [t for t in clawbench_mini(0) if t.split == "train"]

        records = run_dir / "records"
        killed = threading.Event()

        def kill_when_8_opened() -> None:
            # Eight rollouts have opened and the last four are under way: synchronous, step 2's group
            # (step 1's four are done); asynchronous, the first two groups, which start together.
            deadline = time.monotonic() + 600
            while len(list(records.glob("*.cfr"))) < 8 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
            cluster.kill_worker(0)
            killed.set()

        monkeypatch.setattr(loop, "build_engine", oracle_engine_factory(config, tasks))
        trained = record_trained(monkeypatch)
        threading.Thread(target=kill_when_8_opened, daemon=True).start()
        summary = loop.train(config, progress=False)
        assert killed.is_set()
    finally:
        cluster.close()
    left = subprocess.run(["pgrep", "-f", f"127.0.0.1:{cluster.port}"], capture_output=True, text=True).stdout.split()
    assert not left, f"Ray processes of the cluster left running: {left}"

    assert summary["steps"] == 3 and [len(rs) for rs in trained] == [4, 4, 4]
    # Every step's group is whole: one rollout per sample index, every one ok; those the dead node held
    # ran again on the live node.
    for rs in trained:
        assert sorted(r.sample_index for r in rs) == [0, 1, 2, 3] and len({r.task_id for r in rs}) == 1
        assert all((r.status, r.reward) == ("ok", 1.0) for r in rs), [r.info for r in rs]
    retried = [r for rs in trained for r in rs if r.info.get("retries")]
    assert all(r.info["ray_node_id"] == survivor for r in retried)
    assert all(n["ray_node_id"] == doomed and n["actor_died"] for r in retried for n in r.info["retries"])
    assert all(r.info["ray_node_id"] == survivor for r in trained[2])  # the last step ran on the live node
    # The dead attempts were closed and set aside, never trained.
    aside = {a.rollout_id for a in read_rollouts(records / RETRIED_DIR)}
    assert aside, "the killed node held no rollout"
    noted = {n["rollout_id"] for r in retried for n in r.info["retries"]}
    assert noted <= aside and not aside & {r.rollout_id for rs in trained for r in rs}

    steps = [m for m in read_metrics(run_dir) if m["kind"] == "train"]
    assert [m["rollouts_trained"] for m in steps] == [4, 4, 4]
    assert sum(m["rollout/retries"] for m in steps) == len(noted)
    assert sum(m[f"rollout/node/{survivor[:8]}"] for m in steps) >= len(retried)
    if staleness is None:
        # Step 2's group ran again what the node held, and trained whole.
        assert retried and noted == aside
        assert [bool(m["rollout/retries"]) for m in steps] == [False, True, False]
        assert steps[1]["rollout/nodes_lost"] == 1
        # The log's step line says it.
        assert "step 2: " in (out := capsys.readouterr().out)
        assert f"infrastructure: {len(retried)} rollout(s) retried, 1 node(s) lost" in out
    else:
        # The producer counts each retried group it hands out; a group that its retry made later than
        # the bound allows is dropped (and replaced) rather than trained stale: either way the bound holds.
        groups_retried = sum(any(r.info.get("retries") for r in rs) for rs in trained)
        assert sum(m["async/retried_groups"] for m in steps) == groups_retried
        assert noted == aside or sum(m["async/dropped_stale_groups"] for m in steps) >= 1
        assert all(m["async/staleness_max"] <= staleness for m in steps)

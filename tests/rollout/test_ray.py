"""The Ray path: the same per-rollout worker in two Ray actors of a local cluster, talking to the real
proxy through its gRPC control plane, running real mini-swe-agent in bubblewrap sandboxes with the
scripted engine replaying each task's oracle. Skipped, saying why, where Ray is not installed
(`pip install clawfast[ray]`)."""

from __future__ import annotations

import secrets
import shutil

import pytest

ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'clawfast[ray]' to run the Ray path")

from clawfast.harness import get_harness  # noqa: E402
from clawfast.harness.check import check_task, scripted_proxy  # noqa: E402
from clawfast.rollout import make_specs  # noqa: E402
from clawfast.rollout.ray_backend import RaySetup, run_on_ray  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("socat") is None,
    reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)",
)


def test_two_actor_local_cluster_runs_rollouts_with_truthful_results(tmp_path):
    from clawfast.proxy.grpc_service import GrpcControlServer

    harness = get_harness("mini-swe-agent")
    harness.installation  # the actors find it in the same cache
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, ["mini-swe-agent"], k=2)
    token = secrets.token_urlsafe(16)
    with scripted_proxy([harness], tasks, tmp_path / "records") as (_, registry), \
            GrpcControlServer(registry, token) as control:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            setup = RaySetup(control.address, token, "clawbench-mini", ("mini-swe-agent",),
                             timeout_s=240, concurrency=2, logs_dir=str(tmp_path / "logs"))
            results = run_on_ray(specs, setup, num_actors=2, actor_options={"num_cpus": 1})
        finally:
            ray.shutdown()
        assert registry.open_ids() == []
    assert [(r.task_id, r.sample_index) for r in results] == [(s.task.id, s.sample_index) for s in specs]
    for r in results:
        assert (r.status, r.reward) == ("ok", 1.0), r.info
        assert len(r.calls) == len(check_task(r.task_id).oracle) + 1
    assert len({r.rollout_id for r in results}) == 4
    assert len({r.info["actor_pid"] for r in results}) == 2  # both actors ran rollouts

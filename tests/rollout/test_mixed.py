"""The scheduler over real harnesses: tasks x all four harnesses through one proxy and one scripted
engine (each rollout replays its task's oracle through its own harness's shell tool), in bubblewrap
sandboxes, concurrently. Marked `harness`: it needs the npm installs of Claude Code, OpenClaw, Codex."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter

import pytest

from clawfast.harness import HARNESSES, get_harness
from clawfast.harness.check import check_task, scripted_proxy
from clawfast.rollout import RolloutConfig, RolloutScheduler, RolloutWorker, make_specs

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("socat") is None,
                       reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)"),
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm installs the harnesses"),
]

PROTOCOL = {"anthropic": "anthropic", "openai-chat": "chat", "openai-responses": "responses"}


def test_tasks_x_harnesses_through_one_proxy(tmp_path, private_tmp):
    from clawfast.sandbox import create_backend
    from clawfast.tasks.sandbox_runner import SandboxRunner

    harnesses = {name: get_harness(name, timeout_s=300) for name in sorted(HARNESSES)}
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, list(harnesses), k=1)
    backend = create_backend("bwrap")
    try:
        with scripted_proxy(list(harnesses.values()), tasks, tmp_path / "records") as (_, registry), \
                SandboxRunner(backend) as verifier_runner:
            worker = RolloutWorker(registry, backend, harnesses, verifier_runner=verifier_runner,
                                   config=RolloutConfig(timeout_s=300, logs_dir=tmp_path / "logs"))
            scheduler = RolloutScheduler(worker, concurrency=4)
            results = asyncio.run(scheduler.run(specs))
            assert registry.open_ids() == []
    finally:
        backend.close()
    bad = [(r.task_id, r.harness, r.status, r.reward, r.info.get("error")) for r in results
           if (r.status, r.reward) != ("ok", 1.0)]
    assert not bad
    assert Counter(r.harness for r in results) == {name: 2 for name in harnesses}
    for r in results:
        assert len(r.calls) == len(check_task(r.task_id).oracle) + 1
        assert {c.metadata.get("protocol") for c in r.calls} == {PROTOCOL[HARNESSES[r.harness].protocol]}

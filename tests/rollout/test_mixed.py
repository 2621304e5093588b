"""The rollout service over real harnesses: tasks x all four harnesses through one proxy and one
scripted engine (each rollout replays its task's oracle through its own harness's shell tool), in
bubblewrap sandboxes, concurrently. Marked `harness`: it needs the npm installs of Claude Code, OpenClaw, Codex."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest

from clawfast.embedded import ensure_embedded_model
from clawfast.harness import HARNESSES
from clawfast.rollout import ORACLE, HarnessConfig, ProxyConfig, RolloutService, SchedulingConfig, make_specs
from clawfast.rollout.check import check_task

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("socat") is None,
                       reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)"),
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm installs the harnesses"),
]

PROTOCOL = {"anthropic": "anthropic", "openai-chat": "chat", "openai-responses": "responses"}


def test_tasks_x_harnesses_through_one_proxy(tmp_path, private_tmp):
    tasks = [check_task("files-create-0"), check_task("files-lines-0")]
    specs = make_specs(tasks, sorted(HARNESSES), k=1)
    with RolloutService(ORACLE, ensure_embedded_model(), records_dir=tmp_path / "records",
                        proxy=ProxyConfig(max_model_len=65536),
                        harnesses=HarnessConfig({name: {"timeout_s": 300} for name in HARNESSES}, timeout_s=300,
                                                logs_dir=tmp_path / "logs"),
                        scheduling=SchedulingConfig(concurrency=4), oracle_tasks=tasks) as service:
        results = service.run(specs)
        assert service.registry.open_ids() == []
        # The harnesses that take a context were told the one the proxy serves; the others were not.
        told = {name: service.harness_options[name].get("context_window") for name in HARNESSES}
        assert told == {"claude-code": None, "codex": 65536, "mini-swe-agent": None, "openclaw": 65536}
        assert service.adapters["codex"].context_window == service.adapters["openclaw"].context_window == 65536
    bad = [(r.task_id, r.harness, r.status, r.reward, r.info.get("error")) for r in results
           if (r.status, r.reward) != ("ok", 1.0)]
    assert not bad
    assert Counter(r.harness for r in results) == {name: 2 for name in HARNESSES}
    for r in results:
        assert len(r.calls) == len(check_task(r.task_id).oracle) + 1
        assert {c.metadata.get("protocol") for c in r.calls} == {PROTOCOL[HARNESSES[r.harness].protocol]}

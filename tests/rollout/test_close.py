"""`worker.close_rollout` against the real registry: the result a trainer gets keeps what the proxy
added at close (the rollout's refusals) beside the worker's own info and timings."""

from __future__ import annotations

import time

import numpy as np

from clawfast.proxy.rollouts import RolloutRegistry, refusal
from clawfast.records import read_rollout, rollout_path
from clawfast.rollout.spec import RolloutSpec
from clawfast.rollout.worker import close_rollout
from clawfast.tasks.task import CallableVerifier, Task


def test_refusals_reach_the_returned_result(tmp_path):
    registry = RolloutRegistry(tmp_path)
    opened = registry.open(task_id="t", harness="h", sample_index=0)
    registry.get(opened.rollout_id).refuse(
        refusal(400, "invalid_request", "this rollout's budget of 2 model calls is spent", protocol="chat",
                path="/v1/chat/completions", stream=False))
    spec = RolloutSpec(Task(id="t", instruction="do it", verifier=CallableVerifier(lambda workspace: 1.0), oracle=(), tags={"category": "test", "split": "train"}), "h", 0)
    result = close_rollout(registry, spec, opened.rollout_id, 1.0, "ok", {"verifier": {"score": 1.0}}, time.monotonic())
    [entry] = result.info["refusals"]
    assert (entry["status"], entry["path"]) == (400, "/v1/chat/completions")
    assert result.info["verifier"] == {"score": 1.0} and set(result.info["timings"]) == {"close", "total"}
    on_disk = read_rollout(rollout_path(tmp_path, opened.rollout_id))
    assert on_disk.info["refusals"] == result.info["refusals"]


def test_an_outcome_no_record_can_hold_closes_as_a_proxy_error(tmp_path):
    # The registry refuses the outcome and leaves the rollout open; close_rollout closes it again as a
    # proxy_error instead of raising (which stopped the whole run) or leaving it open.
    registry = RolloutRegistry(tmp_path)
    opened = registry.open(task_id="t", harness="h", sample_index=0)
    spec = RolloutSpec(Task(id="t", instruction="do it", verifier=CallableVerifier(lambda workspace: 1.0), oracle=(),
                            tags={"category": "test", "split": "train"}), "h", 0)
    registry.get(opened.rollout_id).append(
        prompt_ids=np.arange(5, dtype=np.int32), output_ids=np.arange(3, dtype=np.int32),
        infer_logprobs=np.full(3, -0.5, np.float32), weight_version=0)
    result = close_rollout(registry, spec, opened.rollout_id, 1.0, "ok", {"span": (1, 2), "verifier": {"score": 1.0}},
                           time.monotonic())
    assert (result.status, result.reward, len(result.calls)) == ("proxy_error", 1.0, 1)  # the calls are kept
    assert "info['span'] is a tuple" in result.info["error"] and "span" not in result.info
    assert result.info["verifier"] == {"score": 1.0}  # what a record can hold of the outcome stays
    assert registry.open_ids() == []
    on_disk = read_rollout(rollout_path(tmp_path, opened.rollout_id))
    assert (on_disk.status, on_disk.info) == ("proxy_error", result.info)

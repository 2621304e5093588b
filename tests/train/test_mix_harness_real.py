"""A mixed-harness training step through two real harnesses (issue 6): `clawfast.train.loop.train`
on examples/mix_harness_small.toml, cut to one step on one task: mini-swe-agent and Codex CLI, each
rollout in a fresh bubblewrap sandbox talking to the in-process proxy, which serves the embedded
policy's current weights from the torch engine. Nothing is scripted: the calls are sampled from the
(random) policy, so the rollouts fail and their rewards are 0, which is what the assertions expect
to be reported truthfully, not what they require.

What is checked against an account that the trainer did not write:
- the calls: the proxy's record files, and each harness's own log of the calls it made (mini-swe-agent's
  trajectory holds the proxy's response ids and token counts, Codex's `turn.completed` event the sum of
  its calls' input and output tokens); every first prompt holds the task's instruction;
- the statuses: the harness's exit code and time-out as the sandbox saw them, and the verifier's verdict;
- the metrics record: pass@1, reward and status counts per harness recomputed from the results, and the
  number of trained target tokens recomputed from the calls (both harnesses' tokens are in the loss);
- the grouping: GRPO's group ids are exactly the (task, harness) pairs.

Takes about 1-2 minutes on 2 CPU cores (one ~12K-token Codex prompt per Codex rollout, prefilled by
the torch engine and trained under the dense tree mask). Needs bubblewrap, socat and the pinned
harnesses (`clawfast harness install mini-swe-agent codex`; the first run installs them, which needs
the package registries).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from clawfast.harness.codex import Codex
from clawfast.records import read_rollout, rollout_path
from clawfast.train.checkpoint import list_checkpoints
from clawfast.train.config_file import load_config
from clawfast.train.metrics_log import read_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mix_harness_small.toml"
HARNESSES = ("mini-swe-agent", "codex")
PROTOCOL = {"mini-swe-agent": "chat", "codex": "responses"}  # what each harness speaks to the proxy
K = 2  # samples per (task, harness)

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("socat") is None,
                       reason="needs bubblewrap and socat (Debian: apt-get install bubblewrap socat)"),
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm installs Codex CLI (Debian: apt-get install npm)"),
]


def expected_status(run: dict, verdict: dict, finished: bool) -> str:
    """The status the sandbox's account of the harness run, the harness's own record of whether it
    finished (`finished`: mini-swe-agent exits 0 at its step limit) and the verifier's verdict call for
    (clawfast.rollout.worker's definitions)."""
    if run["timed_out"]:
        return "timeout"
    if run["exit_code"] != 0 or not finished:
        return "harness_error"
    return "ok" if verdict["status"] == "ok" else "verifier_error"


def finished(run_dir: Path, rollout) -> bool:
    """Whether the harness recorded its run as finished: mini-swe-agent's kept trajectory says
    "Submitted"; the others exit non-zero where they did not finish."""
    if rollout.harness != "mini-swe-agent":
        return True
    traj = json.loads((run_dir / "logs" / rollout.rollout_id / "home" / "mini.traj.json").read_text())
    return traj["info"]["exit_status"] == "Submitted"


def trainable_tokens(rollout) -> int:
    """Generated tokens the loss sees for one rollout, counted from its calls alone: every output of
    a main-thread call, except a call retried later with the very same prompt (a dead leaf) unless it
    is the rollout's last main call. A token on several kept paths is one target, and every generated
    token is the output of exactly one call, so the sum over calls counts each target once."""
    main = [c for c in rollout.calls if not c.excluded]
    last = max(c.call_index for c in main)
    total = 0
    for c in main:
        retried = any(d.call_index > c.call_index and np.array_equal(d.prompt_ids, c.prompt_ids) for d in rollout.calls)
        if not retried or c.call_index == last:
            total += len(c.output_ids)
    return total


def _without_late_timings(r):
    timings = {k: v for k, v in r.info["timings"].items() if k not in ("close", "total")}
    return dataclasses.replace(r, info={**r.info, "timings": timings})


def mixed_config(run_dir: Path):
    """examples/mix_harness_small.toml cut to one step on one task, K samples per harness, logs kept."""
    return load_config(EXAMPLE, overrides=[
        "steps=1", "rollout.tasks_per_step=1", f"rollout.samples_per_task={K}", "rollout.keep_logs=true",
        "eval.before=false", "eval.after=false", f"run_dir={json.dumps(str(run_dir))}",
    ])  # fmt: skip


def train_watched(config, monkeypatch) -> dict:
    """Run `train(config)`, keeping what reached the trainer: the step's rollouts, GRPO's group ids
    and advantages, the summary and the train metrics record."""
    from clawfast.train import distributed, loop, prepare

    seen: dict = {}
    real_training_step, real_group_ids, real_advantages = distributed.train_on_rollouts, prepare.group_ids, prepare.grpo_rollout_advantages

    def training_step(policy, optimizer, results, *args, **kwargs):
        seen["results"] = list(results)
        return real_training_step(policy, optimizer, results, *args, **kwargs)

    def group_ids(rollouts, group_by="task", groups=None):
        ids = real_group_ids(rollouts, group_by, groups)
        seen["groups"] = ([(r.task_id, r.harness) for r in rollouts], ids)
        return ids

    def grpo_rollout_advantages(rewards, ids, **kwargs):
        adv = real_advantages(rewards, ids, **kwargs)
        seen["advantages"] = (np.asarray(rewards), np.asarray(ids), adv)
        return adv

    monkeypatch.setattr(distributed, "train_on_rollouts", training_step)
    monkeypatch.setattr(prepare, "group_ids", group_ids)
    monkeypatch.setattr(prepare, "grpo_rollout_advantages", grpo_rollout_advantages)
    seen["summary"] = loop.train(config, progress=False)
    (seen["record"],) = [r for r in read_metrics(config.run_dir) if r["kind"] == "train"]
    return seen


def test_mixed_harness_step_through_real_harnesses(tmp_path, monkeypatch):
    config = mixed_config(tmp_path / "run")
    assert tuple(config.rollout.harnesses) == HARNESSES and config.rollout.sandbox == "bwrap"
    assert config.model.path == "embedded" and config.engine.kind == "torch"
    assert config.group_by == "task_harness"
    check_mixed_step(config, train_watched(config, monkeypatch))


def check_mixed_step(config, seen: dict) -> None:
    """Every assertion of the module docstring, on one watched run of `mixed_config`."""
    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model
    from clawfast.train.data import load_tasks

    run_dir, record = Path(config.run_dir), seen["record"]

    # --- the run completed: one step, checkpointed, weights pushed to the engine.
    assert seen["summary"]["steps"] == 1
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-000001"]
    assert record["stepped"] == 1.0 and record["weight_version"] == 1.0 and np.isfinite(record["loss"])

    # --- K rollouts of the step's task by each harness reached the trainer.
    results = seen["results"]
    task_id = record["tasks"]
    task = load_tasks(config, "train")[task_id]
    assert sorted((r.task_id, r.harness, r.sample_index) for r in results) == sorted(
        (task_id, h, i) for h in HARNESSES for i in range(K))

    # --- every call came through the proxy, token for token, and is the harness's own.
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    for r in results:
        why = f"{r.harness} rollout {r.rollout_id}: status {r.status}, {r.info.get('error')}"
        assert r.calls, f"no call reached the proxy ({why})"
        # The proxy's record file holds the same calls, status and reward (its `info` lacks only the
        # close/total timings, taken after the file was closed).
        durable = read_rollout(rollout_path(run_dir / "records", r.rollout_id))
        assert durable.equals(_without_late_timings(r)), why
        for c in r.calls:
            assert (c.rollout_id, c.harness) == (r.rollout_id, r.harness)
            assert c.metadata["protocol"] == PROTOCOL[r.harness], why
            assert len(c.prompt_ids) > 0 and 0 < len(c.output_ids) <= config.engine.max_tokens
            assert np.all(np.isfinite(c.infer_logprobs)) and np.all(c.infer_logprobs <= 0)
            assert c.weight_version == 0  # sampled before the step's weight push
        assert task.instruction in tokenizer.decode(r.calls[0].prompt_ids.tolist()), why
        logs = run_dir / "logs" / r.rollout_id
        if r.harness == "mini-swe-agent":
            if r.status == "ok":  # its trajectory records each model response: the proxy's id, token counts
                traj = json.loads((logs / "home" / "mini.traj.json").read_text())
                responses = [m["extra"]["response"] for m in traj["messages"] if "response" in m.get("extra", {})]
                assert [(x["id"], x["usage"]["prompt_tokens"], x["usage"]["completion_tokens"]) for x in responses] == [
                    (c.metadata["response_id"], len(c.prompt_ids), len(c.output_ids)) for c in r.calls], why
        else:
            # Codex: the real harness's multi-thousand-token prompt, and its own token count of the calls.
            assert len(r.calls[0].prompt_ids) > 5000
            assert all(c.metadata["headers"]["user-agent"].startswith(f"codex_exec/{Codex.version}") for c in r.calls)
            if r.status == "ok":
                events = [json.loads(line) for line in (logs / "stdout").read_text().splitlines() if line.startswith("{")]
                usage = [e["usage"] for e in events if e.get("type") == "turn.completed"]
                assert usage == [{**usage[0], "input_tokens": sum(len(c.prompt_ids) for c in r.calls),
                                  "output_tokens": sum(len(c.output_ids) for c in r.calls)}], why

    # --- statuses and rewards are what the sandbox and the verifier saw.
    for r in results:
        run = json.loads((run_dir / "logs" / r.rollout_id / "run.json").read_text())
        verdict = r.info["verifier"]
        assert r.status == expected_status(run, verdict, finished(run_dir, r)), (r.rollout_id, run, verdict)
        assert r.reward == (verdict["score"] if verdict["status"] == "ok" else 0.0)

    # --- the metrics record: pass@1 and reward per harness, statuses, calls.
    for h in HARNESSES:
        mine = [r for r in results if r.harness == h]
        assert record[f"pass@1/{h}"] == sum(r.reward >= 1.0 for r in mine) / K
        assert record[f"reward/{h}"] == pytest.approx(sum(r.reward for r in mine) / K)
    assert record["rollouts"] == len(HARNESSES) * K
    assert {k[7:]: v for k, v in record.items() if k.startswith("status/")} == Counter(r.status for r in results)
    assert record["calls_per_rollout"] == pytest.approx(np.mean([len(r.calls) for r in results]))

    # --- both harnesses' rollouts were trained on, every generated token of them in the loss.
    kept = [r for r in results if r.status in config.algorithm.keep_statuses]
    assert {r.harness for r in kept} == set(HARNESSES), [(r.harness, r.status) for r in results]
    assert (record["rollouts_in"], record["rollouts_trained"]) == (len(results), len(kept))
    assert record["dropped_status"] == len(results) - len(kept)
    assert record["dropped_too_long"] == record["dropped_no_calls"] == record["dropped_branching"] == 0
    assert record["num_targets"] == sum(trainable_tokens(r) for r in kept)
    # The Codex rollouts start with the same long prompt: the packed forest holds it once.
    codex = [r.calls[0].prompt_ids for r in kept if r.harness == "codex"]
    if len(codex) >= 2:
        a, b = codex[:2]
        n = min(len(a), len(b))
        shared = int(np.argmin(a[:n] == b[:n])) if not np.array_equal(a[:n], b[:n]) else n
        assert shared > 5000 and record["tokens_packed"] <= record["tokens_per_call_flat"] - shared

    # --- GRPO grouped by (task, harness): group ids and (task, harness) pairs correspond one to one.
    keys, ids = seen["groups"]
    assert sorted(keys) == sorted((r.task_id, r.harness) for r in kept)
    assert set(keys) == {(task_id, h) for h in HARNESSES}
    assert len(set(zip(keys, ids.tolist()))) == len(set(keys)) == len(set(ids.tolist())) == len(HARNESSES)
    rewards, adv_ids, adv = seen["advantages"]
    assert np.array_equal(adv_ids, ids)
    for g in set(ids.tolist()):
        in_group = adv_ids == g
        assert abs(adv[in_group].mean()) < 1e-9  # group-relative: zero mean within each (task, harness)
        if np.ptp(rewards[in_group]) == 0:
            assert np.all(adv[in_group] == 0)  # equal rewards: no signal, whatever the other harness got

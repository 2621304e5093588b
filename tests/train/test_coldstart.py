"""Cold start: the SFT schedule (warm-up, cosine decay to zero, one scheduler step per update) and
its one-line report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loop_fixtures import make_tiny_model

from clawfast.records import CallRecord, RolloutResult
from clawfast.train.coldstart import demonstration_tree, sft_epoch, warmup_cosine
from clawfast.train.policy import Policy


def test_warmup_cosine_ramps_then_decays_to_zero():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = warmup_cosine(opt, total_updates=40, warmup_frac=0.1)
    lrs = []
    for _ in range(41):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [0.5 * min(1.0, (k + 1) / 4) * 0.5 * (1 + math.cos(math.pi * k / 40)) for k in range(41)]
    assert np.allclose(lrs, want, rtol=1e-12, atol=0)
    assert lrs[0] < lrs[1] < lrs[2] < lrs[3]  # the warm-up ramp
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # then a monotone decay
    assert lrs[40] == 0.0


def test_sft_epoch_steps_the_schedule_once_per_update(tmp_path):
    rng = np.random.default_rng(3)
    demos = []
    for i in range(5):
        p, o = rng.integers(0, 64, 9).astype(np.int32), rng.integers(0, 64, 4).astype(np.int32)
        call = CallRecord(f"r{i}", 0, "h", p, o, np.full(4, -1.0, np.float32))
        demos.append(RolloutResult(f"r{i}", f"t{i}", "h", calls=[call], reward=1.0))
    policy = Policy.from_pretrained(make_tiny_model(tmp_path / "m"))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    sched = warmup_cosine(opt, total_updates=3)
    m = sft_epoch(policy, opt, [demonstration_tree(d) for d in demos], micro_batch_tokens=64, batch_rollouts=2, rng=rng,
                  scheduler=sched)
    assert m["updates"] == 3 and sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == 0.0


def test_coldstart_line_reports_kept_demonstrations_each_epoch_and_both_times():
    from clawfast.train.report import coldstart_line

    summary = {"tasks": 71, "captured": 71, "kept": 65, "time_capture_s": 312.04, "nll_epoch_1": 0.5,
               "nll_epoch_2": 0.0312, "time_sft_s": 191.96}
    assert coldstart_line(summary) == ("cold start: 65 of 71 demonstrations solved their task (captured in 312.0 s); "
                                       "SFT 2 epochs, nll by epoch 0.500, 0.031 (192.0 s)")
    one = {k: v for k, v in summary.items() if k != "nll_epoch_2"}
    assert "SFT 1 epoch, nll by epoch 0.500 (" in coldstart_line(one)
    assert "solved their task, 3 too long for a micro-batch (captured" in coldstart_line({**summary, "dropped_too_long": 3})


def test_a_demonstration_trains_the_calls_an_rl_step_would(tmp_path):
    """Calls are trained or excluded by the thread kinds the rollout's structure gives them, not by the
    proxy's hints: with every hint removed, a Claude Code capture's subagent and compaction calls are
    still excluded from the main-thread cold start, and trained where `train_threads` names them."""
    import dataclasses

    from stored_threads import labels, stored_rollouts

    capture = stored_rollouts(tmp_path)[0]
    unhinted = dataclasses.replace(capture, calls=[dataclasses.replace(c, tags=("main",)) for c in capture.calls])
    kinds = labels("claude-code-threads")
    tree = demonstration_tree(unhinted)
    excluded = dict(zip(tree.call_indices.tolist(), tree.call_excluded.tolist()))
    assert [excluded[c.call_index] for c in unhinted.calls] == [k != "main" for k in kinds]
    every = demonstration_tree(unhinted, ("main", "subagent", "compaction"))
    assert not every.call_excluded.any()


def test_a_demonstration_too_long_for_a_micro_batch_is_left_out_and_the_rest_train(tmp_path):
    """One path past the micro-batch used to make pack raise and end the whole cold start: the cold start
    keeps the trees whose longest kept path fits (`PrefixTree.longest_kept_path`) and trains those."""
    rng = np.random.default_rng(0)
    trees = []
    for i, n in enumerate((40, 90, 50)):
        p, o = rng.integers(0, 64, n).astype(np.int32), rng.integers(0, 64, 10).astype(np.int32)
        demo = RolloutResult(f"r{i}", "t", "h", calls=[CallRecord(f"r{i}", 0, "h", p, o, np.full(10, -1.0, np.float32))],
                             reward=1.0)
        trees.append(demonstration_tree(demo))
    assert [t.longest_kept_path for t in trees] == [50, 100, 60]
    policy = Policy.from_pretrained(make_tiny_model(tmp_path / "m"))
    with pytest.raises(ValueError):
        sft_epoch(policy, torch.optim.SGD(policy.parameters(), lr=0.0), trees, micro_batch_tokens=64,
                  batch_rollouts=3, rng=rng)
    fitting = [t for t in trees if t.longest_kept_path <= 64]
    m = sft_epoch(policy, torch.optim.SGD(policy.parameters(), lr=0.0), fitting, micro_batch_tokens=64,
                  batch_rollouts=3, rng=rng)
    assert m["updates"] == 1 and m["targets"] == 20


def test_a_cold_start_through_the_real_harness_trains_every_solved_demonstration_once_per_epoch(tmp_path, embedded_dir):
    """`run_coldstart` end to end: the easy training tasks of one generator seed played by their oracles
    through the real mini-swe-agent in bwrap sandboxes, every capture solved and kept, then two epochs
    of SFT on their trees (one update per two demonstrations) that move the weights."""
    from clawfast.train.coldstart import demonstration_tasks, run_coldstart
    from clawfast.train.config_file import config_from_dict

    config = config_from_dict({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(embedded_dir)},
        "rollout": {"harnesses": ["mini-swe-agent"]},
        "coldstart": {"enabled": True, "suite_seeds": [1], "difficulties": ["easy"], "categories": ["files"],
                      "epochs": 2, "batch_rollouts": 2, "concurrency": 2, "micro_batch_tokens": 4096}})
    tasks = demonstration_tasks(config)
    assert tasks
    policy = Policy.from_pretrained(embedded_dir)
    before = [p.detach().clone() for p in policy.parameters()]
    summary = run_coldstart(config, policy, embedded_dir, tmp_path / "run")
    assert summary["captured"] == summary["kept"] == len(tasks) and summary["dropped_too_long"] == 0
    assert all(np.isfinite(summary[f"nll_epoch_{e}"]) for e in (1, 2))
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))

"""FSDP2 over two CPU processes (gloo, loopback) gives the loss, gradients and optimizer step of one process
(GRPO with an AdamW step; PPO loss and gradients), for a dense policy and a mixture-of-experts one.

The packed step has an odd number of micro-batches, so one rank repeats a batch with zero loss
weight to keep the collectives matched. Tolerance 1e-5: fp32, same weights and batches; what
differs is only the order of the cross-rank gradient sums.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_step_equivalence import harness_rollouts, longest_kept, tiny_policy

from clawfast.train.prepare import prepare_step
from clawfast.train.step import train_step
from clawfast.train.step_config import StepConfig
from clawfast.train.update import accumulate_gradients

ATOL = 1e-5
WORLD = 2


def _config(rollouts) -> StepConfig:
    """Small micro-batches, in an odd number (>= 3), so one rank must pad."""
    for extra in range(10, 200, 7):
        config = StepConfig(micro_batch_tokens=longest_kept(rollouts) + extra, max_grad_norm=0.05, entropy_coef=0.01)
        n = len(prepare_step(rollouts, None, config).batches)
        if n >= 3 and n % WORLD == 1:
            return config
    raise AssertionError("no micro_batch_tokens gives an odd number of micro-batches")


def _adamw(policy):
    return torch.optim.AdamW(policy.parameters(), lr=1e-3, eps=1e-2, weight_decay=0.01)


def _ppo(config: StepConfig) -> StepConfig:
    return config.model_copy(update={"name": "ppo", "gamma": 0.99, "lam": 0.95})


def _worker(rank: int, store: str, policy, ppo_policy, rollouts, config: StepConfig, out_dir: str) -> None:
    # A file rendezvous: a free TCP port picked before the spawn can be taken by then.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        _sharded_results(rank, policy, ppo_policy, rollouts, config, out_dir)
        dist.barrier()  # no rank tears its group down while the other still talks to it
    finally:
        gc.collect()  # the sharded modules hold the group: free them before destroying it
        dist.destroy_process_group()
    # Skip interpreter teardown: a worker aborted there ("terminate called without an active
    # exception", in two full-suite runs, never when run alone). An error above still reaches mp.spawn.
    os._exit(0)


def _sharded_results(rank: int, policy, ppo_policy, rollouts, config: StepConfig, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    from clawfast.train.fsdp import full_state_dict, shard_policy

    torch.set_num_threads(1)
    sharded = shard_policy(copy.deepcopy(policy))
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    data = prepare_step(rollouts, None, config)
    metrics = accumulate_gradients(sharded, data, config)
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    sharded.zero_grad(set_to_none=True)
    step = train_step(sharded, _adamw(sharded), rollouts, None, config)
    params = full_state_dict(sharded)
    # PPO: the old values of every rank's micro-batches are summed across ranks before GAE
    ppo = shard_policy(copy.deepcopy(ppo_policy))
    ppo_metrics = accumulate_gradients(ppo, prepare_step(rollouts, None, _ppo(config)), _ppo(config))
    ppo_grads = {n: p.grad.full_tensor() for n, p in ppo.named_parameters()}
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "step": step, "params": params,
                    "num_batches": len(data.batches), "ppo_metrics": ppo_metrics, "ppo_grads": ppo_grads},
                   os.path.join(out_dir, "fsdp.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])  # dense, and a mixture of experts (fused expert tensors)
def test_fsdp2_two_cpu_processes_match_one_process(tmp_path, family):
    # The trainer issue requires this check on CPU processes: a torch without gloo is a broken install.
    assert dist.is_gloo_available(), "torch was built without gloo: the FSDP2 CPU check cannot run"
    policy = tiny_policy(0, family=family)
    rollouts = harness_rollouts(policy, seed=3)
    config = _config(rollouts)
    ppo_policy = tiny_policy(1, value_head=True, family=family)
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), policy, ppo_policy, rollouts, config, str(tmp_path)), nprocs=WORLD,
             join=True)
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert got["num_batches"] % WORLD == 1, "want an odd number of micro-batches (a padded rank)"

    single = copy.deepcopy(policy)
    metrics = accumulate_gradients(single, prepare_step(rollouts, None, config), config)
    assert abs(got["metrics"]["loss"] - metrics["loss"]) <= ATOL
    for key in ("entropy", "clip_frac", "is_ratio_mean", "is_count", "mismatch_k3"):
        assert got["metrics"][key] == pytest.approx(metrics[key], abs=ATOL), key
    for name, p in single.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")

    stepped = copy.deepcopy(policy)
    step = train_step(stepped, _adamw(stepped), rollouts, None, config)
    assert got["step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    assert got["step"]["loss"] == pytest.approx(step["loss"], abs=ATOL)
    for name, p in stepped.named_parameters():
        torch.testing.assert_close(got["params"][name], p.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")

    ppo = copy.deepcopy(ppo_policy)
    ppo_metrics = accumulate_gradients(ppo, prepare_step(rollouts, None, _ppo(config)), _ppo(config))
    assert abs(got["ppo_metrics"]["loss"] - ppo_metrics["loss"]) <= ATOL and ppo_metrics["value_loss"] > 0
    for name, p in ppo.named_parameters():
        torch.testing.assert_close(got["ppo_grads"][name], p.grad, atol=ATOL, rtol=0, msg=lambda m: f"ppo {name}: {m}")

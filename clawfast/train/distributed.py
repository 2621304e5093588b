"""Scale-out of the trainer for `clawfast train`: the policy sharded with FSDP2 over torchrun
processes (``distributed.fsdp = true``). `clawfast.train.loop` calls in here; a one-process run uses
`LocalTrainer` only. (Rollouts on a Ray cluster, ``distributed.rollouts = "ray"``, are the rollout
service's: `clawfast.rollout.service.OnRay`.)

**FSDP.** ``torchrun --nproc-per-node N -m clawfast.cli train CONFIG`` starts N processes; each
joins the default process group (NCCL on GPUs, each rank on ``cuda:LOCAL_RANK``; gloo on CPUs).
Rank 0, the *leader*, runs everything a one-process run does (run directory, engine, proxy,
harnesses, rollouts, evaluation, metrics, checkpoints, plots) with a `ShardedTrainer`; every other
rank, a *follower*, runs `follow`: it does only what the leader tells it. The leader sends each
command as a pickled tuple over a gloo group (``broadcast_object_list``), so followers wait on the
CPU, not in an NCCL collective, while rank 0 runs rollouts:

- ``setup``: every rank builds the policy from ``model.path``, takes rank 0's weights (a broadcast:
  rank 0 may have loaded a checkpoint), shards it with `clawfast.train.fsdp.shard_policy`, builds
  AdamW *after* sharding and, on resume, takes rank 0's optimizer state (`load_full_optimizer_state`).
- ``step``: carries the step's rollouts and `TrainState`; every rank runs
  `clawfast.train.step.train_on_rollouts` on the same rollouts (`train_step` splits the micro-batches
  over ranks and keeps the loss a global average).
- ``stream_weights``: each step's weight push, one gathered tensor at a time (`_gather_each`), rank 0
  handing each to ``Engine.update_weights`` as it arrives (the vLLM engine's broadcast path sends it
  on and drops it), so no full copy is built for a push.
- ``gather_adapter``: the push of a LoRA policy (``model.lora``): its adapter's tensors alone are
  gathered into rank 0's copy, which pushes the adapter as a one-process run does.
- ``weights`` / ``optimizer``: the collectives that gather full weights (`full_state_dict`) and full
  optimizer state (`gather_full_optimizer_state`) for a checkpoint; rank 0 alone keeps them: in a
  plain CPU copy of the policy (`ShardedTrainer.view`), from which it writes checkpoints in the
  one-process format (so a checkpoint of either kind resumes in either).
- ``reference``: the frozen KL reference (``kl_coef > 0``), broadcast from rank 0.
- ``stop`` / ``error``: the leader finished, or failed (then every follower raises `LeaderFailed`).

Guaranteed: an FSDP run computes the one-process run's losses and weights up to the order of float
sums across ranks (tests/train/test_train_fsdp.py: 2 gloo processes against 1, within 1e-5, also
across a resume). Not guaranteed: the cold start under FSDP (refused at start: run it in one
process, then ``--resume`` with ``fsdp = true``); memory: rank 0 holds a full CPU copy of the
policy besides its shard for checkpoints (and the engine its own); a follower reads nothing from disk but
``model.path`` (which must exist on its node).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from clawfast.records import RolloutResult
from clawfast.train.build import build_optimizer, build_policy, load_policy, push_weights, resolve_model_dir
from clawfast.train.checkpoint import TrainState, rng_state, save_checkpoint, set_rng_state
from clawfast.train.config import RunConfig
from clawfast.train.lora import adapter_names, has_adapter
from clawfast.train.push import engine_layout
from clawfast.train.step import train_on_rollouts

# Followers wait in a broadcast while rank 0 runs a step's rollouts and evaluations, which may take
# hours on a large suite; the default (30 min for gloo) would kill a healthy run.
COLLECTIVE_TIMEOUT = timedelta(hours=12)


class LeaderFailed(RuntimeError):
    """Raised on a follower when rank 0 stopped with an error (its message says which)."""


# ----------------------------------------------------------------------------------------------
# What the loop trains through


class LocalTrainer:
    """One process: `policy` and `optimizer` are the trained objects themselves."""

    def __init__(self, policy, optimizer: torch.optim.Optimizer) -> None:
        self.policy = policy
        self.optimizer = optimizer

    def step(self, results: list[RolloutResult], config: RunConfig, state: TrainState, ref_policy=None) -> dict:
        return train_on_rollouts(self.policy, self.optimizer, results, config, state, ref_policy)

    def current_policy(self):
        """A plain `Policy` holding the current weights (to push to an engine or save)."""
        return self.policy

    def push_weights(self, engine, version: int) -> None:
        push_weights(engine, self.policy, version)

    def share_reference(self, ref_policy):
        return ref_policy

    def save_checkpoint(self, run_dir: str | Path, state: TrainState, **kwargs) -> Path:
        return save_checkpoint(run_dir, self.policy, self.optimizer, state, **kwargs)


class _FullOptimizerState:
    """What `save_checkpoint` reads of an optimizer (``state_dict()``), for the gathered state."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class ShardedTrainer:
    """Rank 0 of an FSDP run: trains its shard in step with the followers (each collective is
    announced to them first) and keeps `view`, a plain CPU policy, in sync on demand."""

    def __init__(self, group: "FsdpGroup", config: RunConfig, policy, optimizer: torch.optim.Optimizer,
                 state: TrainState) -> None:
        if config.coldstart.enabled and not state.extra.get("coldstart_done"):
            raise ValueError("the cold start does not run under distributed.fsdp: run it in one process "
                             "(fsdp = false), then continue the run with --resume and fsdp = true")
        self.group = group
        self.config = config
        self.view = policy  # plain, on the CPU: rank 0's copy of the full weights
        full_optim = optimizer.state_dict() if optimizer.state else None  # loaded from a checkpoint
        group.send("setup", {"rng": rng_state(), "torch_rng": torch.get_rng_state(), "step": state.step,
                             "optimizer_state": full_optim is not None})
        self.shard = _Shard(group, config, copy.deepcopy(policy), full_optim)
        optimizer.state.clear()  # rank 0's plain optimizer is not used again: free its moments
        self._view_stale = False

    def step(self, results: list[RolloutResult], config: RunConfig, state: TrainState, ref_policy=None) -> dict:
        self.group.send("step", results, copy.deepcopy(state))
        self._view_stale = True
        return {**self.shard.step(results, state, ref_policy), "fsdp_world_size": float(self.group.world_size)}

    def push_weights(self, engine, version: int) -> None:
        """Stream the weights to the engine one gathered tensor at a time (no full copy on rank 0:
        `view` is refreshed only for checkpoints). Every rank runs each gather; whatever the engine
        does with them, rank 0 finishes the gathers so that no follower is left in a collective.
        A LoRA policy gathers its adapter alone into `view` (its base never changes) and pushes it
        from there, as one process does (`push_weights`)."""
        if has_adapter(self.view.lm):
            self.group.send("gather_adapter")
            params = dict(self.view.lm.named_parameters())
            with torch.no_grad():
                for name, tensor in _gather_each(self.shard.policy, adapter_names(self.view.lm)):
                    params[name].copy_(tensor)
            push_weights(engine, self.view, version)
            return
        self.group.send("stream_weights")
        tensors = _gather_each(self.shard.policy)
        try:
            engine.update_weights(engine_layout(engine, self.shard.policy.lm, tensors), version)
        finally:
            for _ in tensors:
                pass

    def current_policy(self):
        if self._view_stale:
            self.group.send("weights")
            self.view.load_state_dict(self.shard.full_weights())
            self._view_stale = False
        return self.view

    def share_reference(self, ref_policy):
        if ref_policy is None:
            return None
        self.group.send("reference")
        return self.shard.receive_reference(ref_policy)

    def save_checkpoint(self, run_dir: str | Path, state: TrainState, **kwargs) -> Path:
        view = self.current_policy()
        self.group.send("optimizer")
        full = gather_full_optimizer_state(self.shard.optimizer, self.group)
        return save_checkpoint(run_dir, view, _FullOptimizerState(full), state, **kwargs)


# ----------------------------------------------------------------------------------------------
# The process group and the shard every rank holds


class FsdpGroup:
    """This process's place in a torchrun launch, with the gloo group that carries commands."""

    def __init__(self, backend: str, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Commands travel on CPU gloo even under NCCL (followers then wait without a GPU collective).
        self.control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    @classmethod
    def start(cls, config: RunConfig) -> "FsdpGroup":
        """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...).

        On GPUs rank r of a node uses ``cuda:LOCAL_RANK``, or ``cuda:LOCAL_RANK+1`` when the engine is
        vLLM: rank 0's vLLM process takes GPU 0 of its node (launch one process fewer than GPUs)."""
        missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"distributed.fsdp = true needs a torchrun launch (missing {', '.join(missing)}): "
                             "torchrun --nproc-per-node N -m clawfast.cli train CONFIG")
        if torch.cuda.is_available():
            index = int(os.environ["LOCAL_RANK"]) + (1 if config.engine.kind == "vllm" else 0)
            if index >= torch.cuda.device_count():
                raise ValueError(f"local rank {os.environ['LOCAL_RANK']} needs GPU {index} but {torch.cuda.device_count()} "
                                 "are visible (with engine.kind = 'vllm', GPU 0 is the engine's: launch "
                                 "--nproc-per-node = GPUs - 1)")
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        return cls(backend, device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def send(self, *command) -> None:
        """Rank 0: announce `command` (a tuple of picklable values) to every follower."""
        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> tuple:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self, *, finished: bool = False) -> None:
        """Leave the process group. finished: every rank got here normally; they meet at a barrier
        first, so no rank tears its connections down while another is still in a collective."""
        if dist.is_initialized():
            if finished:
                dist.barrier(group=self.control)
            dist.destroy_process_group()
        # The sharded modules sit in reference cycles that hold gloo's last async work objects; freed
        # at interpreter exit instead, they may abort the process ("terminate called without an
        # active exception", seen in a few percent of runs). Free them now, while all is alive.
        gc.collect()


class _Shard:
    """The sharded policy and its optimizer, built the same way on every rank from rank 0's weights
    (`full_optim`: rank 0's one-process optimizer state, or None for a fresh optimizer)."""

    def __init__(self, group: FsdpGroup, config: RunConfig, policy, full_optim: dict | None,
                 has_optimizer_state: bool | None = None) -> None:
        from clawfast.train.fsdp import shard_policy

        self.group = group
        self.config = config
        policy = policy.to(group.device)
        _broadcast_module(policy)
        self.policy = shard_policy(policy)
        self.optimizer = build_optimizer(config, self.policy)
        if has_optimizer_state is None:
            has_optimizer_state = full_optim is not None
        if has_optimizer_state:
            load_full_optimizer_state(self.optimizer, full_optim, group)

    def step(self, results: list[RolloutResult], state: TrainState, ref_policy) -> dict:
        return train_on_rollouts(self.policy, self.optimizer, results, self.config, state, ref_policy)

    def full_weights(self) -> dict[str, torch.Tensor]:
        from clawfast.train.fsdp import full_state_dict

        return full_state_dict(self.policy)

    def receive_reference(self, ref_policy):
        """Rank 0 passes its reference policy; the others build one from ``model.path`` and take
        rank 0's weights. Every rank keeps it whole (it only runs forward) on its device."""
        if ref_policy is None:
            ref_policy = load_policy(self.config, resolve_model_dir(self.config))
            ref_policy.requires_grad_(False)
        ref = copy.deepcopy(ref_policy) if self.group.is_main else ref_policy
        ref = ref.to(self.group.device)
        _broadcast_module(ref)
        return ref.eval()


def _gather_each(policy, names: list[str] | None = None):
    """(name, full tensor) of each parameter of the sharded policy's LM (or of those in `names`), in
    name order, gathered one at a time (a collective per tensor: every rank iterates it to the end;
    only rank 0 keeps them)."""
    from torch.distributed.tensor import DTensor

    state = policy.lm.state_dict()
    for name in sorted(state if names is None else names):
        tensor = state[name]
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name, full.detach()


def _broadcast_module(module: torch.nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's (a collective; same architecture on all)."""
    with torch.no_grad():
        for _, tensor in sorted(module.state_dict(keep_vars=True).items()):
            dist.broadcast(tensor.data, src=0)


def gather_full_optimizer_state(optimizer: torch.optim.Optimizer, group: FsdpGroup) -> dict | None:
    """The sharded optimizer's state in the one-process ``optimizer.state_dict()`` layout (full CPU
    tensors), on rank 0; None elsewhere. A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    sd = optimizer.state_dict()
    state = {}
    for index in sorted(sd["state"]):
        entry = {}
        for key, value in sd["state"][index].items():
            if isinstance(value, DTensor):
                value = value.full_tensor()  # all-gather: every rank takes part
            entry[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
        state[index] = entry
    return {"state": state, "param_groups": sd["param_groups"]} if group.is_main else None


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, full: dict | None, group: FsdpGroup) -> None:
    """Load rank 0's one-process optimizer state (`full`; None on other ranks) into the sharded
    optimizer of every rank: each state tensor is scattered like its parameter. A collective."""
    from torch.distributed.tensor import distribute_tensor

    skeleton = None
    if group.is_main:
        skeleton = {
            "param_groups": full["param_groups"],
            "state": {i: {k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) and v.dim() else v)
                          for k, v in entry.items()} for i, entry in full["state"].items()},
        }
    box = [skeleton]
    dist.broadcast_object_list(box, src=0, group=group.control)
    skeleton = box[0]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index in sorted(skeleton["state"]):
        if index >= len(params):
            raise ValueError(f"optimizer state names parameter {index}; the policy has {len(params)}")
        param = params[index]
        entry = {}
        for key, value in skeleton["state"][index].items():
            if isinstance(value, tuple) and value and value[0] == "tensor":
                _, shape, dtype = value
                if shape != tuple(param.shape):
                    raise ValueError(f"optimizer state {index}/{key} has shape {shape}, the parameter {tuple(param.shape)}")
                source = (full["state"][index][key].to(param.device) if group.is_main
                          else torch.empty(shape, dtype=dtype, device=param.device))
                value = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=0)
            entry[key] = value
        state[index] = entry
    optimizer.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


# ----------------------------------------------------------------------------------------------
# Entry points


def train_sharded(config: RunConfig, lead: Callable[["FsdpGroup"], dict[str, object]]) -> dict[str, object]:
    """`clawfast.train.loop.train` under ``distributed.fsdp``: rank 0 runs `lead(group)` (the loop),
    the others follow it."""
    group = FsdpGroup.start(config)
    finished = False
    try:
        if not group.is_main:
            summary = follow(group, config)
        else:
            try:
                summary = lead(group)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the original error matters more than this one
                    group.send("error", f"{type(exc).__name__}: {exc}")
                raise
            group.send("stop")
        finished = True
        return summary
    finally:
        group.close(finished=finished)


def follow(group: FsdpGroup, config: RunConfig) -> dict[str, object]:
    """A follower's whole run: do what rank 0 announces until it stops (see the module docstring)."""
    command = _expect(group, "setup")
    setup = command[1]
    set_rng_state(setup["rng"])
    torch.set_rng_state(setup["torch_rng"])
    steps = setup["step"]
    policy = build_policy(config, resolve_model_dir(config))
    shard = _Shard(group, config, policy, None, has_optimizer_state=setup["optimizer_state"])
    ref_policy = None
    while True:
        command = group.receive()
        kind = command[0]
        if kind == "step":
            _, results, state = command
            shard.step(results, state, ref_policy)
            steps = state.step + 1
        elif kind == "weights":
            shard.full_weights()
        elif kind == "stream_weights":
            for _ in _gather_each(shard.policy):
                pass
        elif kind == "gather_adapter":
            for _ in _gather_each(shard.policy, adapter_names(shard.policy.lm)):
                pass
        elif kind == "optimizer":
            gather_full_optimizer_state(shard.optimizer, group)
        elif kind == "reference":
            ref_policy = shard.receive_reference(None)
        elif kind == "stop":
            return {"run_dir": config.run_dir, "steps": steps, "rank": group.rank}
        elif kind == "error":
            raise LeaderFailed(f"rank 0 stopped: {command[1]}")
        else:
            raise RuntimeError(f"unknown command from rank 0: {kind!r}")


def _expect(group: FsdpGroup, kind: str) -> tuple:
    command = group.receive()
    if command[0] == "error":
        raise LeaderFailed(f"rank 0 stopped: {command[1]}")
    if command[0] != kind:
        raise RuntimeError(f"expected {kind!r} from rank 0, got {command[0]!r}")
    return command


def make_trainer(config: RunConfig, policy, optimizer: torch.optim.Optimizer, state: TrainState, group):
    """`LocalTrainer`, or rank 0's `ShardedTrainer` when `group` (an `FsdpGroup`) is given."""
    if group is None:
        return LocalTrainer(policy, optimizer)
    return ShardedTrainer(group, config, policy, optimizer, state)

"""Shard a `Policy` over processes with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    init_process_group(...)            # the caller's job: NCCL on GPUs, gloo on CPUs
    policy = shard_policy(policy)      # every decoder layer its own unit, then the root
    optimizer = torch.optim.AdamW(policy.parameters(), ...)   # built AFTER sharding
    train_step(policy, optimizer, rollouts, groups, config)   # same call as on one process

Each decoder layer (the classes HF lists in ``_no_split_modules``) becomes one FSDP unit; the root
unit holds the embedding, final norm, LM head and value head, so the LM head weight is gathered
whole around `Policy.forward`, where the fused log-prob kernel reads it. `train_step` splits the
micro-batches over ranks and keeps the loss a global average (see clawfast/train/step.py), so a
sharded step computes the same loss and gradients as one process (tests/train/test_fsdp.py: two
gloo processes on CPU against one process, within 1e-5).

Guaranteed: parameters and gradients are DTensors sharded on dim 0; ``full_state_dict`` returns
plain full CPU tensors on rank 0 and an empty dict elsewhere (for checkpoints and for pushing weights
to an engine, which rank 0 does; `clawfast.train.distributed` drives this in `clawfast train`). Not
guaranteed: mixed precision or CPU offload (not configured here); the same rollouts must be given
to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from clawfast.train.policy import Policy


def decoder_layers(policy: Policy) -> list[torch.nn.Module]:
    """The modules FSDP wraps one by one: instances of the LM's ``_no_split_modules`` classes."""
    names = set(getattr(policy.lm, "_no_split_modules", None) or ())
    layers = [m for m in policy.lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(policy.lm).__name__} lists no decoder layer class in _no_split_modules")
    return layers


def shard_policy(policy: Policy, mesh: DeviceMesh | None = None, *, reshard_after_forward: bool = True) -> Policy:
    """Apply FSDP2 in place (layers, then the root) and return the policy.

    ``mesh``: a 1-D device mesh; default: all ranks of the default process group, on the
    policy's device type. Build the optimizer after this call (it must see the sharded parameters).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_policy needs an initialised torch.distributed process group")
    if mesh is None:
        mesh = init_device_mesh(policy.device.type, (dist.get_world_size(),))
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(policy, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return policy


def full_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """The whole policy's parameters as plain CPU tensors on rank 0, ``{}`` on the other ranks
    (a collective: call it on all; offloading to rank 0 alone keeps the other ranks' memory flat)."""
    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

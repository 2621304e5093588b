"""How a step's micro-batches are shared among data-parallel ranks (`clawfast.train.step`, "Data parallel").

When ``torch.distributed`` is initialised, rank r takes micro-batches r, r + W, ... and every rank runs
the same number of forward/backward calls: a rank short of batches repeats one that is not *real*
(trained with zero loss weight), so FSDP's collectives stay matched. Without a process group every
call is rank 0 of 1 and nothing is reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """(this rank, number of ranks); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_schedule(num_batches: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """(batch index, real) for each forward/backward of this rank; padding entries are not real."""
    mine = list(range(rank, num_batches, world))
    steps = -(-num_batches // world)
    return [(mine[k], True) if k < len(mine) else ((mine or [0])[0], False) for k in range(steps)]


def sum_over_ranks(vec: torch.Tensor) -> torch.Tensor:
    """`vec` summed over the ranks, in place (unchanged on one rank)."""
    if rank_and_world()[1] > 1:
        dist.all_reduce(vec)
    return vec

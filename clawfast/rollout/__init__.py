"""The rollout scheduler: tasks x harnesses x k samples, each in a fresh sandbox behind the proxy.

`RolloutWorker.run(spec)` runs one rollout end to end (see `clawfast.rollout.worker` for the status
contract); `RolloutScheduler` runs many with a concurrency cap on one asyncio loop;
`clawfast.rollout.ray_backend` runs the same worker in Ray actors across machines.
"""

from clawfast.rollout.scheduler import RolloutScheduler, RunStats, make_specs
from clawfast.rollout.worker import RolloutConfig, RolloutControl, RolloutSpec, RolloutWorker

__all__ = [
    "RolloutConfig",
    "RolloutControl",
    "RolloutScheduler",
    "RolloutSpec",
    "RolloutWorker",
    "RunStats",
    "make_specs",
]

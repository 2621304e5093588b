"""Rollouts: tasks x harnesses x k samples, each in a fresh sandbox behind the proxy.

`RolloutService` (`clawfast.rollout.service`) is the entry point: it assembles proxy, registry,
sandbox backend, verifier runner and harness adapters once, here or on Ray, from one settings object
per part (`ProxyConfig`, `EndpointConfig`, `HarnessConfig`, `SandboxConfig`, `SchedulingConfig`), and
`run(specs, sampling)` returns one `RolloutResult` per `RolloutSpec`. Its parts: `RolloutWorker.run`
runs one rollout end to end (`clawfast.rollout.worker`, which states the status contract),
`RolloutScheduler` runs many on one asyncio loop, `clawfast.rollout.ray_backend` runs the worker in
Ray actors, and `clawfast.rollout.oracle` is the scripted engine's oracle (`clawfast.rollout.check`
uses it to check a harness end to end). Importing this package loads only the service's light front.
"""

from clawfast.engines.base import Sampling
from clawfast.rollout.service import (
    ORACLE,
    EndpointConfig,
    HarnessConfig,
    OnRay,
    RolloutService,
    SandboxConfig,
    SchedulingConfig,
)
from clawfast.rollout.spec import RolloutSpec, make_specs
from clawfast.serving import ProxyConfig

__all__ = ["ORACLE", "EndpointConfig", "HarnessConfig", "OnRay", "ProxyConfig", "RolloutService", "RolloutSpec",
           "Sampling", "SandboxConfig", "SchedulingConfig", "make_specs"]

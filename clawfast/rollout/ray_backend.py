"""Rollouts on a Ray cluster: the same `RolloutWorker.run` inside Ray actors (optional extra `ray`).

    setup = RaySetup(control_address="10.0.0.5:50051", control_token=tok, suite="clawbench-mini",
                     harnesses=("mini-swe-agent",))
    results = run_on_ray(make_specs(tasks, ["mini-swe-agent"], k=4), setup, address="auto", num_actors=8)

Each actor builds its own sandbox backend, verifier runner and harness adapters (installing the
pinned harnesses into its node's cache on first use) and talks to the proxy through its gRPC control
plane (`GrpcControl`). Only plain data crosses to the actors: the setup (strings and numbers) and
(task id, harness, sample index) per rollout; each actor loads the suite itself, so a task never
travels as a pickled object. A result comes back as `clawfast.records.encode_rollout` bytes.

Guaranteed: the same status contract as the local scheduler (`clawfast.rollout.worker`); at most
`RaySetup.concurrency` rollouts per actor at once; actors are closed (their sandboxes destroyed)
before `run_on_ray` returns. Not guaranteed: reaching a proxy on another machine from inside a
sandbox. A sandbox's only peer is its host's loopback port, so the HTTP proxy must listen on each
node's loopback (one proxy per node, or a relay on that port); the control plane may be remote.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from clawfast.records import RolloutResult, decode_rollout, encode_rollout
from clawfast.rollout.progress import ProgressDisplay
from clawfast.rollout.scheduler import RunStats
from clawfast.rollout.worker import RolloutConfig, RolloutSpec, RolloutWorker


@dataclass(frozen=True)
class RaySetup:
    """What every actor needs, as plain data. suite: a built-in suite name or a task directory that
    exists on every node. backend: sandbox backend name. concurrency: rollouts in flight per actor.
    logs_dir: where each node keeps harness logs (None: not kept)."""

    control_address: str
    control_token: str
    suite: str
    harnesses: tuple[str, ...]
    backend: str = "bwrap"
    model: str = "policy"
    timeout_s: float | None = None
    concurrency: int = 4
    logs_dir: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if not self.harnesses:
            raise ValueError("at least one harness is needed")


class RolloutActor:
    """The body of a Ray actor (wrapped with `ray.remote` by `run_on_ray`)."""

    def __init__(self, setup: RaySetup) -> None:
        from clawfast.harness import get_harness
        from clawfast.rollout.control import GrpcControl
        from clawfast.sandbox import create_backend
        from clawfast.tasks import load_suite
        from clawfast.tasks.sandbox_runner import SandboxRunner

        self.tasks = {task.id: task for task in load_suite(setup.suite)}
        harnesses = {name: get_harness(name) for name in setup.harnesses}
        for harness in harnesses.values():
            harness.installation  # install on this node before the first rollout's clock starts
        self.control = GrpcControl(setup.control_address, setup.control_token)
        self.backend = create_backend(setup.backend, **({"allow_unsafe": True} if setup.backend == "local" else {}))
        self.verifier_runner = SandboxRunner(self.backend)
        self.executor = ThreadPoolExecutor(2 * setup.concurrency + 2, thread_name_prefix="clawfast-actor")
        config = RolloutConfig(model=setup.model, timeout_s=setup.timeout_s, logs_dir=setup.logs_dir)
        self.worker = RolloutWorker(
            self.control, self.backend, harnesses,
            config=config, verifier_runner=self.verifier_runner, executor=self.executor,
        )  # fmt: skip

    async def run(self, task_id: str, harness: str, sample_index: int) -> bytes:
        task = self.tasks.get(task_id)
        if task is None:
            raise ValueError(f"task {task_id!r} is not in this actor's suite")
        result = await self.worker.run(RolloutSpec(task, harness, sample_index))
        result.info["actor_pid"] = os.getpid()  # which actor ran it (the proxy's log predates this)
        return encode_rollout(result)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.backend.close()
        self.control.shutdown()


def run_on_ray(
    specs: Sequence[RolloutSpec],
    setup: RaySetup,
    *,
    address: str | None = None,
    num_actors: int = 2,
    actor_options: dict | None = None,
    progress: bool = False,
) -> list[RolloutResult]:
    """Run `specs` on `num_actors` Ray actors; results in spec order. `address`: a running cluster
    (``"auto"``, ``"ray://host:port"``) or None to start a local one. `actor_options` go to
    `ray.remote(...).options` (e.g. ``{"num_cpus": 1}``). Ray is initialised only if it is not yet."""
    import ray

    if num_actors < 1:
        raise ValueError(f"num_actors must be at least 1, got {num_actors}")
    if not ray.is_initialized():
        ray.init(address=address)
    unknown = sorted({s.harness for s in specs} - set(setup.harnesses))
    if unknown:
        raise ValueError(f"specs use harness(es) {unknown} that the setup does not install")
    actor_cls = ray.remote(RolloutActor).options(max_concurrency=setup.concurrency, **(actor_options or {}))
    actors = [actor_cls.remote(setup) for _ in range(num_actors)]
    stats = RunStats(total=len(specs))
    display = ProgressDisplay(stats) if progress else None
    try:
        if display:
            display.start()
        # Round-robin; each actor runs `concurrency` at once and queues the rest.
        refs = [actors[i % num_actors].run.remote(s.task.id, s.harness, s.sample_index) for i, s in enumerate(specs)]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[RolloutResult | None] = [None] * len(specs)
        pending = list(refs)
        stats.running = min(len(specs), num_actors * setup.concurrency)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                result = decode_rollout(ray.get(ref), source=f"ray rollout {index[ref]}")
                results[index[ref]] = result
                stats.record(result)
            stats.running = min(len(pending), num_actors * setup.concurrency)
            if display:
                display.update()
        return [r for r in results if r is not None]
    finally:
        if display:
            display.stop()
        ray.get([a.close.remote() for a in actors])
        for actor in actors:
            ray.kill(actor)

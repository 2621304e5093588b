"""Rollouts on a Ray cluster: the same `RolloutWorker.run` inside Ray actors (optional extra `ray`).

    setup = RaySetup(control_address="10.0.0.5:50051", control_token=tok, suite="clawbench-mini",
                     harnesses=("mini-swe-agent",))
    results = run_on_ray(make_specs(tasks, ["mini-swe-agent"], k=4), setup, address="auto", num_actors=8)

    with RayRolloutPool(setup) as pool:              # one actor per alive node, kept across calls
        results = pool.run(specs, on_result=print)     # `clawfast train` does this every step

Each actor builds its own sandbox backend, verifier runner and harness adapters (installing the
pinned harnesses into its node's cache on first use) and talks to the proxy through its gRPC control
plane (`GrpcControl`). Only plain data crosses to the actors: the setup (strings and numbers) and
(task id, harness, sample index) per rollout; each actor loads the suite itself, so a task never
travels as a pickled object. A result comes back as `clawfast.records.encode_rollout` bytes; its
``info`` (and the proxy's record) names the Ray node, actor and process that ran it.

A sandbox's only peer is its host's loopback port. With `RaySetup.proxy_address` set (the HTTP
proxy's ``host:port`` as the cluster sees it), each actor relays a loopback port of its own node to
that address (`LoopbackRelay`) and hands harnesses that port, so one proxy serves every node.
Without it, the proxy must already listen on each node's loopback (e.g. a local cluster).

Guaranteed: the same status contract as the local scheduler (`clawfast.rollout.worker`); at most
`RaySetup.concurrency` rollouts per actor at once; actors are closed (their sandboxes destroyed)
when the pool closes (`run_on_ray`: before it returns). Not guaranteed: TLS between relay and proxy.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from clawfast.records import RolloutResult, decode_rollout, encode_rollout
from clawfast.rollout.control import ProxyRollout
from clawfast.rollout.progress import ProgressDisplay
from clawfast.rollout.scheduler import RunStats
from clawfast.rollout.worker import RolloutConfig, RolloutSpec, RolloutWorker
from clawfast.sandbox.forward import relay


@dataclass(frozen=True)
class RaySetup:
    """What every actor needs, as plain data. suite: a built-in suite name or a task directory that
    exists on every node (suite_seed: the generator seed of ``clawbench-mini``). backend: sandbox
    backend name. concurrency: rollouts in flight per actor. logs_dir: where each node keeps harness
    logs (None: not kept). harness_options: keyword arguments of `get_harness` per harness name.
    proxy_address: ``host:port`` of the HTTP proxy, relayed to each node's loopback (None: the proxy
    already listens on every node's loopback)."""

    control_address: str
    control_token: str
    suite: str
    harnesses: tuple[str, ...]
    backend: str = "bwrap"
    model: str = "policy"
    timeout_s: float | None = None
    concurrency: int = 4
    logs_dir: str | None = None
    suite_seed: int = 0
    harness_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    proxy_address: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if not self.harnesses:
            raise ValueError("at least one harness is needed")
        unknown = sorted(set(self.harness_options) - set(self.harnesses))
        if unknown:
            raise ValueError(f"harness_options for harness(es) {unknown} that are not in harnesses")


class LoopbackRelay:
    """A TCP relay from ``127.0.0.1:port`` (a free port, `port`) of this machine to `target`
    (``host:port``), on its own thread; byte for byte, both ways, one upstream connection per
    accepted one. `close` stops it."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"relay target must be host:port, got {target!r}")
        self.target = (host.strip("[]"), int(port))
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="clawfast-relay", daemon=True)
        self._thread.start()
        ready.wait(timeout=30)
        if self._server is None:
            raise RuntimeError("the loopback relay did not start")
        self.port = self._server.sockets[0].getsockname()[1]

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        finally:
            ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await relay(reader, writer, *self.target)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


class _ActorControl:
    """The actor's `RolloutControl`: the gRPC control plane, with the proxy URL swapped for the
    node's relay (when there is one), and the Ray node, actor and process written into every
    rollout's ``info`` before it is closed (so the proxy's record names them too)."""

    def __init__(self, control, relay_port: int | None, where: dict[str, Any]) -> None:
        self.control = control
        self.relay_port = relay_port
        self.where = where

    def open(self, *, task_id: str, harness: str, sample_index: int) -> ProxyRollout:
        opened = self.control.open(task_id=task_id, harness=harness, sample_index=sample_index)
        if self.relay_port is None:
            return opened
        return ProxyRollout(opened.rollout_id, opened.key, f"http://127.0.0.1:{self.relay_port}")

    def close(self, rollout_id: str, *, reward: float, status: str, info: dict[str, Any]) -> RolloutResult:
        info.update(self.where)  # the worker's own dict: its returned result carries these too
        return self.control.close(rollout_id, reward=reward, status=status, info=info)


def _load_tasks(setup: RaySetup) -> dict:
    from clawfast.tasks import clawbench_mini, load_suite

    tasks = clawbench_mini(setup.suite_seed) if setup.suite == "clawbench-mini" else load_suite(setup.suite)
    return {task.id: task for task in tasks}


class RolloutActor:
    """The body of a Ray actor (wrapped with `ray.remote` by `run_on_ray`)."""

    def __init__(self, setup: RaySetup) -> None:
        import ray

        from clawfast.harness import get_harness
        from clawfast.rollout.control import GrpcControl
        from clawfast.sandbox import create_backend
        from clawfast.tasks.sandbox_runner import SandboxRunner

        self.tasks = _load_tasks(setup)
        harnesses = {name: get_harness(name, **setup.harness_options.get(name, {})) for name in setup.harnesses}
        for harness in harnesses.values():
            harness.installation  # install on this node before the first rollout's clock starts
        self.control = GrpcControl(setup.control_address, setup.control_token)
        self.relay = LoopbackRelay(setup.proxy_address) if setup.proxy_address else None
        context = ray.get_runtime_context()
        where = {"ray_node_id": context.get_node_id(), "ray_actor_id": context.get_actor_id(), "actor_pid": os.getpid()}
        control = _ActorControl(self.control, self.relay.port if self.relay else None, where)
        self.backend = create_backend(setup.backend, **({"allow_unsafe": True} if setup.backend == "local" else {}))
        # As in the trainer's own process: the "local" backend scores in a plain subprocess.
        self.verifier_runner = None if setup.backend == "local" else SandboxRunner(self.backend)
        self.executor = ThreadPoolExecutor(2 * setup.concurrency + 2, thread_name_prefix="clawfast-actor")
        config = RolloutConfig(model=setup.model, timeout_s=setup.timeout_s, logs_dir=setup.logs_dir)
        self.worker = RolloutWorker(
            control, self.backend, harnesses,
            config=config, verifier_runner=self.verifier_runner, executor=self.executor,
        )  # fmt: skip

    async def run(self, task_id: str, harness: str, sample_index: int) -> bytes:
        task = self.tasks.get(task_id)
        if task is None:
            raise ValueError(f"task {task_id!r} is not in this actor's suite")
        result = await self.worker.run(RolloutSpec(task, harness, sample_index))
        return encode_rollout(result)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.backend.close()
        if self.relay is not None:
            self.relay.close()
        self.control.shutdown()


class RayRolloutPool:
    """Rollout actors kept alive across `run` calls. num_actors None: one actor per alive node with
    at least one CPU, pinned to it; an int: that many, placed by Ray. `address`: as in `run_on_ray`
    (``"local"`` also starts a local cluster); a cluster this pool started is shut down by `close`.
    `actor_options` go to `ray.remote(...).options` (default ``{"num_cpus": 1}``)."""

    def __init__(self, setup: RaySetup, *, address: str | None = None, num_actors: int | None = None,
                 actor_options: dict | None = None) -> None:
        import ray

        if num_actors is not None and num_actors < 1:
            raise ValueError(f"num_actors must be at least 1, got {num_actors}")
        self.setup = setup
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=None if address == "local" else address)
        options = {"num_cpus": 1, "max_concurrency": setup.concurrency, **(actor_options or {})}
        actor_cls = ray.remote(RolloutActor)
        try:
            if num_actors is None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                nodes = [n["NodeID"] for n in ray.nodes()
                         if n["Alive"] and n["Resources"].get("CPU", 0) >= options["num_cpus"]]
                if not nodes:
                    raise ValueError(f"no alive Ray node has {options['num_cpus']} CPU(s) for a rollout actor")
                self.actors = [actor_cls.options(**options, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node, soft=False)).remote(setup) for node in nodes]
            else:
                self.actors = [actor_cls.options(**options).remote(setup) for _ in range(num_actors)]
        except BaseException:
            self._shutdown()
            raise

    def __enter__(self) -> "RayRolloutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, specs: Sequence[RolloutSpec], *, on_result: Callable[[RolloutResult], None] | None = None,
            progress: bool = False) -> list[RolloutResult]:
        """Every spec on the actors (round-robin; each runs `concurrency` at once and queues the
        rest); results in spec order, `on_result` called with each as it arrives."""
        import ray

        unknown = sorted({s.harness for s in specs} - set(self.setup.harnesses))
        if unknown:
            raise ValueError(f"specs use harness(es) {unknown} that the setup does not install")
        n = len(self.actors)
        stats = RunStats(total=len(specs))
        display = ProgressDisplay(stats) if progress else None
        try:
            if display:
                display.start()
            refs = [self.actors[i % n].run.remote(s.task.id, s.harness, s.sample_index) for i, s in enumerate(specs)]
            index = {ref: i for i, ref in enumerate(refs)}
            results: list[RolloutResult | None] = [None] * len(specs)
            pending = list(refs)
            stats.running = min(len(specs), n * self.setup.concurrency)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    result = decode_rollout(ray.get(ref), source=f"ray rollout {index[ref]}")
                    results[index[ref]] = result
                    stats.record(result)
                    if on_result is not None:
                        on_result(result)
                stats.running = min(len(pending), n * self.setup.concurrency)
                if display:
                    display.update()
            return [r for r in results if r is not None]
        finally:
            if display:
                display.stop()

    def close(self) -> None:
        """Close every actor (its sandboxes destroyed), kill it, and stop a cluster we started."""
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors])
        finally:
            for actor in self.actors:
                ray.kill(actor)
            self._shutdown()

    def _shutdown(self) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()


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
    `ray.remote(...).options` (e.g. ``{"num_cpus": 1}``). Ray is initialised only if it is not yet
    (and then left running). The actors are closed before it returns."""
    import ray

    if num_actors < 1:
        raise ValueError(f"num_actors must be at least 1, got {num_actors}")
    if not ray.is_initialized():
        ray.init(address=address)
    with RayRolloutPool(setup, num_actors=num_actors, actor_options=actor_options or {}) as pool:
        return pool.run(specs, progress=progress)

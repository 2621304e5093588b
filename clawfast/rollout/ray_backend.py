"""Rollouts on a Ray cluster: `RolloutWorker.execute` inside Ray actors (optional extra `ray`).
`clawfast.rollout.service.RolloutService` drives it; use that.

    with RayRolloutPool(setup, address="auto") as pool:   # one actor per alive node, kept across calls
        results = pool.run(specs, registry, sampling=Sampling(temperature=1.0))

The proxy and its registry stay in the caller's process: `run` opens each rollout there (with its
sampling), hands the actor only plain data (task id, harness, sample index, rollout id and key) and
closes the rollout there with the actor's outcome (status, reward, info), so every call record is
captured once, by the proxy, and never crosses to an actor and back. Each actor builds its own
sandbox backend, verifier runner and harness adapters (installing the pinned harnesses into its
node's cache on first use) and loads the suite itself, so a task never travels as a pickled object.
A result's ``info`` (and the proxy's record) names the Ray node, actor and process that ran it.

A sandbox's only peer is its host's loopback port. With `RaySetup.proxy_address` set (the HTTP
proxy's ``host:port`` as the cluster sees it), each actor relays a loopback port of its own node to
that address (`LoopbackRelay`) and hands harnesses that port, so one proxy serves every node.
Without it, the proxy must already listen on each node's loopback (e.g. a local cluster).

When a node dies: an actor that dies under a rollout, or whose node dies, makes that attempt
``sandbox_error`` (an infrastructure failure: ``info["actor_died"]``, ``info["ray_node_id"]``); the
pool kills that actor and gives it no more rollouts, and the attempt runs again on a live actor, up to
`infra_retries` times, with the same task and sample index (`clawfast.rollout.retry`: the failed
attempt's record is set aside, never trained). Each `run` looks for capacity as it starts, and every
`REFRESH_S` while it has work left: a node that joined (a restarted raylet joins as a new node) gets
an actor.

An actor gets rollouts once its start has ended (`RolloutActor.ready`: suite loaded, harnesses
installed); one whose start raised gets none, and its node no new actor for `NODE_GRACE_S`, like a
node whose actor died. The pool's own start waits for one actor, and raises, naming the first one's
cause, if none started.

An actor's run that raises (a bug, such as a task its suite does not hold) closes its rollout as
``harness_error`` (``info["error"]`` "internal error: ...") and stops `run` with that exception, its
other rollouts closed, as the local scheduler does.

Guaranteed: the same status contract as the local scheduler (`clawfast.rollout.worker`); every spec
gets exactly one result, ``sandbox_error`` when its retries are spent or no live actor is left; at
most `RaySetup.concurrency` rollouts per actor at once, and no rollout is opened before an actor slot
is free; every rollout opened is closed (also when `run` is interrupted); live actors are closed
(their sandboxes destroyed) when the pool closes.
Not guaranteed: TLS between relay and proxy; a retry on another node than the failed attempt's (a
sandbox failure on a live node may run again there).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from clawfast.engines.base import Sampling
from clawfast.proxy.rollouts import OpenedRollout
from clawfast.records import RolloutResult
from clawfast.rollout.progress import RunStats, rollout_line
from clawfast.rollout.retry import attempt_note, should_retry
from clawfast.rollout.service import SandboxConfig
from clawfast.rollout.spec import RolloutSpec
from clawfast.rollout.worker import RolloutConfig, RolloutControl, RolloutWorker, close_rollout, unopened_result
from clawfast.sandbox.forward import relay

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RaySetup:
    """What every actor needs, as plain data. suite: a built-in suite name or a task directory that
    exists on every node (suite_seed: the generator seed of ``clawbench-mini``). harnesses: adapter
    name -> `get_harness` keyword arguments. sandbox: the backend each actor builds. rollout: its
    worker's config (the service's own, so a rollout runs alike here and on an actor; its logs_dir is
    where each node keeps harness logs). concurrency: rollouts in flight per actor. proxy_address:
    ``host:port`` of the HTTP proxy, relayed to each node's loopback (None: the proxy already listens
    on every node's loopback)."""

    suite: str
    harnesses: dict[str, dict[str, Any]]
    sandbox: SandboxConfig = SandboxConfig()
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    concurrency: int = 4
    suite_seed: int = 0
    proxy_address: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if not self.harnesses:
            raise ValueError("at least one harness is needed")


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


class RolloutActor:
    """The body of a Ray actor (wrapped with `ray.remote` by `RayRolloutPool`)."""

    def __init__(self, setup: RaySetup) -> None:
        import ray

        from clawfast.harness import get_harness
        from clawfast.sandbox import create_backend
        from clawfast.tasks import load_suite
        from clawfast.tasks.sandbox_runner import SandboxRunner

        self.tasks = {task.id: task for task in load_suite(setup.suite, seed=setup.suite_seed)}
        harnesses = {name: get_harness(name, **options) for name, options in setup.harnesses.items()}
        for harness in harnesses.values():
            harness.installation  # install on this node before the first rollout's clock starts
        self.relay = LoopbackRelay(setup.proxy_address) if setup.proxy_address else None
        context = ray.get_runtime_context()
        self.where = {"ray_node_id": context.get_node_id(), "ray_actor_id": context.get_actor_id(),
                      "actor_pid": os.getpid()}
        name = setup.sandbox.backend
        self.backend = create_backend(name, **({"allow_unsafe": True} if name == "local" else {}))
        # The "local" backend scores in a plain subprocess, as in the service's own process.
        verifier_runner = None if name == "local" else SandboxRunner(self.backend)
        self.executor = ThreadPoolExecutor(2 * setup.concurrency + 2, thread_name_prefix="clawfast-actor")
        # The worker never opens or closes a rollout here: the pool does, in the proxy's process.
        self.worker = RolloutWorker(None, self.backend, harnesses, config=setup.rollout,
                                    verifier_runner=verifier_runner, executor=self.executor)

    async def run(self, task_id: str, harness: str, sample_index: int, rollout_id: str, key: str,
                  base_url: str) -> dict[str, Any]:
        """Execute one opened rollout; returns its outcome: status, reward and info."""
        task = self.tasks.get(task_id)
        if task is None:
            raise ValueError(f"task {task_id!r} is not in this actor's suite")
        if self.relay is not None:
            base_url = f"http://127.0.0.1:{self.relay.port}"
        info: dict[str, Any] = {"timings": {}, **self.where}
        status, reward = await self.worker.execute(RolloutSpec(task, harness, sample_index),
                                                   OpenedRollout(rollout_id, key, base_url), info)
        return {"status": status, "reward": reward, "info": info}

    def ready(self) -> dict[str, Any]:
        """Where this actor runs; answered once its start (suite, harness installs, backend) is done."""
        return self.where

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.backend.close()
        if self.relay is not None:
            self.relay.close()


@dataclass
class _InFlight:
    index: int
    spec: RolloutSpec
    rollout_id: str
    actor: int
    retries: list[dict[str, Any]]
    t0: float = field(default_factory=time.monotonic)


# How often a `run` with work left looks for capacity to (re)place actors on: a cheap query of the
# cluster's node table.
REFRESH_S = 5.0
# A node whose actor died gets a new one only if the cluster still reports it alive this long after:
# Ray declares a lost raylet dead within about 30 s (its health checks), so a node still alive after
# this is one whose actor alone died. A raylet that restarts joins as a new node and gets an actor at once.
NODE_GRACE_S = 60.0
# An actor still starting (a node that just joined) may take this long to close; then it is killed.
CLOSE_TIMEOUT_S = 120.0


class RayRolloutPool:
    """Rollout actors kept alive across `run` calls. num_actors None: one actor per alive node with
    at least one CPU, pinned to it (a node that joins later gets one too); an int: that many, placed
    by Ray. `address`: ``"auto"``, ``"ray://host:port"`` or ``"local"`` (start a private cluster
    here); a cluster this pool started is shut down by `close`. `actor_options` go to
    `ray.remote(...).options` (default ``{"num_cpus": 1}``). infra_retries: how many times a spec
    whose attempt ended in an infrastructure failure (its actor or node died, its sandbox failed) runs
    again, on a live actor (`clawfast.rollout.retry`; 0: never)."""

    def __init__(self, setup: RaySetup, *, address: str | None = None, num_actors: int | None = None,
                 actor_options: dict | None = None, infra_retries: int = 0) -> None:
        import ray

        if num_actors is not None and num_actors < 1:
            raise ValueError(f"num_actors must be at least 1, got {num_actors}")
        if infra_retries < 0:
            raise ValueError(f"infra_retries must be >= 0, got {infra_retries}")
        self.setup = setup
        self.num_actors = num_actors
        self.infra_retries = infra_retries
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # "local" passes through: Ray's own word for a private cluster even where another runs (no
            # address, Ray joins the one RAY_ADDRESS or the last `ray start` names).
            ray.init(address=address)
        # Per actor, by index (actors are only ever added): its handle, its node (the one it is pinned
        # to; placed by Ray: None until a rollout's outcome names it), the rollouts running on it over
        # every concurrent `run` (the cap is per actor); dead ones (process or node gone) get no more
        # rollouts.
        self.actors: list[Any] = []
        self._nodes: list[str | None] = []
        self._load: list[int] = []
        self._dead: set[int] = set()
        self._starting: dict[Any, int] = {}  # an actor's `ready` call -> the actor, until its start ended
        self._start_errors: list[str] = []  # why actors did not start, in the order seen
        self._lost: dict[str, float] = {}  # node id -> when its actor died
        self._freed = threading.Condition()
        self._growing = threading.Lock()
        self._checked = 0.0
        self._options = {"num_cpus": 1, "max_concurrency": setup.concurrency, **(actor_options or {})}
        self._actor_cls = ray.remote(RolloutActor)
        try:
            if num_actors is None:
                nodes = self._capable_nodes()
                if not nodes:
                    raise ValueError(f"no alive Ray node has {self._options['num_cpus']} CPU(s) for a rollout actor")
                for node in nodes:
                    self._add_actor(node)
            else:
                for _ in range(num_actors):
                    self._add_actor(None)
            self._await_first_start()
        except BaseException:
            self._shutdown()
            raise
        self._checked = time.monotonic()

    def _await_first_start(self) -> None:
        """Return once one actor has started; if every one failed to (a suite it cannot load, a harness it
        cannot install), raise RuntimeError with the first one's cause, here at the start, instead of
        every rollout failing later as a lost node."""
        log.info("waiting for a rollout actor to start (suite, harness installs)")
        while True:
            with self._freed:
                if any(i not in self._starting.values() for i in self._live()):
                    return
                if not self._starting:
                    break
            self._note_starts(wait=True)
        raise RuntimeError(f"no rollout actor started (suite {self.setup.suite!r}); the first one's error: "
                           f"{self._start_errors[0]}")

    def _note_starts(self, *, wait: bool = False) -> None:
        """Take in the actors whose start ended (`wait`: wait for one first). One whose start raised is
        dead (`_actor_died`: its node gets no new actor for `NODE_GRACE_S`), with a warning naming why."""
        import ray

        with self._freed:
            pending = list(self._starting)
        if not pending:
            return
        done, _ = ray.wait(pending, num_returns=1 if wait else len(pending), timeout=None if wait else 0)
        for ref in done:
            with self._freed:
                actor = self._starting.pop(ref, None)
            if actor is None:  # another run's thread took it in
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:  # its creation raised, or Ray could not place or set it up
                self._start_errors.append(str(exc))
                self._actor_died(actor, f"did not start: {exc}")

    def __enter__(self) -> "RayRolloutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _capable_nodes(self) -> list[str]:
        import ray

        return [n["NodeID"] for n in ray.nodes()
                if n["Alive"] and n["Resources"].get("CPU", 0) >= self._options["num_cpus"]]

    def _add_actor(self, node: str | None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = dict(self._options)
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        actor = self._actor_cls.options(**options).remote(self.setup)
        with self._freed:
            self.actors.append(actor)
            self._nodes.append(node)
            self._load.append(0)
            self._starting[actor.ready.remote()] = len(self.actors) - 1
            self._freed.notify_all()
        if node is not None:
            log.info("rollout actor %d placed on Ray node %s", len(self.actors) - 1, node)

    def _live(self) -> list[int]:
        return [i for i in range(len(self.actors)) if i not in self._dead]

    def _grow(self, *, now: bool = False) -> None:
        """Place actors where capacity is (again): on each alive node without a live actor (one per
        node mode), or in place of dead ones while the cluster has free CPUs (`num_actors` mode).
        Looks at most every `REFRESH_S` unless `now`; one thread at a time."""
        import ray

        if not (now or time.monotonic() - self._checked >= REFRESH_S) or not self._growing.acquire(blocking=False):
            return
        try:
            self._checked = time.monotonic()
            if self.num_actors is None:
                with self._freed:
                    served = {self._nodes[i] for i in self._live()}
                for node in self._capable_nodes():
                    died = self._lost.get(node)
                    if node not in served and (died is None or time.monotonic() - died >= NODE_GRACE_S):
                        self._add_actor(node)
            else:
                missing = self.num_actors - len(self._live())
                free = int(ray.available_resources().get("CPU", 0) // max(self._options["num_cpus"], 1e-9))
                for _ in range(min(missing, free)):
                    self._add_actor(None)
        finally:
            self._growing.release()

    def _actor_died(self, actor: int, why: str = "died: its rollouts run again on live actors") -> None:
        """Its process or node is gone (or unreachable), or it never started: it gets no more rollouts,
        and it is killed so that one merely unreachable cannot come back with rollouts nobody waits for."""
        import ray

        with self._freed:
            if actor in self._dead:
                return
            self._dead.add(actor)
            node = self._nodes[actor]
            if node is not None:
                self._lost[node] = time.monotonic()
        log.warning("rollout actor %d (Ray node %s) %s", actor, node, why)
        ray.kill(self.actors[actor], no_restart=True)

    def run(self, specs: Sequence[RolloutSpec], control: RolloutControl, *, sampling: Sampling | None = None,
            on_result: Callable[[RolloutResult], None] | None = None, progress: bool = False) -> list[RolloutResult]:
        """Every spec on the actors, each rollout opened and closed through `control` (the proxy's
        registry) in this process; results in spec order, `on_result` called with each as it ends.
        Several threads may run at once: each actor runs at most ``concurrency`` rollouts of all of them."""
        import ray

        unknown = sorted({s.harness for s in specs} - set(self.setup.harnesses))
        if unknown:
            raise ValueError(f"specs use harness(es) {unknown} that the setup does not install")
        stats = RunStats(total=len(specs))
        display = rollout_line(stats) if progress else None
        results: list[RolloutResult | None] = [None] * len(specs)
        inflight: dict[Any, _InFlight] = {}
        # (spec index, spec, notes of its failed attempts); a retry goes to the front.
        queue: deque[tuple[int, RolloutSpec, list[dict[str, Any]]]] = deque((i, s, []) for i, s in enumerate(specs))
        freed = self._freed

        def finish(index: int, result: RolloutResult) -> None:
            results[index] = result
            stats.record(result)
            if on_result is not None:
                on_result(result)

        try:
            if display:
                display.start()
            self._grow(now=True)  # a node that joined since the last run takes this run's rollouts too
            while queue or inflight:
                if queue:
                    self._grow(now=not self._live())
                self._note_starts()
                while queue:
                    with freed:
                        live = self._live()
                        if not live:  # every actor died and no capacity came back: nothing can run what is left
                            while queue:
                                index, spec, retries = queue.popleft()
                                finish(index, RolloutResult(
                                    rollout_id=f"unrun-{spec.task.id}-{spec.harness}-{spec.sample_index}",
                                    task_id=spec.task.id, harness=spec.harness, sample_index=spec.sample_index,
                                    status="sandbox_error",
                                    info={"error": "no live rollout actor: every actor died",
                                          **({"retries": retries} if retries else {})}))
                            break
                        started = [i for i in live if i not in self._starting.values()]
                        if not started:  # the live ones are still starting: wait for one
                            break
                        actor = min(started, key=lambda i: self._load[i])
                        if self._load[actor] >= self.setup.concurrency:
                            break
                        self._load[actor] += 1  # the slot is taken before the rollout opens
                    index, spec, retries = queue.popleft()
                    try:
                        opened = control.open(task_id=spec.task.id, harness=spec.harness,
                                              sample_index=spec.sample_index, sampling=sampling)
                    except Exception as exc:
                        self._release(actor)
                        finish(index, unopened_result(spec, exc, {"timings": {}}))
                        continue
                    try:
                        ref = self.actors[actor].run.remote(spec.task.id, spec.harness, spec.sample_index,
                                                            opened.rollout_id, opened.key, opened.base_url)
                    except BaseException:  # interrupted before it is in flight: nothing opened stays open
                        self._release(actor)
                        close_rollout(control, spec, opened.rollout_id, 0.0, "harness_error", {"error": "cancelled"},
                                      time.monotonic())
                        raise
                    inflight[ref] = _InFlight(index, spec, opened.rollout_id, actor, retries)
                stats.running = len(inflight)
                if display:
                    display.update()
                with freed:
                    starting = list(self._starting) if queue else []
                if not inflight and not starting:  # every slot is another run's: wait for one to free
                    with freed:
                        freed.wait(timeout=1.0)
                    continue
                # Wake as a rollout ends or, with work queued, as an actor's start ends (it takes work then).
                done, _ = ray.wait(list(inflight) + starting, num_returns=1, timeout=REFRESH_S)
                if not done or done[0] not in inflight:  # look again for capacity (come back, or started)
                    continue
                job = inflight.pop(done[0])
                self._release(job.actor)
                try:
                    outcome = ray.get(done[0])
                    if self._nodes[job.actor] is None:
                        self._nodes[job.actor] = outcome["info"].get("ray_node_id")
                except Exception as exc:
                    node = self._nodes[job.actor]
                    where = {} if node is None else {"ray_node_id": node}
                    if isinstance(exc, ray.exceptions.RayTaskError):
                        # The actor's run raised: a bug, which stops the run as it stops the local
                        # scheduler's (the rollout closed as `RolloutWorker.execute` closes it).
                        info = {"error": f"internal error: {getattr(exc, 'cause', exc)!r}", **where}
                        close_rollout(control, job.spec, job.rollout_id, 0.0, "harness_error", info, job.t0)
                        raise
                    # The actor or its node died: no outcome to trust.
                    outcome = {"status": "sandbox_error", "reward": 0.0,
                               "info": {"error": f"rollout actor failed: {type(exc).__name__}: {exc}", **where}}
                    if isinstance(exc, ray.exceptions.RayActorError):
                        outcome["info"]["actor_died"] = True
                        self._actor_died(job.actor)
                if job.retries:
                    outcome["info"]["retries"] = job.retries
                result = close_rollout(control, job.spec, job.rollout_id, outcome["reward"], outcome["status"],
                                       outcome["info"], job.t0)
                if should_retry(result, len(job.retries), self.infra_retries):
                    control.set_aside(result.rollout_id)
                    queue.appendleft((job.index, job.spec, [*job.retries, attempt_note(result)]))
                    continue
                finish(job.index, result)
            missing = [i for i, r in enumerate(results) if r is None]
            if missing:  # a bug: every spec ends in `finish`
                raise RuntimeError(f"rollout pool: specs {missing} ended without a result")
            return results
        finally:
            for ref, job in inflight.items():  # interrupted: nothing opened stays open
                ray.cancel(ref)
                self._release(job.actor)
                close_rollout(control, job.spec, job.rollout_id, 0.0, "harness_error", {"error": "cancelled"}, job.t0)
            if display:
                display.stop()

    def _release(self, actor: int) -> None:
        with self._freed:
            self._load[actor] -= 1
            self._freed.notify_all()

    def close(self) -> None:
        """Close every actor (its sandboxes destroyed), kill it, and stop a cluster we started."""
        import ray

        try:
            # A dead actor's sandboxes went with its processes (bwrap's parent-death signal): only the
            # live ones are asked to destroy theirs.
            closing = {i: a.close.remote() for i, a in enumerate(self.actors) if i not in self._dead}
            for i, ref in closing.items():
                try:
                    ray.get(ref, timeout=CLOSE_TIMEOUT_S)
                except ray.exceptions.RayActorError as exc:
                    log.warning("rollout actor %d died before the pool closed (no rollout of it was running): %s",
                                i, exc)
                except ray.exceptions.GetTimeoutError:
                    log.warning("rollout actor %d did not close within %.0f s: killed", i, CLOSE_TIMEOUT_S)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            self._shutdown()

    def _shutdown(self) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()

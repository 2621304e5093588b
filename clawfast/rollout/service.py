"""The rollout service: the one place where a rollout run is assembled. It owns the serving proxy (HTTP
server, rollout registry, optionally the gRPC control plane), the engine's life on the proxy's event
loop, the sandbox backend, the verifier runner and the harness adapters, here or in Ray actors; a
caller only asks for rollouts.

    with RolloutService(engine, model_dir, records_dir="runs/r/records",
                        harnesses=HarnessConfig({"mini-swe-agent": {"max_turns": 8}})) as service:
        results = service.run(make_specs(tasks, ["mini-swe-agent"], k=4), Sampling(temperature=1.0))

It is built from its settings, one object per part it assembles: `ProxyConfig` (`clawfast.serving`:
the proxy's bounds), `EndpointConfig` (where the proxy listens, under what name), `HarnessConfig`,
`SandboxConfig` and `SchedulingConfig` (how many at once, here or on Ray). None is taken apart to be
put back together: the `ProxyConfig` reaches `ProxyCore` as given, and the worker's `RolloutConfig` is
made once, for this process and every Ray actor alike. A training run maps its `RunConfig` to them in
`clawfast.train.build.rollout_service`. Each harness is told the context the proxy serves (the smaller
of `ProxyConfig.max_model_len` and the engine's own): an adapter's ``context_window`` the options
leave unset is that limit (`clawfast.rollout.spec.with_context`), so it compacts before the proxy
would refuse its prompt.

`run` returns one `RolloutResult` per spec, in spec order (status contract: `clawfast.rollout.worker`),
an attempt that ended in an infrastructure failure run again up to `SchedulingConfig.infra_retries`
times (`clawfast.rollout.retry`; the failed attempts' records set aside under ``<records_dir>/retried/``).
`sampling` (temperature, top_p, output cap, call budget) travels with each rollout it opens, so two
runs with different sampling never touch a shared setting. Records are written by the proxy as calls
are answered (``<records_dir>/<rollout_id>.cfr``) and reach the caller once, from the registry.

Where rollouts run: by default on one asyncio loop of this process (`RolloutScheduler`,
`concurrency` at once over every caller: `run` may be called from several threads at once). With
``SchedulingConfig(ray=OnRay(...))``, in one `clawfast.rollout.ray_backend` actor per alive Ray node
(each `concurrency` at once); the proxy then listens on all interfaces and each actor relays its
node's loopback to it. The engine: any `Engine` (the service closes it on exit, on the
proxy's loop where its workers live), or ``"oracle"``: the scripted engine playing `oracle_tasks`'
oracles through each harness's own tools (`clawfast.rollout.oracle`; the cold start and
`clawfast harness check`). With no harnesses the service is the proxy alone (`clawfast proxy serve`):
`open` and `close` manage rollouts by hand.

This module imports the machinery it assembles only when the service starts, so importing it (the
trainer does, on every rank of an FSDP run) loads no HTTP server, sandbox or harness code.

Guaranteed: every rollout a `run` opened is closed before it returns or raises; on exit the sandbox
backend (or the Ray actors) and the gRPC server stop, every rollout still open is closed as
``proxy_error``, the engine is closed on the proxy's loop, and then the HTTP server stops. Not guaranteed: that harnesses, sandbox backend or Ray exist on this
machine (checked on entry, with errors that say what is missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from clawfast.engines.base import Engine, Sampling
from clawfast.records import RolloutResult
from clawfast.rollout.spec import RolloutSpec, with_context
from clawfast.serving import ProxyConfig
from clawfast.tasks.task import Task

ORACLE = "oracle"
SANDBOXES = ("bwrap", "docker", "local")


@dataclass(frozen=True)
class OnRay:
    """Run rollouts on the Ray cluster at `address` (``"auto"``, ``"ray://host:port"``, or
    ``"local"`` to start a private one here). suite / suite_seed: what each actor loads its tasks
    from (a built-in suite name or a task directory present on every node): every spec's task id must
    be in it. num_actors: None for one per alive node; actor_options: `ray.remote` options."""

    address: str
    suite: str
    suite_seed: int = 0
    num_actors: int | None = None
    actor_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SandboxConfig:
    """backend: ``bwrap``, ``docker`` or ``local`` (no isolation; its verifier runs in a plain
    subprocess)."""

    backend: str = "bwrap"

    def __post_init__(self) -> None:
        if self.backend not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {SANDBOXES}, got {self.backend!r}")


@dataclass(frozen=True)
class HarnessConfig:
    """options: adapter name -> `clawfast.harness.get_harness` keyword arguments (plain data: Ray
    actors build their own adapters); none: the service is the proxy alone. timeout_s: harness wall
    clock (None: each task's own). logs_dir: where harness logs are kept (None: not kept)."""

    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    timeout_s: float | None = None
    logs_dir: str | Path | None = None

    def __post_init__(self) -> None:
        # Copies the caller cannot change under a running service, in types that pickle to Ray actors.
        object.__setattr__(self, "options", {name: dict(options) for name, options in self.options.items()})
        if self.logs_dir is not None:
            object.__setattr__(self, "logs_dir", Path(self.logs_dir))


@dataclass(frozen=True)
class SchedulingConfig:
    """concurrency: rollouts in flight (per actor on Ray). ray: run them on a Ray cluster (None:
    on one asyncio loop of this process). infra_retries: how many times a spec whose attempt ended
    in an infrastructure failure (sandbox, Ray actor or node) runs again (`clawfast.rollout.retry`)."""

    concurrency: int = 4
    ray: OnRay | None = None
    infra_retries: int = 2

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.infra_retries < 0:
            raise ValueError(f"infra_retries must be >= 0, got {self.infra_retries}")


@dataclass(frozen=True)
class EndpointConfig:
    """host / port: the proxy's HTTP address (host None: loopback, or all interfaces on Ray; port 0:
    a free one). grpc_port: also serve the gRPC control plane there (0: any port; None: no gRPC)
    behind `grpc_token` (None: a fresh one). model_name: the name harnesses are told to send and
    ``/v1/models`` reports. access_log: a file the proxy appends one JSON line per HTTP request to
    (`clawfast.proxy.server.AccessLog`; None: no access log)."""

    host: str | None = None
    port: int = 0
    grpc_port: int | None = None
    grpc_token: str | None = None
    model_name: str = "policy"
    access_log: str | Path | None = None


class RolloutService:
    """engine: an `Engine`, or ``"oracle"`` (needs `oracle_tasks`). tokenizer_dir: the Hugging Face
    directory whose tokenizer and chat template the proxy renders with. records_dir: where each
    rollout's records are written. proxy / endpoint / harnesses / sandbox / scheduling: the settings
    of each part (None: its defaults; the module docstring lists them). default_sampling: for
    rollouts opened without a `Sampling` (over gRPC, or by `open`)."""

    def __init__(
        self,
        engine: Engine | str,
        tokenizer_dir: str | Path,
        *,
        records_dir: str | Path,
        proxy: ProxyConfig | None = None,
        endpoint: EndpointConfig | None = None,
        harnesses: HarnessConfig | None = None,
        sandbox: SandboxConfig | None = None,
        scheduling: SchedulingConfig | None = None,
        default_sampling: Sampling | None = None,
        oracle_tasks: Sequence[Task] = (),
    ) -> None:
        if isinstance(engine, str) and engine != ORACLE:
            raise ValueError(f"engine must be an Engine or {ORACLE!r}, got {engine!r}")
        if engine == ORACLE and not oracle_tasks:
            raise ValueError("engine='oracle' needs oracle_tasks (the tasks whose oracles it plays)")
        self.engine = engine
        self.tokenizer_dir = Path(tokenizer_dir)
        self.records_dir = Path(records_dir)
        self.proxy = proxy or ProxyConfig()
        self.endpoint = endpoint or EndpointConfig()
        self.harnesses = harnesses or HarnessConfig()
        self.harness_options: dict[str, dict[str, Any]] = {}  # what each adapter is built with, set at start
        self.sandbox = sandbox or SandboxConfig()
        self.scheduling = scheduling or SchedulingConfig()
        if self.scheduling.ray is not None and not self.harnesses.options:
            raise ValueError("ray needs at least one harness to run")
        self.default_sampling = default_sampling
        self.host = self.endpoint.host or ("0.0.0.0" if self.scheduling.ray is not None else "127.0.0.1")
        self.grpc_token = self.endpoint.grpc_token  # a fresh one is made when gRPC starts without one
        self.oracle_tasks = list(oracle_tasks)
        self._stack: contextlib.ExitStack | None = None

    # -- life --------------------------------------------------------------------------------------

    def __enter__(self) -> "RolloutService":
        from transformers import AutoTokenizer

        from clawfast.harness import get_harness
        from clawfast.proxy.core import ProxyCore
        from clawfast.proxy.render import ChatRenderer
        from clawfast.proxy.rollouts import RolloutRegistry
        from clawfast.proxy.server import ProxyApp, ProxyServer

        stack = contextlib.ExitStack()
        try:
            # Each harness is told the context the proxy serves (the engine's, for the oracle none).
            context = self.proxy.served_context(None if self.engine == ORACLE else self.engine.max_model_len)
            self.harness_options = {name: with_context(name, options, context)
                                    for name, options in self.harnesses.options.items()}
            self.adapters = {name: get_harness(name, **options) for name, options in self.harness_options.items()}
            for harness in self.adapters.values():
                harness.installation  # install (or find) before any rollout's clock starts
            renderer = ChatRenderer(AutoTokenizer.from_pretrained(self.tokenizer_dir))
            if self.engine == ORACLE:
                from clawfast.engines.scripted import ScriptedEngine
                from clawfast.rollout.oracle import OracleResponder

                responder = OracleResponder(renderer, list(self.adapters.values()), self.oracle_tasks)
                self.engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, responder=responder)
            self.registry = RolloutRegistry(self.records_dir, default_sampling=self.default_sampling)
            core = ProxyCore(self.engine, renderer, self.proxy)
            app = ProxyApp(core, self.registry, model_name=self.endpoint.model_name,
                           access_log=self.endpoint.access_log)
            self.server = stack.enter_context(ProxyServer(app, self.host, self.endpoint.port))
            # Exit order (last registered runs first): what starts below stops first, then open
            # rollouts are closed, then the engine closes on the proxy's loop, then the server stops.
            stack.callback(self._close_engine)
            stack.callback(self.registry.close_all)
            self.grpc = self._start_grpc(stack) if self.endpoint.grpc_port is not None else None
            on_ray = self.scheduling.ray is not None
            self._pool = self._start_ray(stack) if on_ray else None
            self._scheduler = self._start_local(stack) if self.adapters and not on_ray else None
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def _close_engine(self) -> None:
        loop = self.server.loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self.engine.close(), loop).result(timeout=60)

    def _start_grpc(self, stack: contextlib.ExitStack):
        from clawfast.proxy.grpc_service import GrpcControlServer

        self.grpc_token = self.grpc_token or secrets.token_urlsafe(24)
        return stack.enter_context(GrpcControlServer(self.registry, self.grpc_token, host=self.host,
                                                     port=self.endpoint.grpc_port, engine=self.engine))

    def _rollout_config(self):
        """The worker's `RolloutConfig`, here and on every Ray actor alike."""
        from clawfast.rollout.worker import RolloutConfig

        return RolloutConfig(model=self.endpoint.model_name, timeout_s=self.harnesses.timeout_s,
                             logs_dir=self.harnesses.logs_dir)

    def _start_local(self, stack: contextlib.ExitStack):
        from clawfast.rollout.worker import RolloutWorker
        from clawfast.sandbox import create_backend
        from clawfast.tasks.sandbox_runner import SandboxRunner

        name = self.sandbox.backend
        backend = create_backend(name, **({"allow_unsafe": True} if name == "local" else {}))
        stack.callback(backend.close)
        # "local" has no isolation to offer a verifier: it scores in a plain subprocess.
        runner = None if name == "local" else SandboxRunner(backend)
        from clawfast.rollout.scheduler import RolloutScheduler

        worker = RolloutWorker(self.registry, backend, self.adapters, config=self._rollout_config(),
                               verifier_runner=runner)
        return stack.enter_context(RolloutScheduler(worker, concurrency=self.scheduling.concurrency,
                                                    infra_retries=self.scheduling.infra_retries))

    def _start_ray(self, stack: contextlib.ExitStack):
        import ray

        from clawfast.rollout.ray_backend import RayRolloutPool, RaySetup

        on = self.scheduling.ray
        if not ray.is_initialized():
            ray.init(address=on.address)  # "local": a private cluster (`RayRolloutPool`)
            stack.callback(ray.shutdown)
        node = ray.util.get_node_ip_address()  # this node as the cluster reaches it
        setup = RaySetup(
            suite=on.suite, suite_seed=on.suite_seed, harnesses=self.harness_options, sandbox=self.sandbox,
            rollout=self._rollout_config(), concurrency=self.scheduling.concurrency,
            proxy_address=f"{node}:{self.server.port}",
        )  # fmt: skip
        return stack.enter_context(RayRolloutPool(setup, num_actors=on.num_actors, actor_options=on.actor_options,
                                                  infra_retries=self.scheduling.infra_retries))

    # -- rollouts ----------------------------------------------------------------------------------

    def run(self, specs: Sequence[RolloutSpec], sampling: Sampling | None = None, *,
            on_result: Callable[[RolloutResult], None] | None = None, progress: bool = False) -> list[RolloutResult]:
        """Run every spec; every call of every rollout samples with `sampling` (None:
        `default_sampling`). `on_result` gets each result as it ends; `progress` draws a live line.
        Blocks the calling thread; several threads may run at once (an asynchronous trainer's
        groups, an evaluation beside them): their rollouts share the one concurrency cap."""
        self._require_started()
        unknown = sorted({s.harness for s in specs} - set(self.harnesses.options))
        if unknown:
            raise ValueError(f"specs use harness(es) {unknown}; "
                             f"this service runs {sorted(self.harnesses.options)}")
        if self._pool is not None:
            return self._pool.run(specs, self.registry, sampling=sampling, on_result=on_result, progress=progress)
        return self._scheduler.run(specs, sampling, on_result=on_result, progress=progress)

    def open(self, rollout_id: str | None = None, *, task_id: str = "", harness: str = "", sample_index: int = 0,
             sampling: Sampling | None = None):
        """Open a rollout by hand (a harness run elsewhere): returns its `OpenedRollout` (key, URL)."""
        self._require_started()
        return self.registry.open(rollout_id, task_id=task_id, harness=harness, sample_index=sample_index,
                                  sampling=sampling)

    def close(self, rollout_id: str, *, reward: float = 0.0, status: str = "ok",
              info: dict[str, Any] | None = None) -> RolloutResult:
        """Close a rollout opened by `open`; returns it with every call."""
        self._require_started()
        return self.registry.close(rollout_id, reward=reward, status=status, info=info)

    @property
    def base_url(self) -> str:
        """The proxy's HTTP root (no ``/v1``)."""
        self._require_started()
        return self.server.base_url

    def _require_started(self) -> None:
        if self._stack is None:
            raise RuntimeError("RolloutService is not running: use it as a context manager (with ... as service)")

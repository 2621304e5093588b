"""One rollout end to end: open a proxy rollout, run the harness in a fresh sandbox, score the final
workspace, close the rollout. The asyncio scheduler calls `RolloutWorker.run`; a Ray actor calls
`RolloutWorker.execute` for a rollout its caller opened (and closes) in the proxy's own process.

Status (one per rollout):

- ``proxy_error``: the proxy could not open the rollout, or could not close it with its outcome (an
  outcome no record can hold: it is closed again as this, with the calls, ``info["error"]`` and the
  entries of the outcome's info a record can hold; a proxy that cannot be reached: no calls are
  returned, and its own log file may still hold them).
- ``sandbox_error``: no sandbox started after `RolloutConfig.sandbox_start_attempts` tries (or the
  backend refused the task outright, e.g. a `Task.workdir` the local backend cannot place:
  ``info["sandbox_refused"]``, which no retry can help), or the sandbox died or lost its forwarder
  while the harness ran, or the verifier's runner failed (or, on Ray, the actor running it died).
- ``timeout``: the harness ran past the wall-clock limit and was killed with its process tree.
- ``harness_error``: the harness exited non-zero (128+N when signal N killed it), its adapter could
  not configure it, or the run was cancelled (``info["error"] == "cancelled"``). When the sandbox can
  tell that a limit did it (memory, processes, file size, disk), ``info["limit"]`` names it and the
  error says it in words; ``info["limit"]`` is set too when the harness survived a limit that ended
  one of its commands. Where the harness said why it failed in its own output
  (`Harness.exit_reason`), the error ends with that ("; it reported ...").
- ``verifier_error``: the harness exited 0 but the verifier could not score the workspace (it
  crashed, timed out, or printed no score), or the run's transcript that its graders read could not
  be had: the reward is unknown.
- ``ok``: the harness exited 0 and the verifier scored the workspace.

The verifier runs whenever the harness ran (ok, timeout or harness_error): the reward is its score,
whatever the status (a harness that timed out may still have done the work; the trainer decides by
status what to use). If the verifier cannot score the workspace the reward is 0.0 and
``info["verifier"]`` says why (with the verifier's output); an ``ok`` rollout becomes
``verifier_error``, or ``sandbox_error`` when the verifier's own sandbox failed, so that no bogus
reward reaches training.

Tasks whose graders read the run's transcript (PinchBench's ``grade``, ClawGym's reward payload, a
rubric) get it before the verifier runs (`rollout_transcript`): the harness's own session log where
its adapter reads one and every assistant turn in it is one the model produced (the log is in the
sandbox's HOME, which the agent can write), else the proxy's, from the rollout's recorded main thread. A task with a
rubric keeps its judge's prompt in ``info["judge"]`` (built here, where the final workspace still
exists; the judge answers later, `clawfast.tasks.scoring`).

Guaranteed: a rollout that was opened is closed exactly once (also on cancellation), its sandbox is
closed before `run` returns, and a sandbox start is retried but a harness run never is. The harness's
stdout, stderr and trajectory files are copied to ``<logs_dir>/<rollout_id>/`` when `logs_dir` is set.
Not guaranteed: detecting proxy failures that the harness only saw as HTTP errors (they surface as
`harness_error` or as a short rollout).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import numbers
import threading
import time
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, TypeVar
from urllib.parse import urlsplit

from clawfast.engines.base import Sampling
from clawfast.harness.base import Harness, RunLayout, copy_artifacts
from clawfast.harness_install import host_runtime
from clawfast.proxy.rollouts import OpenedRollout
from clawfast.records import RolloutResult, json_problem
from clawfast.rollout.spec import RolloutSpec
from clawfast.sandbox import Limits, RunResult, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from clawfast.sandbox.result import limit_message
from clawfast.proxy.transcript import fetch_transcript
from clawfast.tasks.judge import judge_prompt
from clawfast.tasks.task import GradeFunctionVerifier, RewardScriptVerifier, Task, VerifierResult
from clawfast.tasks.transcript import with_instruction
from clawfast.tasks.verify import CommandRunner, run_verifier

T = TypeVar("T")
# The end of the harness's stdout a reward script may grade as the final answer.
FINAL_MESSAGE_BYTES = 65536
# How much of a harness's own account of a failed run (`Harness.exit_reason`) the rollout's error keeps.
EXIT_REASON_CHARS = 1000


class RolloutControl(Protocol):
    """What the worker needs of the proxy: its `clawfast.proxy.rollouts.RolloutRegistry` (or anything
    of the same `open` / `close` / `set_aside` shape). `OpenedRollout.base_url` is ``http://127.0.0.1:PORT``."""

    def open(self, *, task_id: str, harness: str, sample_index: int,
             sampling: Sampling | None = None) -> OpenedRollout: ...

    def close(self, rollout_id: str, *, reward: float, status: str, info: dict[str, Any]) -> RolloutResult: ...

    def set_aside(self, rollout_id: str) -> Path: ...


@dataclass(frozen=True)
class RolloutConfig:
    """model: the name harnesses send (every alias maps to it). timeout_s: wall-clock limit of the
    harness run (default: the task's own `timeout`). sandbox_start_attempts / sandbox_retry_delay_s:
    bounded retries of a sandbox that failed to start (delay doubles each try). limits: sandbox
    resource limits. logs_dir: where stdout/stderr/trajectories are kept (None: not kept)."""

    model: str = "policy"
    timeout_s: float | None = None
    sandbox_start_attempts: int = 3
    sandbox_retry_delay_s: float = 0.2
    limits: Limits = field(default_factory=Limits)
    logs_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.sandbox_start_attempts < 1:
            raise ValueError(f"sandbox_start_attempts must be >= 1, got {self.sandbox_start_attempts}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.sandbox_retry_delay_s < 0:
            raise ValueError("sandbox_retry_delay_s must be >= 0")


def proxy_port(base_url: str) -> int:
    """The loopback port of a proxy base URL (the one port the sandbox may reach)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise ValueError(f"proxy base URL must be http://127.0.0.1:PORT, got {base_url!r}")
    return parts.port


def unopened_result(spec: RolloutSpec, error: Exception, info: dict[str, Any]) -> RolloutResult:
    """The ``proxy_error`` result of a rollout the proxy would not open."""
    info["error"] = f"open rollout: {type(error).__name__}: {error}"
    return RolloutResult(
        rollout_id=f"unopened-{spec.task.id}-{spec.harness}-{spec.sample_index}",
        task_id=spec.task.id, harness=spec.harness, sample_index=spec.sample_index,
        status="proxy_error", info=info,
    )  # fmt: skip


def needs_transcript(task: Task) -> bool:
    """Whether `task`'s graders read the run's transcript."""
    return task.rubric is not None or isinstance(task.verifier, (GradeFunctionVerifier, RewardScriptVerifier))


def rollout_transcript(task: Task, harness: Harness, layout: RunLayout, opened: OpenedRollout,
                       info: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's transcript events (`clawfast.tasks.transcript`): the harness's own log where every
    assistant turn in it is one the model produced (`only_the_models_turns`), else the proxy's (said
    in ``info["transcript"]``), behind the task's instruction. Raises what reading either raised."""
    events = harness.transcript(layout)
    recorded = fetch_transcript(opened.base_url, opened.key)
    if events is None:
        events = recorded
    elif not only_the_models_turns(events, recorded):
        # The log lives in the sandbox's HOME, which the agent can write: a tool call or an answer in it
        # that the model never produced was put there, for graders that read the transcript.
        info["transcript"] = "the proxy's: the harness's log holds assistant turns the model did not produce"
        events = recorded
    return with_instruction(task.instruction, events)


def _assistant_items(events: list[dict[str, Any]]) -> Counter:
    """What the assistant turns of a transcript hold: (``"text"``, stripped text) and (``"toolCall"``,
    name, arguments as key-sorted JSON) items, counted."""
    items: Counter = Counter()
    for event in events:
        message = event.get("message") if isinstance(event, dict) else None
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        for item in message.get("content") or ():
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text" and str(item.get("text", "")).strip():
                items[("text", str(item["text"]).strip())] += 1
            elif item.get("type") == "toolCall":
                items[("toolCall", str(item.get("name")), json.dumps(item.get("arguments"), sort_keys=True))] += 1
    return items


def only_the_models_turns(logged: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> bool:
    """Whether every text and tool call of the assistant turns in a harness's `logged` transcript is
    one of those the proxy `recorded` the model producing (as often)."""
    return not (_assistant_items(logged) - _assistant_items(recorded))


def close_rollout(control: RolloutControl, spec: RolloutSpec, rollout_id: str, reward: float, status: str,
                  info: dict[str, Any], t0: float) -> RolloutResult:
    """Close an opened rollout with its outcome; a close that fails is a ``proxy_error`` result, and
    the rollout is closed as that where it is still open."""
    t = time.monotonic()
    try:
        result = control.close(rollout_id, reward=reward, status=status, info=info)
    except Exception as exc:
        # The proxy may have refused the outcome itself (info no record can hold), leaving the rollout
        # open: it is closed again as a proxy_error, with the entries of `info` a record can hold.
        failed = {key: value for key, value in info.items()
                  if isinstance(key, str) and json_problem(value, f"info[{key!r}]") is None}
        failed["error"] = f"close rollout: {type(exc).__name__}: {exc}"
        # The outcome's reward stays on the record where it is a finite number (the default
        # algorithm.keep_statuses trains ok rollouts alone, so a proxy_error's reward is information).
        kept = float(reward) if isinstance(reward, numbers.Real) and math.isfinite(reward) else 0.0
        try:
            return control.close(rollout_id, reward=kept, status="proxy_error", info=failed)
        except Exception:  # closed after all, or the proxy is gone: nothing is left open to close
            return RolloutResult(
                rollout_id=rollout_id, task_id=spec.task.id, harness=spec.harness,
                sample_index=spec.sample_index, reward=kept, status="proxy_error", info=failed,
            )  # fmt: skip
    # The proxy wrote `info` into its log before these two timings existed; the returned result
    # carries them (the durable copy differs only in these timings).
    timings = info.setdefault("timings", {})
    timings["close"] = time.monotonic() - t
    timings["total"] = time.monotonic() - t0
    result.info = {**result.info, **info}  # what the proxy added at close (refusals) stays
    return result


class _Handoff:
    """Hands a thread's result (an opened rollout, a started sandbox) to its awaiting task, or, if that
    task was cancelled first, to `on_orphan`, so nothing the thread created is leaked. Whichever side
    comes second (the thread finishing, or the cancellation) calls `on_orphan`, under one lock, and
    the thread does it itself, so it works even if the event loop is gone by then."""

    def __init__(self, on_orphan: Callable[[Any], object]) -> None:
        self._on_orphan = on_orphan
        self._lock = threading.Lock()
        self._abandoned = False
        self._done = False
        self._result: Any = None

    def run(self, fn: Callable[[], T]) -> T:
        result = fn()
        with self._lock:
            self._done, self._result = True, result
            orphaned = self._abandoned
        if orphaned:
            self._on_orphan(result)
        return result

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            orphaned = self._done
        if orphaned:
            self._on_orphan(self._result)


async def _run_to_completion(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even if the awaiting task is cancelled meanwhile (cleanup must finish);
    then re-raise that cancellation."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def _close_sandbox(sandbox: Sandbox) -> None:
    sandbox.close()


def _exit_account(harness: Harness, run: RunResult) -> str:
    """What a rollout's error adds after the harness's non-zero exit: the harness's own account of it
    (`Harness.exit_reason`), or why there is none to read."""
    if run.stdout_truncated:  # its account, at the end of stdout, was dropped
        return "; its stdout passed the sandbox's output limit, so its own account of the exit was not read"
    try:
        reason = harness.exit_reason(run.stdout.decode("utf-8", errors="replace"))
    except Exception as exc:  # an adapter's (a plugin's) reader must not cost the rollout
        return f"; {type(harness).__name__}.exit_reason failed on its stdout: {type(exc).__name__}: {exc}"
    return f"; it reported {reason[:EXIT_REASON_CHARS]}" if reason else ""


def _unfinished(harness: Harness, layout: RunLayout, info: dict[str, Any]) -> str | None:
    """`Harness.unfinished`; where the adapter's reader fails (a plugin's: it must not cost the
    rollout) None, the failure kept in ``info["unfinished_error"]``."""
    try:
        reason = harness.unfinished(layout)
    except Exception as exc:
        info["unfinished_error"] = f"{type(harness).__name__}.unfinished failed: {type(exc).__name__}: {exc}"
        return None
    return reason[:EXIT_REASON_CHARS] if reason else None


class RolloutWorker:
    """Runs rollouts one at a time per `run` call; safe to call `run` concurrently from one loop.

    control: the proxy's rollout registry (any `RolloutControl`; None for a worker that only
    `execute`s rollouts opened elsewhere, as a Ray actor does). backend: the sandbox backend.
    harnesses: adapters by name (installed beforehand: `Harness.installation`). verifier_runner: where
    command verifiers run (None: a plain subprocess). executor: threads for the blocking parts
    (sandbox start/run, verifier, proxy calls); size it above the concurrency cap.
    """

    def __init__(
        self,
        control: RolloutControl,
        backend: SandboxBackend,
        harnesses: Mapping[str, Harness],
        *,
        config: RolloutConfig | None = None,
        verifier_runner: CommandRunner | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.control = control
        self.backend = backend
        self.harnesses = dict(harnesses)
        self.config = config or RolloutConfig()
        self.verifier_runner = verifier_runner
        self.executor = executor

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def _call_owned(self, fn: Callable[[], T], on_orphan: Callable[[T], object]) -> T:
        """`fn()` in a thread; if this task is cancelled meanwhile, what `fn` returns is given to
        `on_orphan` (see `_Handoff`) and the cancellation propagates."""
        handoff = _Handoff(on_orphan)
        try:
            return await asyncio.shield(self._call(handoff.run, fn))
        except asyncio.CancelledError:
            handoff.abandon()
            raise

    def _harness(self, spec: RolloutSpec) -> Harness:
        harness = self.harnesses.get(spec.harness)
        if harness is None:
            raise ValueError(f"no adapter for harness {spec.harness!r}; have {sorted(self.harnesses)}")
        return harness

    async def run(self, spec: RolloutSpec, sampling: Sampling | None = None,
                  retries: Sequence[dict[str, Any]] = ()) -> RolloutResult:
        """Open a rollout (every call of it sampled with `sampling`), `execute` it, close it.
        retries: the notes of this spec's earlier attempts (`clawfast.rollout.retry`), kept in its info."""
        self._harness(spec)
        info: dict[str, Any] = {"timings": {}, **({"retries": list(retries)} if retries else {})}
        t0 = time.monotonic()
        try:
            opened = await self._call_owned(
                lambda: self.control.open(task_id=spec.task.id, harness=spec.harness, sample_index=spec.sample_index,
                                          sampling=sampling),
                on_orphan=lambda o: self.control.close(
                    o.rollout_id, reward=0.0, status="harness_error", info={"error": "cancelled"}
                ),
            )
        except Exception as exc:
            info["timings"]["total"] = time.monotonic() - t0
            return unopened_result(spec, exc, info)
        info["timings"]["open"] = time.monotonic() - t0
        # Cancelled (the scheduler is stopping) or a bug: the rollout is closed as not ok, and the
        # exception propagates. No status says "interrupted"; harness_error is the nearest truth
        # (the harness run did not complete) and info says why.
        status, reward = "harness_error", 0.0
        try:
            status, reward = await self.execute(spec, opened, info)
        finally:
            # The close finishes even if the scheduler cancels this task (again) meanwhile.
            result = await _run_to_completion(
                self._call(close_rollout, self.control, spec, opened.rollout_id, reward, status, info, t0))
        return result

    async def execute(self, spec: RolloutSpec, opened: OpenedRollout, info: dict[str, Any]) -> tuple[str, float]:
        """Run the harness of an opened rollout in a fresh sandbox and score the workspace; returns
        (status, reward) and fills `info` (timings, errors, verifier verdict). The sandbox is closed
        before it returns; on cancellation or a bug, ``info["error"]`` says which and it re-raises."""
        harness = self._harness(spec)
        info.setdefault("timings", {})
        try:
            port = proxy_port(opened.base_url)
        except ValueError as exc:  # e.g. a registry whose server is not listening yet
            info["error"] = f"proxy: {exc}"
            return "proxy_error", 0.0
        sandbox: Sandbox | None = None
        try:
            sandbox = await self._start_sandbox(spec, harness, opened.rollout_id, port, info)
            if sandbox is None:
                return "sandbox_error", 0.0
            return await self._run_in_sandbox(spec, harness, sandbox, opened, info)
        except BaseException as exc:
            info["error"] = "cancelled" if isinstance(exc, asyncio.CancelledError) else f"internal error: {exc!r}"
            raise
        finally:
            if sandbox is not None:
                await _run_to_completion(self._close_sandbox(sandbox, info))

    async def _close_sandbox(self, sandbox: Sandbox, info: dict[str, Any]) -> None:
        """Destroy the sandbox, killing the harness if it still runs."""
        t = time.monotonic()
        try:
            await self._call(sandbox.close)
        except OSError as exc:
            info["sandbox_close_error"] = str(exc)
        info["timings"]["sandbox_close"] = time.monotonic() - t

    async def _start_sandbox(
        self, spec: RolloutSpec, harness: Harness, rollout_id: str, port: int, info: dict[str, Any]
    ) -> Sandbox | None:
        cfg, task = self.config, spec.task
        install = harness.installation
        sandbox_spec = SandboxSpec(
            files=task.files,
            source_dir=str(task.workspace_dir) if task.workspace_dir is not None else None,
            allow_ports=(port,),
            # Same path inside and out: argv and the install's own absolute paths stay valid.
            ro_binds={str(p): str(p) for p in (install.root, *host_runtime(install.root))},
            workdir=task.workdir,
            hide_paths=tuple(str(p) for p in task.private_dirs),
            limits=cfg.limits,
            default_timeout=cfg.timeout_s or task.timeout,
            name=rollout_id,
        )
        errors = []
        t = time.monotonic()
        for attempt in range(cfg.sandbox_start_attempts):
            if attempt:
                await asyncio.sleep(cfg.sandbox_retry_delay_s * 2 ** (attempt - 1))
            try:
                sandbox = await self._call_owned(lambda: self.backend.create(sandbox_spec), on_orphan=_close_sandbox)
                info["timings"]["sandbox_start"] = time.monotonic() - t
                info["sandbox_attempts"] = attempt + 1
                return sandbox
            except SandboxError as exc:
                errors.append(str(exc))
            except ValueError as exc:
                # The backend cannot make this sandbox at all (e.g. a workdir the local backend cannot
                # place): no retry can help, and the rest of the batch runs on.
                info["sandbox_attempts"] = attempt + 1
                info["error"] = f"sandbox refused the task: {exc}"
                info["sandbox_refused"] = True
                return None
        info["sandbox_attempts"] = cfg.sandbox_start_attempts
        info["error"] = f"sandbox did not start: {errors[-1]}"
        info["sandbox_errors"] = errors
        return None

    async def _run_in_sandbox(
        self, spec: RolloutSpec, harness: Harness, sandbox: Sandbox, opened: OpenedRollout, info: dict[str, Any]
    ) -> tuple[str, float]:
        cfg, task, timings = self.config, spec.task, info["timings"]
        layout = RunLayout(
            home=Path(sandbox.host_home), workspace=Path(sandbox.host_workdir),
            home_inside=sandbox.home, workspace_inside=sandbox.workdir,
        )  # fmt: skip
        try:
            prepared = harness.prepare(layout, opened.base_url, opened.key, cfg.model)
            argv = harness.command(task.instruction, layout)
        except (OSError, ValueError) as exc:
            info["error"] = f"configuring {harness.name} failed: {type(exc).__name__}: {exc}"
            return "harness_error", 0.0
        timeout = cfg.timeout_s or task.timeout

        t = time.monotonic()
        try:
            run: RunResult = await self._call(sandbox.run, argv, env=prepared.env, timeout=timeout, stdin=b"")
        except SandboxError as exc:
            timings["harness"] = time.monotonic() - t
            info["error"] = f"sandbox failed during the harness run: {exc}"
            self._keep_logs(opened.rollout_id, harness, layout, None, info)
            return "sandbox_error", 0.0
        timings["harness"] = time.monotonic() - t
        info["exit_code"] = run.exit_code
        self._keep_logs(opened.rollout_id, harness, layout, run, info)
        # Which sandbox limit the run ran into, also when the harness survived it (a tool command
        # the memory limit killed): the rollout's info says so instead of a bare exit status.
        limit = limit_message(run, cfg.limits)
        if limit is not None:
            info["limit"] = run.limit
        if run.timed_out:
            status = "timeout"
            info["error"] = f"harness ran past {timeout} s and was killed"
        elif run.exit_code != 0:
            status = "harness_error"
            info["error"] = (f"harness exited with status {run.exit_code}" + (f": it {limit}" if limit else "")
                             + _exit_account(harness, run))
        elif (unfinished := _unfinished(harness, layout, info)) is not None:
            status = "harness_error"
            info["error"] = f"harness exited with status 0 without finishing: {unfinished}"
        else:
            status = "ok"
        if status != "ok":
            info["stderr_tail"] = run.stderr[-2000:].decode("utf-8", errors="replace")

        t = time.monotonic()
        transcript = None
        if needs_transcript(task):
            try:
                transcript = await self._call(rollout_transcript, task, harness, layout, opened, info)
            except Exception as exc:  # graders that read a transcript cannot score without it
                timings["transcript"] = time.monotonic() - t
                info["error"] = f"the run's transcript could not be read: {type(exc).__name__}: {exc}"
                return ("verifier_error" if status == "ok" else status), 0.0
            timings["transcript"] = time.monotonic() - t
        t = time.monotonic()
        try:
            # The harness's stdout is its final answer for the harnesses run in print mode.
            final = run.stdout[-FINAL_MESSAGE_BYTES:].decode("utf-8", errors="replace")
            verdict: VerifierResult = await self._call(
                functools.partial(run_verifier, final_message=final, transcript=transcript), task,
                Path(sandbox.host_workdir), self.verifier_runner,
            )
        except Exception as exc:  # the runner itself failed (e.g. its sandbox did not start)
            timings["verify"] = time.monotonic() - t
            info["verifier"] = {"status": "runner_error", "error": f"{type(exc).__name__}: {exc}"}
            if status != "ok":  # the harness's own failure stays the rollout's error
                return status, 0.0
            info["error"] = f"the verifier's runner failed: {type(exc).__name__}: {exc}"
            return "sandbox_error", 0.0
        if task.rubric is not None:
            # Built from what the run left, not by the runner: a failure here is the run's to grade
            # (a transcript the agent wrote into), never an infrastructure failure to run again.
            try:
                prompt = await self._call(judge_prompt, task, transcript, Path(sandbox.host_workdir))
            except Exception as exc:
                timings["verify"] = time.monotonic() - t
                info["verifier"] = verdict.to_json()
                info["error"] = f"the judge's prompt could not be built: {type(exc).__name__}: {exc}"
                return ("verifier_error" if status == "ok" else status), 0.0
            info["judge"] = {"prompt": prompt, "weight": task.rubric.weight}
        timings["verify"] = time.monotonic() - t
        info["verifier"] = verdict.to_json()
        if verdict.status != "ok":
            return ("verifier_error" if status == "ok" else status), 0.0
        return status, verdict.score

    def _keep_logs(
        self, rollout_id: str, harness: Harness, layout: RunLayout, run: RunResult | None, info: dict[str, Any]
    ) -> None:
        if self.config.logs_dir is None:
            return
        dest = Path(self.config.logs_dir) / rollout_id
        dest.mkdir(parents=True, exist_ok=True)
        if run is not None:
            (dest / "stdout").write_bytes(run.stdout)
            (dest / "stderr").write_bytes(run.stderr)
            (dest / "run.json").write_text(json.dumps({
                "exit_code": run.exit_code, "timed_out": run.timed_out, "duration_s": run.duration_s,
                "stdout_truncated": run.stdout_truncated, "stderr_truncated": run.stderr_truncated,
            }) + "\n")  # fmt: skip
        try:
            kept = copy_artifacts(harness.artifacts(layout), layout.home, dest / "home")
        except OSError as exc:
            info["artifacts_error"] = str(exc)
            kept = []
        info["logs"] = str(dest)
        info["artifacts"] = [str(p.relative_to(dest)) for p in kept]

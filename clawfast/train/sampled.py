"""Rollouts sampled straight from an engine and scored by a rule on the sampled tokens: no harness,
no proxy, no sandbox. The loop's third rollout source, for what needs the RL loop itself under test
(does the reward go up? does the asynchronous schedule keep its bound?) without a harness's cost.

    tasks = {"t0": TokenTask("t0", prompt=(5, 9, 2), reward=lambda outputs: float(outputs[0][0] == 7))}
    source = EngineRollouts(engine, tasks, max_tokens=4, seed=0)
    batch = source.run(["t0"], ["sampled"], 16, sampling=Sampling(temperature=1.0), positions=[0])

A rollout makes ``task.turns`` calls shaped like a harness session: call i's prompt is call i-1's
prompt + output + ``task.feedback`` (a tool result), so a rollout is a chain of prefix extensions
and the trainer's tree packing sees what it sees in real traffic. ``task.delay_s`` seconds pass
before each call after the first (the tool's run time), which is how benchmarks give tasks unequal
lengths. The reward is ``task.reward(outputs)`` over the output ids of every call. A task with ``threads``
(`SideThreads`) runs the shape of a harness that delegates and compacts instead: the main call, a
subagent with a prompt of its own, the main call that reads the subagent's answer back as a tool
result, a compaction call (the history + a summary request), and the main thread restarted from the
summary; the proxy's hints are set as a harness's headers would set them (``subagent``,
``compaction``), and `clawfast.threads` recovers the shape from the tokens.

Each call samples with a seed derived from (source seed, data position, task, sample, call), so the
tokens do not depend on which thread asked first; with an engine that batches one request at a
time they are reproducible run to run. The harness name of every rollout is the one asked for
(callers use ``"sampled"``).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from clawfast.engines.base import Engine, Sampling
from clawfast.records import CallRecord, RolloutResult
from clawfast.train.protocols import Batch


@dataclass(frozen=True)
class SideThreads:
    """subagent: the subagent's own first prompt; compact: the summary request appended to the main
    history; restart: what the restarted main prompt opens with before the summary (a harness keeps
    its system prompt: share at least half of the task's prompt, or it is not read as a restart)."""

    subagent: tuple[int, ...]
    compact: tuple[int, ...]
    restart: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("subagent", "compact", "restart"):
            if not getattr(self, name):
                raise ValueError(f"SideThreads.{name} is empty")


# The kinds of a side-thread rollout's calls, in call order (each call's proxy hint too).
SIDE_THREAD_KINDS = ("main", "subagent", "main", "compaction", "main")


@dataclass(frozen=True)
class TokenTask:
    """id; prompt: the first call's token ids; reward: output ids of every call -> reward; turns:
    calls per rollout; feedback: tokens appended after each output; delay_s: seconds before each
    later call; threads: the side-thread shape instead of `turns` (`SIDE_THREAD_KINDS` are its calls;
    the reward gets their outputs in that order)."""

    id: str
    prompt: tuple[int, ...]
    reward: Callable[[list[np.ndarray]], float]
    turns: int = 1
    feedback: tuple[int, ...] = ()
    delay_s: float = 0.0
    threads: SideThreads | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"task {self.id!r}: empty prompt")
        if self.turns < 1:
            raise ValueError(f"task {self.id!r}: turns must be at least 1, got {self.turns}")
        if self.delay_s < 0:
            raise ValueError(f"task {self.id!r}: delay_s must be >= 0, got {self.delay_s}")
        if self.threads is not None and self.turns != 1:
            raise ValueError(f"task {self.id!r}: threads gives the rollout's calls; turns must stay 1")


def call_seed(seed: int, position: int, task_id: str, sample: int, call: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{position}/{task_id}/{sample}/{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EngineRollouts:
    """engine: serves the calls (its own weights: push to it as the loop does); tasks: id -> TokenTask;
    max_tokens: each call's output budget; stop_token_ids: end a call early. The engine runs on a
    loop of this source's own (started here, stopped by `close`), so any thread may call `run`."""

    def __init__(self, engine: Engine, tasks: dict[str, TokenTask], *, max_tokens: int, seed: int = 0,
                 stop_token_ids: Sequence[int] = ()) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.engine = engine
        self.tasks = dict(tasks)
        self.max_tokens = max_tokens
        self.seed = seed
        self.stop_token_ids = tuple(stop_token_ids)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawfast-sampled", daemon=True)
        self._thread.start()

    @property
    def task_ids(self) -> list[str]:
        return sorted(self.tasks)

    def close(self) -> None:
        """Close the engine on its loop and stop the loop. Idempotent."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.engine.close(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def run(self, task_ids: Sequence[str], harnesses: Sequence[str], k: int, *, sampling: Sampling | None = None,
            on_result: Callable[[RolloutResult], None] | None = None, positions: Sequence[int] = ()) -> Batch:
        """One rollout per task x harness x sample (task-major); task j's seeds use data position
        ``positions[j]`` (none given: j)."""
        unknown = [t for t in task_ids if t not in self.tasks]
        if unknown:
            raise ValueError(f"unknown task id(s) {unknown}; have {self.task_ids}")
        sampling = sampling or Sampling()
        t0 = time.monotonic()
        positions = list(positions) or list(range(len(task_ids)))
        if len(positions) != len(task_ids):
            raise ValueError(f"{len(positions)} positions for {len(task_ids)} task ids")
        specs = [(p, t, h, i) for p, t in zip(positions, task_ids) for h in harnesses for i in range(k)]
        futures = [asyncio.run_coroutine_threadsafe(self._rollout(*spec, sampling), self._loop) for spec in specs]
        results = []
        for future in futures:
            results.append(future.result())
            if on_result is not None:
                on_result(results[-1])
        return Batch(results, time.monotonic() - t0)

    async def _rollout(self, position: int, task_id: str, harness: str, sample: int,
                       sampling: Sampling) -> RolloutResult:
        task = self.tasks[task_id]
        rollout_id = f"{task_id}-p{position}-{harness}-{sample}"
        calls: list[CallRecord] = []

        async def call(prompt: np.ndarray) -> np.ndarray:
            i = len(calls)
            tag = "main" if task.threads is None else SIDE_THREAD_KINDS[i]
            if i:
                await asyncio.sleep(task.delay_s)
            # A call here asks for nothing of its own: its budget is this source's, under the rollout's cap.
            params = sampling.params(cap=self.max_tokens, default_max_tokens=self.max_tokens,
                                     seed=call_seed(self.seed, position, task_id, sample, i),
                                     stop_token_ids=self.stop_token_ids)
            gen = await self.engine.generate(prompt, params)
            calls.append(CallRecord(rollout_id, i, harness, prompt, gen.output_ids, gen.infer_logprobs,
                                    weight_version=gen.weight_version, output_versions=gen.output_versions,
                                    finish_reason=gen.finish_reason, tags=(tag,), routing=gen.routing,
                                    routing_start=gen.routing_start))
            return np.asarray(gen.output_ids, dtype=np.int32)

        def ids(tokens) -> np.ndarray:
            return np.asarray(tokens, dtype=np.int32)

        prompt, feedback = ids(task.prompt), ids(task.feedback)
        if task.threads is None:
            for _ in range(task.turns):
                out = await call(prompt)
                prompt = np.concatenate([prompt, out, feedback])
        else:
            shape = task.threads
            first = await call(prompt)
            answer = await call(ids(shape.subagent))
            history = np.concatenate([prompt, first, feedback, answer, feedback])  # its answer as a tool result
            second = await call(history)
            summary = await call(np.concatenate([history, second, ids(shape.compact)]))
            await call(np.concatenate([ids(shape.restart), summary, feedback]))
        outputs = [c.output_ids for c in calls]
        return RolloutResult(rollout_id, task_id, harness, sample_index=sample, reward=float(task.reward(outputs)),
                             status="ok", calls=calls)

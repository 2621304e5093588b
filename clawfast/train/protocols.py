"""The two contracts the training loop is written against, as `typing.Protocol`s: a `RolloutSource`
(where a step's rollouts come from) and a `Trainer` (what trains the policy on them and pushes its
weights). `clawfast.train.loop` and `clawfast.train.producer` depend on these alone, never on a
concrete class (as vLLM's servers depend on the one abstract `EngineClient`).

    RolloutSource: clawfast.train.data.RecordedRollouts, .HarnessRollouts; clawfast.train.sampled.EngineRollouts
    Trainer:       clawfast.train.distributed.LocalTrainer, .ShardedTrainer

Implementations conform structurally (none subclasses these); tests/test_dependencies.py checks that
each has every method of its protocol with a compatible signature. Guaranteed by that test: the
methods and their parameters. Not checked: the annotations, and the behaviour each docstring states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from clawfast.engines.base import Engine, Sampling
from clawfast.records import RolloutResult

if TYPE_CHECKING:  # annotations only: the config's pydantic and the checkpoint's torch stay unloaded
    from clawfast.train.checkpoint import TrainState
    from clawfast.train.config import RunConfig


@dataclass(frozen=True)
class Batch:
    """What a source returns for one `run`: the results, in spec order, and the seconds it took."""

    results: list[RolloutResult]
    seconds: float


@runtime_checkable
class RolloutSource(Protocol):
    """Where a step's rollouts come from. Any thread may call `run`, several at once (the
    asynchronous loop runs one group per thread)."""

    def run(self, task_ids: Sequence[str], harnesses: Sequence[str], k: int, *, sampling: Sampling | None = None,
            on_result: Callable[[RolloutResult], None] | None = None, positions: Sequence[int] = ()) -> Batch:
        """One result per task x harness x sample, task-major, each sampled with `sampling` (a
        source that was sampled already ignores it); `on_result` gets each as it ends. `positions`
        are the data positions of the task ids (a source that seeds by position uses them)."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """What trains the policy: one process's, or rank 0's of an FSDP run. (The cold start replaces
    the one-process trainer's ``optimizer``; FSDP refuses a cold start, so that attribute is no part
    of the contract.)"""

    def step(self, results: list[RolloutResult], config: RunConfig, state: TrainState, ref_policy=None) -> dict:
        """Train on one RL step's rollouts (`clawfast.train.step.train_on_rollouts`); its metrics."""
        ...

    def push_weights(self, engine: Engine, version: int) -> None:
        """Send the current weights to `engine` under `version`."""
        ...

    def share_reference(self, ref_policy):
        """The frozen KL reference as this trainer uses it (None stays None)."""
        ...

    def save_checkpoint(self, run_dir: str | Path, state: TrainState, **kwargs) -> Path:
        """Write a checkpoint of the current weights, optimizer and `state` (`clawfast.train.checkpoint`)."""
        ...

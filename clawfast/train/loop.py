"""The RL loop: rollouts through real harnesses behind the proxy, a training step, a weight push.

    train(load_config("examples/quickstart.toml"), resume=False)

Per step:

1. **Data.** `TaskSampler` takes ``tasks_per_step`` task ids at the run's *data position*: epoch e
   of the training split is a permutation seeded by ``(seed, e)``, so the tasks of a step depend
   only on the seed and the position (which the checkpoint stores), never on what ran before.
2. **Rollouts.** task x harness x ``samples_per_task`` specs run through the run's
   `clawfast.rollout.RolloutService` (`clawfast.train.data.HarnessRollouts`: a fresh sandbox per
   rollout, the harness talking to the proxy, which serves the engine's current weights and records
   every call token for token; the sampling travels with each rollout), or are read from recorded
   rollout files (`RecordedRollouts`: offline data and fast tests of the loop).
3. **Train.** The step's rollouts are shuffled (seeded by ``(seed, step)``: harnesses and tasks mix
   at random in the batch) and handed to `clawfast.train.step.train_on_rollouts` (tree, leaf filter,
   pack, proximal pass, forward under the tree mask, decoupled PPO loss with truncated IS, GRPO/PPO,
   AdamW): ``optim.ppo_epochs`` x ``optim.updates_per_step`` optimizer updates; GRPO groups by task,
   or by task x harness in a mixed-harness run.
4. **Sync.** The weight version is bumped and the policy's weights pushed to the engine through
   the run's `clawfast.train.push.WeightPusher` (whole, or only what changed); every CallRecord
   carries the version that sampled each token. A step that made no update pushes nothing and
   keeps the version.
5. **Log** (`clawfast.train.metrics_log`), **checkpoint** every ``checkpoint.interval`` steps and at the
   end (`clawfast.train.checkpoint`), **evaluate** on the eval split when configured.

**Asynchronous** (``algorithm.max_staleness = k``; unset: the synchronous schedule above): a
`clawfast.train.producer.RolloutProducer` runs rollout groups (one task's rollouts each) up to k
steps ahead of the trainer, so the engine generates while the trainer trains and no step waits for
a straggler the next groups can overtake; a step takes the first groups to finish, drops (and
counts) any with a token older than ``weight_version - k``, and frees their slots after its push and
checkpoint; calls in flight at a push go on on the new weights (``engine.on_update``). k = 0 is the synchronous schedule exactly. docs/DESIGN.md section 4a has the rules.

Distributed (the ``[distributed]`` section): ``rollouts = "ray"`` makes the rollout service run
step 2's harness rollouts in Ray actors, one per alive node of the cluster at ``ray_address``
(``"auto"``, ``"ray://host:port"``, or ``"local"`` to start one here), each with
``rollout.concurrency`` rollouts in flight; the engine and proxy stay in this process.
``fsdp = true`` shards the policy with FSDP2 over the processes of
``torchrun --nproc-per-node N -m clawfast.cli train CONFIG``: rank 0 runs everything above and
hands each step's rollouts to the other ranks, every rank trains its shard, and rank 0 alone pushes
weights and writes metrics and checkpoints (in the one-process format, so either kind resumes in
either). examples/multi_node.toml has the commands for a cluster.

Guaranteed: a run resumed from its latest checkpoint (``resume=True``) continues at the saved step
and data position with the saved weights, optimizer state (moments, step counts; the optimizer's
hyper-parameters are the resumed run's config, `clawfast.train.checkpoint`) and RNG states (an
asynchronous run's groups in flight at the checkpoint are not stored: the resumed run says how many
and runs their tasks again first); with a deterministic rollout source (recorded rollouts) it produces the same
checkpoints as an uninterrupted run (tests/train/test_resume.py). An eval the checkpoint's step asked
for (after the cold start, at an `eval.interval` step, after the last step) that the killed run did not
log is run on resume; one it logged is not run again. Not guaranteed: identical rollouts from real harnesses across a
resume (their timing and the engine's batching are not deterministic).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from clawfast.records import RolloutResult
from clawfast.rollout.retry import infra_counts
from clawfast.train.algorithms import token_lags
from clawfast.train.build import (
    build_engine,
    build_optimizer,
    build_policy,
    load_policy,
    push_weights,
    resolve_device,
    resolve_model_dir,
    rollout_sampling,
    rollout_service,
    weight_pusher,
)
from clawfast.train.checkpoint import TrainState, latest_checkpoint, list_checkpoints, load_checkpoint
from clawfast.train.coldstart import run_coldstart
from clawfast.train.config import RunConfig
from clawfast.train.data import HarnessRollouts, RecordedRollouts, TaskSampler, check_trainable, load_tasks
from clawfast.train.distributed import make_trainer, train_sharded
from clawfast.train.lora import has_adapter, merged_copy
from clawfast.train.producer import RolloutProducer
from clawfast.tasks.judge import build_judge
from clawfast.tasks.scoring import judge_results, write_scores
from clawfast.train.metrics import metrics_by_tag, rollout_metrics, score_counts
from clawfast.train.metrics_log import MetricsLogger, read_metrics
from clawfast.train.plot import plot_run
from clawfast.train.progress import ProgressView
from clawfast.train.protocols import RolloutSource, Trainer
from clawfast.train.push import WeightPusher
from clawfast.train.report import coldstart_line, eval_line, pass_at_1, step_line


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_run_dir(config: RunConfig, resume: bool) -> tuple[Path, Path | None]:
    """Create the run directory; return it and the checkpoint to resume from (None: fresh run); the
    caller writes its config.json once that checkpoint has loaded.
    A fresh run refuses a directory that already holds checkpoints; a resumed one without any starts
    at step 0, and says so. A run that starts at step 0 makes its own KL reference: one left by an
    attempt that never reached a checkpoint (another model.path, perhaps) is removed."""
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run_dir {run_dir} is a file, not a directory")
    ckpt = latest_checkpoint(run_dir) if resume else None
    if not resume and list_checkpoints(run_dir):
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose another run_dir")
    if resume and ckpt is None:
        # Not refused: a job restarted with the same command line (--resume) may not have reached its first
        # checkpoint. But a mistyped run_dir would start over silently, so it is said.
        print(f"no checkpoint in {run_dir}: starting at step 0", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        shutil.rmtree(run_dir / "reference", ignore_errors=True)
    return run_dir, ckpt


def train(config: RunConfig, *, resume: bool = False, progress: bool = True,
          make_source: Callable | None = None) -> dict[str, object]:
    """Run (or resume) the training run `config` describes; returns a summary (eval before/after,
    steps done, run directory, curves PNG). Under ``distributed.fsdp`` every torchrun process calls
    this; rank 0 runs the loop below and the others follow it (clawfast.train.distributed).
    make_source: ``engine -> source`` instead of ``rollout.source`` (e.g. a
    `clawfast.train.sampled.EngineRollouts` over the run's engine; it has ``task_ids`` and
    ``close``; no evaluation, no cold start)."""
    if config.distributed.fsdp:
        return train_sharded(config, lambda group: run_loop(config, resume=resume, progress=progress, group=group,
                                                            make_source=make_source))
    return run_loop(config, resume=resume, progress=progress, make_source=make_source)


def run_loop(config: RunConfig, *, resume: bool, progress: bool, group=None,
             make_source: Callable | None = None) -> dict[str, object]:
    """The loop of `train`; `group`: rank 0's `FsdpGroup` in an FSDP run (None: one process)."""
    if make_source is not None and config.coldstart.enabled:
        raise ValueError("a cold start runs through harnesses: it cannot run with make_source")
    trainer_device = group.device if group is not None else resolve_device(config.model.device)
    if config.model.attention == "varlen" and trainer_device.type != "cuda":
        raise ValueError(f"model.attention = 'varlen' is flash-attention's CUDA kernel; the policy would be on "
                         f"{trainer_device} (model.device = {config.model.device!r})")
    run_dir, ckpt = prepare_run_dir(config, resume)
    seed_everything(config.seed)
    model_dir = resolve_model_dir(config)
    policy = build_policy(config, model_dir)
    if group is None:
        policy = policy.to(trainer_device)
    optimizer = build_optimizer(config, policy)
    state = TrainState()
    if ckpt is not None:
        state = load_checkpoint(ckpt, policy, optimizer)
    if config.coldstart.enabled and not state.extra.get("coldstart_done") and state.step > 0:
        raise ValueError(f"coldstart.enabled on a run resumed at step {state.step} that ran no cold start: a cold "
                         f"start comes before the RL steps; set coldstart.enabled = false to go on")
    # Written once the checkpoint loaded: a resume it refuses leaves the run's record of its config as it was.
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    # FSDP: shards the policy over the ranks; `policy` stays rank 0's plain copy of the weights.
    trainer = make_trainer(config, policy, optimizer, state, group)
    view = ProgressView(config.steps) if progress else None
    logger = MetricsLogger(run_dir, resume_step=state.step if ckpt is not None else None)
    summary: dict[str, object] = {"run_dir": str(run_dir), "resumed_from": str(ckpt) if ckpt else None}
    try:
        if view:
            view.start()
        with contextlib.ExitStack() as stack:
            # Without weight pushes the engine serves model.path's weights throughout, a resumed run's too
            # (not the checkpoint's, which a fresh run's engine never saw).
            served_lm = policy.lm if config.engine.sync_weights else None
            if make_source is not None:
                engine = build_engine(config.engine, model_dir, dtype=config.model.dtype, seed=config.seed,
                                      lm=served_lm, weight_version=state.weight_version, device=trainer_device,
                                      record_routing=config.algorithm.routing_replay, trainer_device=trainer_device)
                source = make_source(engine)
                stack.callback(source.close)
                train_ids, eval_tasks = source.task_ids, {}
            elif config.rollout.source == "recorded":
                source = RecordedRollouts(config.rollout.recorded_dir)
                train_ids, eval_tasks, engine = source.task_ids, {}, None
            else:
                train_tasks = load_tasks(config, config.tasks.split, config.tasks.difficulties, config.tasks.categories)
                check_trainable(train_tasks)
                eval_tasks = load_tasks(config, config.eval.split)
                train_ids = sorted(train_tasks)
                _warn_if_not_held_out(train_tasks, eval_tasks, config.tasks.suite)
                engine = build_engine(config.engine, model_dir, dtype=config.model.dtype, seed=config.seed,
                                      lm=served_lm, weight_version=state.weight_version, device=trainer_device,
                                      record_routing=config.algorithm.routing_replay, trainer_device=trainer_device)
                logs_dir = run_dir / "logs" if config.rollout.keep_logs else None
                service = stack.enter_context(rollout_service(config, engine, model_dir, run_dir / "records",
                                                              logs_dir=logs_dir))
                source = HarnessRollouts(service, {**eval_tasks, **train_tasks})
            sampler = TaskSampler(train_ids, config.seed)
            pusher = weight_pusher(config, engine) if engine is not None and config.engine.sync_weights else None
            fresh = ckpt is None
            if fresh and config.eval.before and eval_tasks:
                summary["eval_before"] = _evaluate(source, config, eval_tasks, logger, view, 0, "before",
                                                   "eval before training")
            if not state.extra.get("coldstart_done") and config.coldstart.enabled:
                summary["coldstart"] = run_coldstart(config, policy, model_dir, run_dir, logger=logger, view=view)
                if view is None:  # the live view reports its phases itself
                    print(coldstart_line(summary["coldstart"]), flush=True)
                state.extra["coldstart_done"] = True
                trainer.optimizer = build_optimizer(config, policy)  # fresh AdamW moments for RL
                if pusher is not None:
                    state.weight_version += 1
                    push_weights(pusher, policy, state.weight_version)
                trainer.save_checkpoint(run_dir, state, tokenizer_dir=model_dir, keep=config.checkpoint.keep)
            # After the cold start; also on a resume from its checkpoint, if that eval was cut short.
            if (state.step == 0 and state.extra.get("coldstart_done") and config.coldstart.enabled
                    and config.eval.after_coldstart and eval_tasks and not _eval_logged(logger, 0, "coldstart")):
                summary["eval_coldstart"] = _evaluate(source, config, eval_tasks, logger, view, 0, "coldstart",
                                                      "eval after cold start", shown="after cold start")
            ref_policy = trainer.share_reference(_reference_policy(config, policy, run_dir, model_dir, state))
            if 0 < state.step < config.steps and _interval_eval_due(config, state.step) and eval_tasks and \
                    not _eval_logged(logger, state.step, f"step {state.step}"):  # cut short before the resume
                _evaluate(source, config, eval_tasks, logger, view, state.step, f"step {state.step}", None)
            feed = stack.enter_context(_make_feed(config, source, sampler, state, view))
            done_here = 0
            if view and state.step < config.steps:
                view.begin(f"{config.algorithm.name.upper()} steps", config.steps - state.step, "steps")
            try:
                while state.step < config.steps:
                    record = _one_step(config, trainer, feed, state, pusher, ref_policy, view)
                    logger.log("train", state.step, record)
                    if view:
                        view.advance(note=f"step {state.step}: reward {record.get('reward/mean', float('nan')):.3f}")
                        view.add_step({"step": state.step, **record}, step_line(state.step, record))
                    else:
                        print(step_line(state.step, record), flush=True)
                    done_here += 1
                    last = state.step == config.steps
                    if state.step % config.checkpoint.interval == 0 or last:
                        feed.store(state)
                        trainer.save_checkpoint(run_dir, state, tokenizer_dir=model_dir, keep=config.checkpoint.keep)
                    feed.release()
                    if eval_tasks and _interval_eval_due(config, state.step):
                        _evaluate(source, config, eval_tasks, logger, view, state.step, f"step {state.step}", None)
            except ValueError as exc:
                # Set-up refuses bad input with a ValueError (`clawfast train` exits 2, printing its message);
                # one raised by a step is a failure of the run, not of its config, and ends it with its traceback.
                raise RuntimeError(f"the run failed after step {state.step} of {config.steps}: {exc}") from exc
            feed.close()
            if view and done_here:
                view.end()
            # A resumed run evaluates at the end unless that eval was logged before (it finished).
            if state.step == config.steps and config.eval.after and eval_tasks and \
                    not _eval_logged(logger, state.step, "after"):
                summary["eval_after"] = _evaluate(source, config, eval_tasks, logger, view, state.step, "after",
                                                  "eval after training")
    finally:
        if view:
            view.stop()
        logger.close()
    summary["steps"] = state.step
    summary["curves"] = _draw_curves(run_dir)
    return summary


def _draw_curves(run_dir: Path) -> str | None:
    """The run's curves.png, or None where there is nothing to plot or no matplotlib (said on stderr:
    a finished run does not fail for want of its picture)."""
    try:
        return str(plot_run(run_dir))
    except (ValueError, FileNotFoundError):
        return None
    except ImportError as exc:
        print(f"clawfast: {exc}", file=sys.stderr)
        return None


EVAL_TAGS = ("suite", "difficulty", "category", "task")


def _warn_if_not_held_out(train_tasks: dict, eval_tasks: dict, suite: str) -> None:
    shared = set(train_tasks) & set(eval_tasks)
    if shared:
        print(f"warning: {len(shared)} of the {len(eval_tasks)} eval tasks of {suite} are training tasks too, "
              f"so the eval is not held out (a ClawGym folder without ?eval=FRACTION is one split)",
              file=sys.stderr, flush=True)


def run_eval(source: RolloutSource, config: RunConfig, eval_tasks: dict, on_result=None, *,
             scores_path: Path | None = None) -> dict[str, float]:
    """pass@1 and mean score of `eval_tasks` at the eval's sampling: overall, per harness, and per
    suite, difficulty, category and task, after ``eval.judge`` scored the rubrics
    (`clawfast.tasks.scoring.judge_results`). Rollouts whose score lacks a part (not judged, or
    the judge failed) are left out of pass@1 and counted (`score_counts`). `on_result` gets each
    rollout as it ends; `scores_path`: where each rollout's score, judge prompt and verdict go
    (one JSON line each)."""
    judge = build_judge(config.eval.judge)  # before the rollouts: a judge that cannot load fails first
    batch = source.run(sorted(eval_tasks), config.rollout.harnesses, config.eval.samples_per_task,
                       sampling=rollout_sampling(config, config.eval.temperature), on_result=on_result)
    judge_results(batch.results, eval_tasks, judge)
    scored = [r for r in batch.results if r.info["score"]["score"] is not None]
    metrics = pass_at_1(scored)
    for tag in EVAL_TAGS:
        metrics.update(metrics_by_tag(scored, eval_tasks, tag))
    metrics.update(score_counts(batch.results))
    metrics["time/eval_s"] = batch.seconds
    if scores_path is not None:
        write_scores(scores_path, batch.results)
    return metrics


def _evaluate(source: RolloutSource, config: RunConfig, eval_tasks: dict, logger: MetricsLogger,
              view: ProgressView | None, step: int, label: str, phase: str | None, *,
              shown: str | None = None) -> dict[str, float]:
    """Evaluate, log the record under `label` at `step`, show `phase` while it runs and the result line
    (named `shown`, default `label`) after; returns the metrics."""
    solved = 0

    def count_solved(r: RolloutResult) -> None:
        nonlocal solved
        solved += r.reward >= 1.0
        view.advance(note=f"solved {solved}")

    if view:
        view.begin(phase or f"eval at {label}", len(eval_tasks) * len(config.rollout.harnesses)
                   * config.eval.samples_per_task, "rollouts")
    # Every eval keeps each rollout's score, judge prompt and verdict beside the run's metrics.
    scores = logger.run_dir / "evals" / f"{step:06d}-{label.replace(' ', '-')}.jsonl"
    m = run_eval(source, config, eval_tasks, count_solved if view else None, scores_path=scores)
    if view:
        view.end()
    logger.log("eval", step, {**m, "label": label})
    _say(view, eval_line(shown or label, m))
    return m


def _interval_eval_due(config: RunConfig, step: int) -> bool:
    """``eval.interval`` asks for an eval after `step` (the last step's is ``eval.after``'s where that
    is on, not a second one)."""
    last = step == config.steps
    return bool(config.eval.interval) and step % config.eval.interval == 0 and not (last and config.eval.after)


def _eval_logged(logger: MetricsLogger, step: int, label: str) -> bool:
    """Whether the run's metrics hold the eval `label` at `step`: a resumed run runs an eval its
    checkpoint's step asked for only if it was cut short (records past the checkpoint were dropped)."""
    return any(r.get("kind") == "eval" and r.get("step") == step and r.get("label") == label
               for r in read_metrics(logger.path))


def _say(view: ProgressView | None, text: str) -> None:
    if view is not None:
        view.add_eval(text)
    else:
        print(text, flush=True)


def _reference_policy(config: RunConfig, policy, run_dir: Path, model_dir: Path, state: TrainState):
    """The frozen KL reference (kl_coef > 0): the policy as RL starts (after any cold start; with a
    LoRA adapter, merged into the base), kept in ``<run_dir>/reference`` so a resumed run uses the
    same one. A run resumed past step 0 with kl_coef turned on has kept none: its policy as RL started
    is model.path's weights where it ran no cold start; after a cold start those weights are gone, and
    the run is refused rather than anchored to the resumed step's."""
    if config.algorithm.kl_coef <= 0:
        return None
    ref_dir = run_dir / "reference"
    if not (ref_dir / "config.json").is_file() and state.step > 0:
        if state.extra.get("coldstart_done"):
            raise ValueError(f"algorithm.kl_coef > 0 on a run resumed at step {state.step} that kept no KL reference: "
                             f"the reference is the policy after the cold start, which this run did not keep; set "
                             f"kl_coef = 0, or start a new run with kl_coef set")
        print(f"KL reference: {model_dir} (the weights RL started from; kl_coef was 0 before step "
              f"{state.step + 1})", flush=True)
        ref_dir = model_dir
    elif not (ref_dir / "config.json").is_file():
        tmp = run_dir / ".tmp-reference"
        shutil.rmtree(tmp, ignore_errors=True)
        (merged_copy(policy.lm) if has_adapter(policy.lm) else policy.lm).save_pretrained(tmp)
        tmp.rename(ref_dir)
    ref = load_policy(config, ref_dir).to(policy.device)
    ref.requires_grad_(False)
    return ref.eval()


class _Feed:
    """Where a step's rollouts come from: `next` (the step's results and their metrics), `store`
    (what a checkpoint keeps of the schedule), `release` (the step is done: pushed, checkpointed),
    `close`. A context manager; these defaults do nothing."""

    def __enter__(self) -> "_Feed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def store(self, state: TrainState) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SyncFeed(_Feed):
    """The synchronous schedule: a step's groups start once the previous step's weights are pushed,
    all at once, and the step waits for all of them (``algorithm.max_staleness`` unset)."""

    def __init__(self, config: RunConfig, source: RolloutSource, sampler: TaskSampler, state: TrainState) -> None:
        self.config, self.source, self.sampler, self.state = config, source, sampler, state
        # Positions an asynchronous run had in flight at its checkpoint: run first.
        self.requeued = list(state.extra.pop(IN_FLIGHT, []))

    def next(self, on_result) -> tuple[list[RolloutResult], dict[str, float]]:
        rc = self.config.rollout
        n = rc.tasks_per_step
        positions, self.requeued = self.requeued[:n], self.requeued[n:]
        fresh = n - len(positions)
        positions += range(self.state.data_position, self.state.data_position + fresh)
        self.state.data_position += fresh
        task_ids = [self.sampler.take(p, 1)[0] for p in positions]
        batch = self.source.run(task_ids, rc.harnesses, rc.samples_per_task,
                                sampling=rollout_sampling(self.config, self.config.engine.temperature),
                                on_result=on_result, positions=positions)
        return batch.results, {"time/rollout_s": batch.seconds, "tasks": ",".join(task_ids)}

    def store(self, state: TrainState) -> None:
        if self.requeued:
            state.extra[IN_FLIGHT] = list(self.requeued)
        else:  # all run: a later checkpoint listing them would have a resume run them again
            state.extra.pop(IN_FLIGHT, None)


class _AsyncFeed(_Feed):
    """The asynchronous schedule (``algorithm.max_staleness = k``): a `RolloutProducer` keeps groups
    running ahead of the trainer, at most k + 1 steps' worth, and a step takes the first to finish
    within the bound."""

    def __init__(self, config: RunConfig, source: RolloutSource, sampler: TaskSampler, state: TrainState) -> None:
        rc = config.rollout
        requeued = list(state.extra.pop(IN_FLIGHT, []))
        self.state = state
        self.producer = RolloutProducer(
            source, sampler, harnesses=rc.harnesses, samples_per_task=rc.samples_per_task,
            tasks_per_step=rc.tasks_per_step, max_staleness=config.algorithm.max_staleness,
            groups_needed=(config.steps - state.step) * rc.tasks_per_step,
            sampling=rollout_sampling(config, config.engine.temperature), next_position=state.data_position,
            requeued=requeued,
        )  # fmt: skip
        self.taken = 0

    def __enter__(self) -> "_AsyncFeed":
        self.producer.__enter__()
        return self

    def next(self, on_result) -> tuple[list[RolloutResult], dict[str, float]]:
        t0 = time.monotonic()
        groups, dropped = self.producer.take(self.state.weight_version)
        self.taken = len(groups)
        self.state.data_position = self.producer.snapshot()[0]  # for the step's record; `store` keeps it exact
        results = [r for g in groups for r in g.results]
        for r in results:
            on_result(r)
        lags = token_lags(results, self.state.weight_version)
        return results, {
            "time/rollout_s": time.monotonic() - t0,  # what the trainer waited: rollouts ran meanwhile
            "async/dropped_stale_groups": float(dropped),
            "async/retried_groups": float(sum(g.retried for g in groups)),
            # Per output token: a call continued across a push holds tokens of more than one version.
            "async/staleness_mean": float(lags.mean()) if lags.size else 0.0,
            "async/staleness_max": float(lags.max(initial=0)),
            "async/calls_spanning_pushes": float(sum(c.output_versions is not None
                                                     for r in results for c in r.calls)),
            "tasks": ",".join(g.task_id for g in groups),
        }

    def store(self, state: TrainState) -> None:
        # What is in flight is not stored: a resumed run runs those tasks again (their rollouts are lost).
        state.data_position, pending = self.producer.snapshot()
        if pending:
            state.extra[IN_FLIGHT] = pending
        else:
            state.extra.pop(IN_FLIGHT, None)

    def release(self) -> None:
        self.producer.retire(self.taken)
        self.taken = 0

    def close(self) -> None:
        self.producer.stop()


# TrainState.extra key: data positions started but not trained when a checkpoint was written.
IN_FLIGHT = "in_flight_positions"


def _make_feed(config: RunConfig, source: RolloutSource, sampler: TaskSampler, state: TrainState,
               view: ProgressView | None):
    requeued = state.extra.get(IN_FLIGHT) or []
    if requeued:
        _say(view, f"resuming at step {state.step}: {len(requeued)} task group(s) were in flight at the "
                   f"checkpoint; their rollouts were not stored and those tasks run again first")
    if config.algorithm.max_staleness is None:
        return _SyncFeed(config, source, sampler, state)
    return _AsyncFeed(config, source, sampler, state)


def _one_step(config: RunConfig, trainer: Trainer, feed, state: TrainState, pusher: WeightPusher | None,
              ref_policy, view: ProgressView | None) -> dict[str, float]:
    rc = config.rollout
    total = rc.tasks_per_step * len(rc.harnesses) * rc.samples_per_task
    done = {"rollouts": 0, "not_ok": 0, "retries": 0}  # counted as results arrive: O(1) per result
    nodes_lost: set[str] = set()

    def on_result(r: RolloutResult) -> None:
        infra = infra_counts([r])
        done["rollouts"] += 1
        done["not_ok"] += r.status != "ok"
        done["retries"] += infra["retries"]
        nodes_lost.update(infra["nodes_lost"])
        if view:
            retried = f", retried {done['retries']}, nodes lost {len(nodes_lost)}" if done["retries"] else ""
            view.advance(0, note=f"step {state.step + 1}: rollouts {done['rollouts']}/{total} "
                                 f"(not ok {done['not_ok']}{retried})")

    if view:
        view.advance(0, note=f"step {state.step + 1}: rollouts 0/{total}")
    results, feed_metrics = feed.next(on_result)
    if view:
        view.advance(0, note=f"step {state.step + 1}: training on {len(results)} rollouts")
    t0 = time.monotonic()
    metrics = trainer.step(results, config, state, ref_policy)
    t_train = time.monotonic() - t0
    state.step += 1
    t1 = time.monotonic()
    # A step that made no update (nothing trainable: every group's advantages zero, say) left the
    # weights as they were: the version stays, so no push pauses the engine and no rollout in flight
    # counts a version older.
    pushed = pusher is not None and metrics["stepped"] > 0
    if pushed:
        state.weight_version += 1
        trainer.push_weights(pusher, state.weight_version)
    t_sync = time.monotonic() - t1
    record = {**rollout_metrics(results), **metrics, **feed_metrics, **(pusher.last if pushed else {})}
    record.update({"time/train_s": t_train, "time/sync_s": t_sync, "weight_version": float(state.weight_version),
                   "data_position": float(state.data_position)})
    return record


def check_evaluable(config: RunConfig, model_dir: str | Path) -> None:
    """Raise a ValueError saying why `evaluate` cannot run `config` on `model_dir`, before anything runs."""
    if config.rollout.source != "harness":
        raise ValueError("evaluation runs through harnesses: rollout.source must be 'harness'")
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json)")


def evaluate(config: RunConfig, model_dir: str | Path, out_dir: str | Path) -> dict[str, float]:
    """pass@1 per harness of the model in `model_dir` (a HF directory, e.g. a checkpoint's
    ``model/``) on ``config.eval.split``, with ``config.eval`` sampling; records go to `out_dir`."""
    check_evaluable(config, model_dir)
    model_dir = Path(model_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    engine = build_engine(config.engine, model_dir, dtype=config.model.dtype, seed=config.seed,
                          device=resolve_device(config.model.device))
    eval_tasks = load_tasks(config, config.eval.split)
    with rollout_service(config, engine, model_dir, out_dir / "records") as service:
        return run_eval(HarnessRollouts(service, eval_tasks), config, eval_tasks, scores_path=out_dir / "scores.jsonl")

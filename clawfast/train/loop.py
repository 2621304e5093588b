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
   at random in the batch) and handed to `clawfast.train.step.train_step` (tree, leaf filter, pack,
   forward under the tree mask, truncated IS, GRPO/PPO, AdamW); GRPO groups by task, or by task x
   harness in a mixed-harness run. ``updates_per_step > 1`` splits the groups into mini-batches.
4. **Sync.** The weight version is bumped and the policy's weights pushed to the engine
   (`Engine.update_weights`); every CallRecord carries the version that sampled it.
5. **Log** (`clawfast.train.metrics`), **checkpoint** every ``checkpoint.interval`` steps and at the
   end (`clawfast.train.checkpoint`), **evaluate** on the eval split when configured.

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
and data position with the saved weights, optimizer and RNG states; with a deterministic rollout
source (recorded rollouts) it produces the same checkpoints as an uninterrupted run
(tests/train/test_resume.py). Not guaranteed: identical rollouts from real harnesses across a
resume (their timing and the engine's batching are not deterministic).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from clawfast.records import RolloutResult
from clawfast.train.build import (
    build_engine,
    build_optimizer,
    build_policy,
    load_policy,
    push_weights,
    resolve_model_dir,
    rollout_sampling,
    rollout_service,
)
from clawfast.train.checkpoint import TrainState, latest_checkpoint, list_checkpoints, load_checkpoint
from clawfast.train.coldstart import run_coldstart
from clawfast.train.config import RunConfig
from clawfast.train.data import HarnessRollouts, RecordedRollouts, TaskSampler, load_tasks
from clawfast.train.distributed import make_trainer, train_sharded
from clawfast.train.metrics import MetricsLogger, ProgressView, pass_at_1_by_tag, plot_run, rollout_metrics
from clawfast.train.report import eval_line, pass_at_1, step_line


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_run_dir(config: RunConfig, resume: bool) -> tuple[Path, Path | None]:
    """Create the run directory; return it and the checkpoint to resume from (None: fresh run).
    A fresh run refuses a directory that already holds checkpoints."""
    run_dir = Path(config.run_dir)
    ckpt = latest_checkpoint(run_dir) if resume else None
    if not resume and list_checkpoints(run_dir):
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return run_dir, ckpt


def train(config: RunConfig, *, resume: bool = False, progress: bool = True) -> dict[str, object]:
    """Run (or resume) the training run `config` describes; returns a summary (eval before/after,
    steps done, run directory, curves PNG). Under ``distributed.fsdp`` every torchrun process calls
    this; rank 0 runs the loop below and the others follow it (clawfast.train.distributed)."""
    if config.distributed.fsdp:
        return train_sharded(config, lambda group: run_loop(config, resume=resume, progress=progress, group=group))
    return run_loop(config, resume=resume, progress=progress)


def run_loop(config: RunConfig, *, resume: bool, progress: bool, group=None) -> dict[str, object]:
    """The loop of `train`; `group`: rank 0's `FsdpGroup` in an FSDP run (None: one process)."""
    run_dir, ckpt = prepare_run_dir(config, resume)
    seed_everything(config.seed)
    model_dir = resolve_model_dir(config)
    policy = build_policy(config, model_dir)
    optimizer = build_optimizer(config, policy)
    state = TrainState()
    if ckpt is not None:
        state = load_checkpoint(ckpt, policy, optimizer)
    # FSDP: shards the policy over the ranks; `policy` stays rank 0's plain copy of the weights.
    trainer = make_trainer(config, policy, optimizer, state, group)
    view = ProgressView(config.steps) if progress else None
    logger = MetricsLogger(run_dir, resume_step=state.step if ckpt is not None else None)
    summary: dict[str, object] = {"run_dir": str(run_dir), "resumed_from": str(ckpt) if ckpt else None}
    try:
        if view:
            view.start()
        with contextlib.ExitStack() as stack:
            if config.rollout.source == "recorded":
                source = RecordedRollouts(config.rollout.recorded_dir)
                train_ids, eval_tasks, engine = source.task_ids, {}, None
            else:
                train_tasks = load_tasks(config, config.tasks.split, config.tasks.difficulties)
                eval_tasks = load_tasks(config, config.eval.split)
                train_ids = sorted(train_tasks)
                engine = build_engine(config.engine, model_dir, dtype=config.model.dtype, seed=config.seed,
                                      lm=policy.lm, weight_version=state.weight_version)
                logs_dir = run_dir / "logs" if config.rollout.keep_logs else None
                service = stack.enter_context(rollout_service(config, engine, model_dir, run_dir / "records",
                                                              logs_dir=logs_dir))
                source = HarnessRollouts(service, {**eval_tasks, **train_tasks})
            sampler = TaskSampler(train_ids, config.seed)
            fresh = ckpt is None
            if fresh and config.eval.before and eval_tasks:
                summary["eval_before"] = _evaluate(source, config, eval_tasks, logger, view, 0, "before",
                                                   "eval before training")
            if not state.extra.get("coldstart_done") and config.coldstart.enabled:
                if view:
                    view.set_phase("cold start: capturing demonstrations through the harness")
                summary["coldstart"] = run_coldstart(config, policy, model_dir, run_dir, logger=logger, view=view)
                state.extra["coldstart_done"] = True
                trainer.optimizer = build_optimizer(config, policy)  # fresh AdamW moments for RL
                if engine is not None and config.engine.sync_weights:
                    state.weight_version += 1
                    push_weights(engine, policy, state.weight_version)
                trainer.save_checkpoint(run_dir, state, tokenizer_dir=model_dir, keep=config.checkpoint.keep)
                if config.eval.after_coldstart and eval_tasks:
                    summary["eval_coldstart"] = _evaluate(source, config, eval_tasks, logger, view, 0, "coldstart",
                                                          "eval after cold start", shown="after cold start")
            ref_policy = trainer.share_reference(_reference_policy(config, policy, run_dir, model_dir))
            done_here = 0
            while state.step < config.steps:
                record = _one_step(config, trainer, source, sampler, state, engine, ref_policy, view)
                logger.log("train", state.step, record)
                if view:
                    view.add_step({"step": state.step, **record})
                else:
                    print(step_line(state.step, record), flush=True)
                done_here += 1
                last = state.step == config.steps
                if state.step % config.checkpoint.interval == 0 or last:
                    trainer.save_checkpoint(run_dir, state, tokenizer_dir=model_dir, keep=config.checkpoint.keep)
                if eval_tasks and not last and config.eval.interval and state.step % config.eval.interval == 0:
                    _evaluate(source, config, eval_tasks, logger, view, state.step, f"step {state.step}", None)
            # A resumed run that had already finished does not evaluate again.
            if state.step == config.steps and (done_here or fresh) and config.eval.after and eval_tasks:
                summary["eval_after"] = _evaluate(source, config, eval_tasks, logger, view, state.step, "after",
                                                  "eval after training")
    finally:
        if view:
            view.stop()
        logger.close()
    summary["steps"] = state.step
    try:
        summary["curves"] = str(plot_run(run_dir))
    except (ValueError, FileNotFoundError):
        summary["curves"] = None
    return summary


def run_eval(source, config: RunConfig, eval_tasks: dict) -> dict[str, float]:
    """pass@1 (overall, per harness, per difficulty) of `eval_tasks` at the eval's sampling."""
    batch = source.run(sorted(eval_tasks), config.rollout.harnesses, config.eval.samples_per_task,
                       sampling=rollout_sampling(config, config.eval.temperature))
    metrics = {**pass_at_1(batch.results), **pass_at_1_by_tag(batch.results, eval_tasks, "difficulty")}
    metrics["time/eval_s"] = batch.seconds
    return metrics


def _evaluate(source, config: RunConfig, eval_tasks: dict, logger: MetricsLogger, view: ProgressView | None,
              step: int, label: str, phase: str | None, *, shown: str | None = None) -> dict[str, float]:
    """Evaluate, log the record under `label` at `step`, show `phase` while it runs and the result line
    (named `shown`, default `label`) after; returns the metrics."""
    if view and phase:
        view.set_phase(phase)
    m = run_eval(source, config, eval_tasks)
    logger.log("eval", step, {**m, "label": label})
    _say(view, eval_line(shown or label, m))
    return m


def _say(view: ProgressView | None, text: str) -> None:
    if view is not None:
        view.add_eval(text)
    else:
        print(text, flush=True)


def _reference_policy(config: RunConfig, policy, run_dir: Path, model_dir: Path):
    """The frozen KL reference (kl_coef > 0): the policy as RL starts (after any cold start), kept
    in ``<run_dir>/reference`` so a resumed run uses the same one."""
    if config.algorithm.kl_coef <= 0:
        return None
    ref_dir = run_dir / "reference"
    if not (ref_dir / "config.json").is_file():
        tmp = run_dir / ".tmp-reference"
        shutil.rmtree(tmp, ignore_errors=True)
        policy.lm.save_pretrained(tmp)
        tmp.rename(ref_dir)
    ref = load_policy(config, ref_dir)
    ref.requires_grad_(False)
    return ref.eval()


def _one_step(config: RunConfig, trainer, source, sampler: TaskSampler, state: TrainState, engine,
              ref_policy, view: ProgressView | None) -> dict[str, float]:
    rc = config.rollout
    task_ids = sampler.take(state.data_position, rc.tasks_per_step)
    total = len(task_ids) * len(rc.harnesses) * rc.samples_per_task
    done = [0, 0]

    def on_result(r: RolloutResult) -> None:
        done[0] += 1
        done[1] += r.status != "ok"
        if view:
            view.set_phase(f"step {state.step + 1}: rollouts {done[0]}/{total} (not ok {done[1]})")

    if view:
        view.set_phase(f"step {state.step + 1}: rollouts 0/{total}")
    batch = source.run(task_ids, rc.harnesses, rc.samples_per_task,
                       sampling=rollout_sampling(config, config.engine.temperature), on_result=on_result)
    if view:
        view.set_phase(f"step {state.step + 1}: training on {len(batch.results)} rollouts")
    t0 = time.monotonic()
    metrics = trainer.step(batch.results, config, state, ref_policy)
    t_train = time.monotonic() - t0
    state.step += 1
    state.data_position += rc.tasks_per_step
    t1 = time.monotonic()
    if engine is not None and config.engine.sync_weights:
        state.weight_version += 1
        push_weights(engine, trainer.current_policy(), state.weight_version)
    t_sync = time.monotonic() - t1
    record = {**rollout_metrics(batch.results), **metrics}
    record.update({"time/rollout_s": batch.seconds, "time/train_s": t_train, "time/sync_s": t_sync,
                   "weight_version": float(state.weight_version), "data_position": float(state.data_position),
                   "tasks": ",".join(task_ids)})
    return record


def evaluate(config: RunConfig, model_dir: str | Path, out_dir: str | Path) -> dict[str, float]:
    """pass@1 per harness of the model in `model_dir` (a HF directory, e.g. a checkpoint's
    ``model/``) on ``config.eval.split``, with ``config.eval`` sampling; records go to `out_dir`."""
    if config.rollout.source != "harness":
        raise ValueError("evaluation runs through harnesses: rollout.source must be 'harness'")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    engine = build_engine(config.engine, model_dir, dtype=config.model.dtype, seed=config.seed)
    eval_tasks = load_tasks(config, config.eval.split)
    with rollout_service(config, engine, model_dir, out_dir / "records") as service:
        return run_eval(HarnessRollouts(service, eval_tasks), config, eval_tasks)

"""The RL loop: rollouts through real harnesses behind the proxy, a training step, a weight push.

    train(load_config("examples/quickstart.toml"), resume=False)

Per step:

1. **Data.** `TaskSampler` takes ``tasks_per_step`` task ids at the run's *data position*: epoch e
   of the training split is a permutation seeded by ``(seed, e)``, so the tasks of a step depend
   only on the seed and the position (which the checkpoint stores), never on what ran before.
2. **Rollouts.** task x harness x ``samples_per_task`` specs run through `RolloutScheduler`
   (`HarnessRollouts`: a fresh sandbox per rollout, the harness talking to the in-process proxy,
   which serves the engine's current weights and records every call token for token), or are read
   from recorded rollout files (`RecordedRollouts`: offline data and fast tests of the loop).
3. **Train.** The step's rollouts are shuffled (seeded by ``(seed, step)``: harnesses and tasks mix
   at random in the batch) and handed to `clawfast.train.step.train_step` (tree, leaf filter, pack,
   forward under the tree mask, truncated IS, GRPO/PPO, AdamW); GRPO groups by task, or by task x
   harness in a mixed-harness run. ``updates_per_step > 1`` splits the groups into mini-batches.
4. **Sync.** The weight version is bumped and the policy's weights pushed to the engine
   (`Engine.update_weights`); every CallRecord carries the version that sampled it.
5. **Log** (`clawfast.train.metrics`), **checkpoint** every ``checkpoint.interval`` steps and at the
   end (`clawfast.train.checkpoint`), **evaluate** on the eval split when configured.

Distributed (the ``[distributed]`` section; clawfast.train.distributed): ``rollouts = "ray"`` runs
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

import asyncio
import copy
import json
import random
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from clawfast.records import RolloutResult, read_rollouts
from clawfast.train.checkpoint import TrainState, latest_checkpoint, list_checkpoints, load_checkpoint
from clawfast.train.config import RunConfig
from clawfast.train.metrics import MetricsLogger, ProgressView, pass_at_1_by_tag, plot_run, rollout_metrics

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------
# Data order


class TaskSampler:
    """Deterministic task order: position p is item ``p % n`` of epoch ``p // n``, each epoch a
    permutation of the (sorted) task ids drawn from ``numpy.random.default_rng([seed, epoch])``."""

    def __init__(self, task_ids: Sequence[str], seed: int) -> None:
        if not task_ids:
            raise ValueError("no training tasks (check tasks.suite, tasks.split and tasks.difficulties)")
        self.ids = sorted(task_ids)
        self.seed = int(seed)

    def epoch_order(self, epoch: int) -> list[str]:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.ids))
        return [self.ids[i] for i in perm]

    def take(self, position: int, n: int) -> list[str]:
        """The `n` task ids at data position `position` (an epoch boundary may fall inside)."""
        out = []
        for p in range(position, position + n):
            epoch, index = divmod(p, len(self.ids))
            out.append(self.epoch_order(epoch)[index])
        return out


# ----------------------------------------------------------------------------------------------
# Model and engine


def resolve_model_dir(config: RunConfig) -> Path:
    """The Hugging Face directory the run starts from ("embedded": built on first use)."""
    if config.model.path == "embedded":
        from clawfast.embedded import ensure_embedded_model

        return ensure_embedded_model()
    path = Path(config.model.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
    return path


def build_policy(config: RunConfig, model_dir: Path):
    from clawfast.train.policy import Policy

    policy = Policy.from_pretrained(model_dir, dtype=_DTYPES[config.model.dtype], attention=config.model.attention,
                                    value_head=config.algorithm.name == "ppo")
    if config.model.gradient_checkpointing:
        policy.lm.gradient_checkpointing_enable()
    return policy


def build_optimizer(config: RunConfig, policy: torch.nn.Module) -> torch.optim.Optimizer:
    o = config.optim
    return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr, betas=tuple(o.betas),
                             eps=o.eps, weight_decay=o.weight_decay)


def build_engine(config: RunConfig, policy, model_dir: Path, weight_version: int):
    """The engine serving `policy`'s current weights at `weight_version`."""
    kind = config.engine.kind
    if kind == "torch":
        from clawfast.engines.torch_engine import TorchEngine

        engine = TorchEngine(copy.deepcopy(policy.lm).eval(), max_batch=config.engine.max_batch, seed=config.seed)
        engine.weight_version = weight_version
        return engine
    if kind == "vllm":
        from clawfast.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(str(model_dir), dtype=config.model.dtype, max_model_len=config.engine.max_model_len,
                            seed=config.seed)
        engine.update_weights(policy.lm.state_dict(), weight_version)
        return engine
    from clawfast.engines.remote import RemoteEngine

    return RemoteEngine(config.engine.url, weight_version=weight_version)


def push_weights(engine, policy, version: int) -> None:
    """Send the policy's weights to the engine under `version` (every later call records it)."""
    engine.update_weights({k: v.detach() for k, v in policy.lm.state_dict().items()}, version)


# ----------------------------------------------------------------------------------------------
# Rollout sources


@dataclass(frozen=True)
class Batch:
    """What a source returns for one step: the results, in spec order, and the seconds it took."""

    results: list[RolloutResult]
    seconds: float


class RecordedRollouts:
    """Rollouts read from a directory of .cfr files; spec (task, harness, i) gets the i-th
    (cyclically) recorded rollout of that task and harness, ordered by (sample index, rollout id).
    Deterministic, no engine: offline training and fast tests of the loop."""

    def __init__(self, directory: str | Path) -> None:
        self.by_key: dict[tuple[str, str], list[RolloutResult]] = defaultdict(list)
        for r in read_rollouts(directory):
            self.by_key[(r.task_id, r.harness)].append(r)
        if not self.by_key:
            raise ValueError(f"{directory}: no recorded rollouts (.cfr files)")
        for rs in self.by_key.values():
            rs.sort(key=lambda r: (r.sample_index, r.rollout_id))

    @property
    def task_ids(self) -> list[str]:
        return sorted({t for t, _ in self.by_key})

    def __enter__(self) -> "RecordedRollouts":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def run(self, task_ids: Sequence[str], harnesses: Sequence[str], k: int, *, on_result=None,
            temperature: float | None = None) -> Batch:
        t0 = time.monotonic()
        out = []
        for task_id in task_ids:
            for h in harnesses:
                pool = self.by_key.get((task_id, h))
                if not pool:
                    raise ValueError(f"no recorded rollout of task {task_id!r} by harness {h!r}")
                for i in range(k):
                    out.append(copy.deepcopy(pool[i % len(pool)]))
                    if on_result is not None:
                        on_result(out[-1])
        return Batch(out, time.monotonic() - t0)


class HarnessRollouts:
    """The real thing: the proxy (in this process, on a loopback port) serving `engine`, a sandbox
    backend, harness adapters and the verifier runner, driven by `RolloutScheduler`; or, under
    ``distributed.rollouts = "ray"``, the same worker in Ray actors on the cluster's nodes
    (`clawfast.train.distributed.RayRollouts`; the proxy then listens on all interfaces).

    Use as a context manager (which closes the engine on exit); `run(task_ids, harnesses, k)`
    returns one result per spec. Records are written to ``<records_dir>/<rollout_id>.cfr`` as calls
    are answered."""

    def __init__(self, config: RunConfig, engine, renderer, tasks: dict, records_dir: Path, logs_dir: Path | None):
        self.config = config
        self.engine = engine
        self.renderer = renderer
        self.tasks = tasks
        self.records_dir = records_dir
        self.logs_dir = logs_dir
        self.ray = None  # clawfast.train.distributed.RayRollouts under distributed.rollouts = "ray"
        self._stack = None

    def __enter__(self) -> "HarnessRollouts":
        import contextlib

        from clawfast.proxy.core import ProxyConfig, ProxyCore
        from clawfast.proxy.rollouts import RolloutRegistry
        from clawfast.proxy.server import ProxyApp, ProxyServer
        from clawfast.rollout import RolloutConfig, RolloutWorker
        from clawfast.sandbox import create_backend
        from clawfast.tasks.sandbox_runner import SandboxRunner

        cfg, rc = self.config, self.config.rollout
        stack = contextlib.ExitStack()
        try:
            harnesses = {}
            for name in rc.harnesses:
                harnesses[name] = make_harness(name, cfg)
                harnesses[name].installation  # install (or find) before any clock starts
            self.proxy_config = ProxyConfig(max_tokens_cap=cfg.engine.max_tokens, default_max_tokens=cfg.engine.max_tokens,
                                            max_model_len=cfg.engine.max_model_len, temperature=cfg.engine.temperature,
                                            max_calls_per_rollout=rc.max_model_calls)
            registry = RolloutRegistry(self.records_dir)
            app = ProxyApp(ProxyCore(self.engine, self.renderer, self.proxy_config), registry, model_name="policy")
            on_ray = cfg.distributed.rollouts == "ray"
            # Ray: the actors' relays on other nodes reach the proxy through this node's address.
            self.server = stack.enter_context(ProxyServer(app, host="0.0.0.0" if on_ray else "127.0.0.1"))
            if on_ray:
                from clawfast.train.distributed import RayRollouts

                self.ray = stack.enter_context(RayRollouts(cfg, registry, self.server.port, self.logs_dir))
            else:
                options = {"allow_unsafe": True} if rc.sandbox == "local" else {}
                backend = create_backend(rc.sandbox, **options)
                stack.callback(backend.close)
                verifier_runner = (None if rc.sandbox == "local"
                                   else stack.enter_context(SandboxRunner(create_backend(rc.sandbox))))
                self.worker = RolloutWorker(
                    registry, backend, harnesses,
                    config=RolloutConfig(model="policy", timeout_s=rc.timeout_s, logs_dir=self.logs_dir),
                    verifier_runner=verifier_runner,
                )  # fmt: skip
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            # The engine's worker lives on the proxy's loop: close it there, before the loop ends.
            if self.server.loop is not None and self.server.loop.is_running():
                asyncio.run_coroutine_threadsafe(self.engine.close(), self.server.loop).result(timeout=60)
            self._stack.close()
            self._stack = None

    def run(self, task_ids: Sequence[str], harnesses: Sequence[str], k: int, *,
            on_result: Callable[[RolloutResult], None] | None = None, temperature: float | None = None) -> Batch:
        """Run every task x harness x k; `temperature` overrides the sampling temperature (eval)."""
        from clawfast.rollout import RolloutScheduler, make_specs

        specs = make_specs([self.tasks[t] for t in task_ids], harnesses, k)
        saved = self.proxy_config.temperature
        if temperature is not None:
            # The proxy reads its config per call; no call is in flight between steps.
            self.proxy_config.temperature = temperature
        t0 = time.monotonic()
        try:
            if self.ray is not None:
                results = self.ray.run(specs, on_result=on_result)
            else:
                scheduler = RolloutScheduler(self.worker, concurrency=self.config.rollout.concurrency,
                                             on_result=on_result)
                results = asyncio.run(scheduler.run(specs))
        finally:
            self.proxy_config.temperature = saved
        return Batch(results, time.monotonic() - t0)


def make_harness(name: str, config: RunConfig):
    """The adapter for `name` with the run's limits (and mini-swe-agent's instance template)."""
    from clawfast.harness import get_harness

    return get_harness(name, **harness_options(name, config))


def harness_options(name: str, config: RunConfig) -> dict:
    """`get_harness` keyword arguments for `name` in this run (plain data: Ray actors get them too)."""
    rc = config.rollout
    options: dict = {"timeout_s": rc.timeout_s, "max_steps": rc.harness_max_steps}
    if name == "mini-swe-agent" and rc.mini_instance_template is not None:
        options["instance_template"] = rc.mini_instance_template
    return options


def load_tasks(config: RunConfig, split: str, difficulties: Sequence[str] = ()) -> dict:
    """Task id -> Task of the configured suite's `split` (filtered by difficulty tags)."""
    from clawfast.tasks import clawbench_mini, load_suite

    if config.tasks.suite == "clawbench-mini":  # the one built-in suite with a generator seed
        tasks = [t for t in clawbench_mini(config.tasks.suite_seed) if t.split == split]
    else:
        tasks = load_suite(config.tasks.suite, split)
    if difficulties:
        tasks = [t for t in tasks if t.tags.get("difficulty") in difficulties]
    return {t.id: t for t in tasks}


# ----------------------------------------------------------------------------------------------
# Evaluation


def pass_at_1(results: Sequence[RolloutResult]) -> dict[str, float]:
    """pass@1 overall and per harness: the share of attempts whose reward is 1 (all-or-nothing
    verifiers; with k samples per task this is the unbiased pass@1 estimate), plus counts."""
    out = rollout_metrics(results)
    return {k: v for k, v in out.items() if k.startswith(("pass@1", "reward/", "status/")) or k == "rollouts"}


def run_eval(source, config: RunConfig, eval_tasks: dict) -> dict[str, float]:
    batch = source.run(sorted(eval_tasks), config.rollout.harnesses, config.eval.samples_per_task,
                       temperature=config.eval.temperature)
    metrics = {**pass_at_1(batch.results), **pass_at_1_by_tag(batch.results, eval_tasks, "difficulty")}
    metrics["time/eval_s"] = batch.seconds
    return metrics


def breakdown(metrics: dict[str, float], prefix: str) -> str:
    """``name value`` pairs of the metrics named ``{prefix}/name`` (per harness, per difficulty)."""
    return ", ".join(f"{k[len(prefix) + 1:]} {v:.3f}" for k, v in sorted(metrics.items()) if k.startswith(prefix + "/"))


def eval_line(label: str, metrics: dict[str, float]) -> str:
    """The one-line report of an eval: overall pass@1, then per harness and per difficulty."""
    per = breakdown(metrics, "pass@1")
    levels = breakdown(metrics, "pass@1_difficulty")
    return (f"eval {label}: pass@1 {metrics.get('pass@1', 0.0):.3f} ({per}{'; ' + levels if levels else ''}) "
            f"over {int(metrics.get('rollouts', 0))} rollouts")


def _step_line(step: int, record: dict[str, float]) -> str:
    """One line per step for runs without the live display (logs, CI, --no-progress)."""
    return (f"step {step}: pass@1 {record.get('pass@1', 0.0):.3f} ({breakdown(record, 'pass@1')}) "
            f"loss {record.get('loss', float('nan')):.4f} "
            f"over {int(record.get('rollouts', 0))} rollouts; rollout {record.get('time/rollout_s', 0.0):.1f} s, "
            f"train {record.get('time/train_s', 0.0):.1f} s")


# ----------------------------------------------------------------------------------------------
# The loop


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _chunks(results: list[RolloutResult], group_by: str, n: int) -> list[list[RolloutResult]]:
    """Split whole GRPO groups into `n` mini-batches (round-robin over groups in batch order)."""
    keys: dict = {}
    for r in results:
        key = r.task_id if group_by == "task" else (r.task_id, r.harness)
        keys.setdefault(key, []).append(r)
    parts: list[list[RolloutResult]] = [[] for _ in range(min(n, len(keys)) or 1)]
    for i, group in enumerate(keys.values()):
        parts[i % len(parts)].extend(group)
    return [p for p in parts if p]


def _mean_metrics(all_metrics: list[dict[str, float]]) -> dict[str, float]:
    if len(all_metrics) == 1:
        return all_metrics[0]
    keys = {k for m in all_metrics for k in m}
    return {k: float(np.mean([m[k] for m in all_metrics if k in m])) for k in sorted(keys)}


def training_step(policy, optimizer, results: list[RolloutResult], config: RunConfig, state: TrainState,
                  ref_policy=None) -> dict[str, float]:
    """Shuffle the step's rollouts (seeded by seed and step) and run the trainer on them."""
    from clawfast.train.step import train_step

    order = np.random.default_rng([config.seed, state.step, 7]).permutation(len(results))
    shuffled = [results[i] for i in order]
    step_config = config.step_config()
    metrics = [
        train_step(policy, optimizer, part, None, step_config, weight_version=state.weight_version,
                   ref_policy=ref_policy)
        for part in _chunks(shuffled, step_config.group_by, config.optim.updates_per_step)
    ]
    return _mean_metrics(metrics)


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
        from clawfast.train.distributed import train_sharded

        return train_sharded(config, resume=resume, progress=progress)
    return _train(config, resume=resume, progress=progress)


def _train(config: RunConfig, *, resume: bool, progress: bool, group=None) -> dict[str, object]:
    """The loop of `train`; `group`: rank 0's `FsdpGroup` in an FSDP run (None: one process)."""
    from transformers import AutoTokenizer

    from clawfast.proxy.render import ChatRenderer
    from clawfast.train.distributed import make_trainer

    run_dir, ckpt = prepare_run_dir(config, resume)
    _seed_everything(config.seed)
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
    recorded = config.rollout.source == "recorded"
    try:
        if view:
            view.start()
        if recorded:
            source_cm = RecordedRollouts(config.rollout.recorded_dir)
            train_ids = source_cm.task_ids
            eval_tasks: dict = {}
            engine = None
        else:
            train_tasks = load_tasks(config, config.tasks.split, config.tasks.difficulties)
            eval_tasks = load_tasks(config, config.eval.split)
            train_ids = sorted(train_tasks)
            engine = build_engine(config, policy, model_dir, state.weight_version)
            renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
            source_cm = HarnessRollouts(config, engine, renderer, {**eval_tasks, **train_tasks},
                                        run_dir / "records", run_dir / "logs" if config.rollout.keep_logs else None)
        sampler = TaskSampler(train_ids, config.seed)
        with source_cm as source:
            fresh = ckpt is None
            if fresh and config.eval.before and eval_tasks:
                summary["eval_before"] = _evaluate(source, config, eval_tasks, logger, view, 0, "before",
                                                   "eval before training")
            if not state.extra.get("coldstart_done") and config.coldstart.enabled:
                from clawfast.train.coldstart import run_coldstart

                if view:
                    view.set_phase("cold start: capturing demonstrations through the harness")
                cs = run_coldstart(config, policy, model_dir, run_dir, logger=logger, view=view)
                summary["coldstart"] = cs
                state.extra["coldstart_done"] = True
                trainer.optimizer = build_optimizer(config, policy)  # fresh AdamW moments for RL
                state.weight_version += 1
                if engine is not None:
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
                    print(_step_line(state.step, record), flush=True)
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
    from clawfast.train.policy import Policy

    ref_dir = run_dir / "reference"
    if not (ref_dir / "config.json").is_file():
        tmp = run_dir / ".tmp-reference"
        shutil.rmtree(tmp, ignore_errors=True)
        policy.lm.save_pretrained(tmp)
        tmp.rename(ref_dir)
    ref = Policy.from_pretrained(ref_dir, dtype=_DTYPES[config.model.dtype], attention=config.model.attention)
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
    batch = source.run(task_ids, rc.harnesses, rc.samples_per_task, on_result=on_result)
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
    from transformers import AutoTokenizer

    from clawfast.proxy.render import ChatRenderer
    from clawfast.train.policy import Policy

    if config.rollout.source != "harness":
        raise ValueError("evaluation runs through harnesses: rollout.source must be 'harness'")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _seed_everything(config.seed)
    policy = Policy.from_pretrained(model_dir, dtype=_DTYPES[config.model.dtype], attention=config.model.attention)
    engine = build_engine(config, policy, model_dir, 0)
    eval_tasks = load_tasks(config, config.eval.split)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    with HarnessRollouts(config, engine, renderer, eval_tasks, out_dir / "records", None) as source:
        return run_eval(source, config, eval_tasks)

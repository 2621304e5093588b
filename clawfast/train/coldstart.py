"""Cold start: supervised warm-up on demonstrations captured through the real harness.

1. **Demonstrations.** The training-split tasks of the built-in suite, for each seed in
   ``coldstart.suite_seeds`` (the generator draws new files, words and numbers per seed; task ids and
   templates stay), minus any task whose instruction equals an instruction of the held-out eval
   split. Eval-split ids are never demonstrated.
2. **Capture.** Each demonstration runs through the real harness in a real sandbox behind the real
   proxy, whose engine is the scripted one playing the task's oracle as that harness's own tool
   calls (`clawfast.rollout.oracle.OracleResponder`, built on the adapter's `scripted_turns`). The
   proxy records every call token for token, exactly as in RL; only rollouts the verifier scored
   1.0 are kept.
3. **SFT.** The captured calls become prefix trees as an RL step builds them (calls of the thread
   kinds in ``algorithm.train_threads`` trained, by the structure `clawfast.threads` reads, not by
   the proxy's hints; a demonstration whose kept path is longer than a micro-batch left out and
   counted), are packed (`clawfast.pack`: shared prompts once) and the policy is trained on exactly
   those tokens: the mean negative log-likelihood of
   every trainable (model-generated) target of the packed trees, under the tree mask
   (`Policy.run`), AdamW with a warm-up over the first tenth of the updates and a cosine decay over
   all of them, one update per ``batch_rollouts`` demonstrations, ``epochs`` passes, in train mode
   with the model's dropout (``model.lora.dropout``: these passes only; RL runs without dropout).

What is scripted is only the choice of each output (the oracle); tokenizer, chat template, protocol,
harness, sandbox and verifier are the real ones, so the tokens trained on are the tokens the policy
will have to produce through that harness. Not guaranteed: that the policy generalises from the
training templates to held-out tasks (measure it: `clawfast eval`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from clawfast.records import RolloutResult
from clawfast.threads import KINDS, reconstruct, with_kinds
from clawfast.tree import PrefixTree, build_tree
from clawfast.rollout import ORACLE, RolloutSpec
from clawfast.train.build import rollout_service
from clawfast.train.config import RunConfig
from clawfast.train.report import nll_by_epoch


def demonstration_tasks(config: RunConfig) -> list:
    """The tasks to demonstrate (see the module docstring), in a deterministic order."""
    from clawfast.tasks import BUILTIN_SUITES, load_suite

    cs = config.coldstart
    held_out = {t.instruction for t in load_suite(config.tasks.suite, config.eval.split, seed=config.tasks.suite_seed)}
    # A built-in suite is drawn anew per seed; a task directory has no generator seed: its split, once.
    seeds = cs.suite_seeds if config.tasks.suite in BUILTIN_SUITES else (0,)
    pools = [load_suite(config.tasks.suite, config.tasks.split, seed=seed) for seed in seeds]
    seen: set[str] = set()
    out = []
    for pool in pools:
        for task in pool:
            if cs.difficulties and task.tags.get("difficulty") not in cs.difficulties:
                continue
            if cs.categories and task.tags.get("category") not in cs.categories:
                continue
            if task.instruction in held_out or task.instruction in seen or not task.oracle:
                continue
            seen.add(task.instruction)
            out.append(task)
    return out


def capture_demonstrations(config: RunConfig, model_dir: Path, tasks: list, records_dir: Path,
                           harness_name: str, on_result=None) -> list[RolloutResult]:
    """Run every task once through `harness_name` with its oracle scripted; returns every rollout
    (`on_result` gets each as it ends)."""
    longest = max(len(t.oracle) for t in tasks)
    single = config.model_copy(update={"rollout": config.rollout.model_copy(update={"harnesses": (harness_name,)})})
    service = rollout_service(single, ORACLE, model_dir, records_dir, concurrency=config.coldstart.concurrency,
                              max_turns=max(config.rollout.harness_max_turns, longest + 2), oracle_tasks=tasks,
                              on_ray=False)
    with service:
        return service.run([RolloutSpec(t, harness_name, 0) for t in tasks], on_result=on_result)


def demonstration_tree(demo: RolloutResult, train_threads: Sequence[str] = ("main",)) -> PrefixTree:
    """A demonstration's prefix tree as an RL step builds a rollout's (`clawfast.train.prepare`): its
    calls trained or excluded by the thread kinds the rollout's structure gives them
    (`clawfast.threads`), so a side call the proxy had no hint for is not trained as main."""
    excluded = frozenset(KINDS) - frozenset(train_threads)
    return build_tree(with_kinds(demo.calls, reconstruct(demo.calls)), exclude_tags=excluded)


def sft_epoch(policy, optimizer: torch.optim.Optimizer, trees: list[PrefixTree], *,
              micro_batch_tokens: int, batch_rollouts: int, rng: np.random.Generator,
              max_grad_norm: float | None = 1.0, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
              on_update=None) -> dict[str, float]:
    """One pass of masked NLL over the demonstrations' generated tokens (`trees`: their
    `demonstration_tree`s); returns mean loss and counts (`on_update(loss)` after each update).

    Each update: the trees of `batch_rollouts` demonstrations, packed into micro-batches of at most
    `micro_batch_tokens` rows; loss = sum over every trainable target of -log p / number of targets
    (gradients accumulate over the micro-batches, one optimizer step per update)."""
    from clawfast.pack import pack

    order = rng.permutation(len(trees))
    losses, targets, tokens = [], 0, 0
    # Supervised passes keep the model's dropout (model.lora.dropout, attention_dropout); the RL steps that
    # follow run without any (`clawfast.train.policy.rl_mode`), where PPO compares passes.
    policy.train()
    for start in range(0, len(order), batch_rollouts):
        batches = pack([trees[i] for i in order[start:start + batch_rollouts]], micro_batch_tokens)
        total = float(sum(b.loss_mask.sum() for b in batches))
        if total == 0:
            continue
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for b in batches:
            out = policy.run(b)
            mask = torch.as_tensor(b.loss_mask * b.weight, dtype=out.logprobs.dtype, device=out.logprobs.device)
            loss = -(out.logprobs * mask).sum() / total
            loss.backward()
            step_loss += float(loss.detach())
            tokens += int(b.num_tokens)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        targets += int(total)
        if on_update is not None:
            on_update(step_loss)
    return {"nll": float(np.mean(losses)) if losses else float("nan"), "targets": float(targets),
            "tokens_packed": float(tokens), "updates": float(len(losses))}


def warmup_cosine(optimizer: torch.optim.Optimizer, total_updates: int, warmup_frac: float = 0.1):
    """`lr` ramps up linearly over the first `warmup_frac` of the updates (at least one), then decays
    to 0 along a half cosine by the last update, so that a small model trained for many epochs ends on
    small steps instead of a noisy full-rate one. The ramp is a fraction, not a count: a fixed ramp
    of 10 updates kept a 9-update cold start below its peak lr throughout."""
    warmup = max(1, round(warmup_frac * total_updates))

    def factor(k: int) -> float:
        return min(1.0, (k + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * min(k, total_updates) / max(total_updates, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run_coldstart(config: RunConfig, policy, model_dir: Path, run_dir: Path, *, logger=None, view=None) -> dict[str, Any]:
    """Capture demonstrations through every configured harness, then SFT `policy` on them (in place)."""
    cs = config.coldstart
    tasks = demonstration_tasks(config)
    if not tasks:
        raise ValueError("coldstart: no demonstration tasks (check coldstart.suite_seeds and difficulties)")
    t0 = time.monotonic()
    demos: list[RolloutResult] = []
    captured = 0
    if view is not None:
        view.begin("cold start: demonstrations through the harness", len(tasks) * len(config.rollout.harnesses),
                   "rollouts")
    solved = [0]

    def on_result(r: RolloutResult) -> None:
        solved[0] += r.status == "ok" and r.reward >= 1.0
        if view is not None:
            view.advance(note=f"solved {solved[0]}")

    for name in config.rollout.harnesses:
        results = capture_demonstrations(config, model_dir, tasks, Path(run_dir) / "coldstart-records", name,
                                         on_result)
        captured += len(results)
        demos += [r for r in results if r.status == "ok" and r.reward >= 1.0 and r.calls]
    t_capture = time.monotonic() - t0
    if view is not None:
        view.end()
    if not demos:
        raise RuntimeError(f"coldstart: none of the {captured} demonstrations solved its task; "
                           f"run `clawfast harness check {config.rollout.harnesses[0]}` to see why")
    threads = config.algorithm.train_threads
    # A path longer than a micro-batch cannot be trained (a path is never split; pack would raise): such a
    # demonstration is left out and counted, as an RL step drops such a rollout.
    trees = [t for t in (demonstration_tree(d, threads) for d in demos) if t.longest_kept_path <= cs.micro_batch_tokens]
    if not trees:
        raise RuntimeError(f"coldstart: every solved demonstration has a path longer than "
                           f"coldstart.micro_batch_tokens = {cs.micro_batch_tokens}; raise it")
    summary: dict[str, Any] = {"tasks": len(tasks), "captured": captured, "kept": len(demos),
                               "dropped_too_long": len(demos) - len(trees), "time_capture_s": t_capture}
    updates_per_epoch = -(-len(trees) // cs.batch_rollouts)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cs.lr, weight_decay=0.0)
    scheduler = warmup_cosine(optimizer, cs.epochs * updates_per_epoch)
    rng = np.random.default_rng([config.seed, 17])
    if view is not None:
        view.begin(f"cold start: SFT on {len(trees)} demonstrations, {cs.epochs} epochs", cs.epochs * updates_per_epoch,
                   "updates")
    t1 = time.monotonic()
    for epoch in range(cs.epochs):
        def on_update(loss: float, epoch: int = epoch) -> None:
            if view is not None:
                view.advance(note=f"epoch {epoch + 1}: nll {loss:.3f}")

        m = sft_epoch(policy, optimizer, trees, micro_batch_tokens=cs.micro_batch_tokens,
                      batch_rollouts=cs.batch_rollouts, rng=rng, scheduler=scheduler, on_update=on_update)
        m["time_s"] = time.monotonic() - t1
        if logger is not None:
            logger.log("coldstart", 0, {"epoch": epoch + 1, **m, **({"demos": float(len(trees))} if epoch == 0 else {})})
        summary[f"nll_epoch_{epoch + 1}"] = m["nll"]
    if view is not None:
        view.end(note="nll by epoch: " + nll_by_epoch(summary)[1])
    summary["time_sft_s"] = time.monotonic() - t1
    return summary

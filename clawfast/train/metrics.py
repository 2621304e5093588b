"""A run's metrics, computed from its rollouts (where they go: `clawfast.train.metrics_log`).

Metric names (train): ``reward/mean``, ``reward/<harness>``, ``pass@1/<harness>`` (share of
rollouts with reward 1), ``status/<status>`` (counts), ``verifier_errors`` (rollouts whose verifier
could not score them), the trainer's metrics (``loss``,
``entropy``, ``kl_ref``, ``clip_frac``, the ``is_*`` / ``mismatch_*`` statistics, token counts
``tokens_per_call_flat`` / ``tokens_packed`` / ``dedup_ratio_call``, ...), and timings
``time/rollout_s``, ``time/train_s``, ``time/sync_s``. An eval adds ``pass@1_<tag>/<value>`` and
``reward_<tag>/<value>`` per difficulty, per category and per task (tag ``task``), and
``subscore/<name>``, the mean of each named sub-score of a graded verifier (`subscore_means`), per
suite too (``pass@1_suite/<suite>``), and what its scores rest on (`score_counts`): ``judged``,
``not_judged``, ``judge_errors``, ``unscored``, ``rollouts_all``, ``grader_errors_task/<id>``; its
pass@1 and rewards count only the rollouts whose every part was scored. Infrastructure
(`clawfast.rollout.retry.infra_counts`): ``rollout/retries`` (attempts run again),
``rollout/infra_failures`` (attempts that an infrastructure failure ended, retried or returned),
``rollout/retried_rollouts``, ``rollout/nodes_lost`` (Ray nodes whose actor died under an attempt),
and on Ray ``rollout/node/<node id, 8 characters>`` (rollouts each node ran to the end).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from clawfast.records import RolloutResult
from clawfast.rollout.retry import infra_counts

# A Ray node id's first characters name it in metrics (as Ray's own CLI shortens them).
NODE_ID_CHARS = 8


def rollout_metrics(results: Sequence[RolloutResult], prefix: str = "") -> dict[str, float]:
    """Reward and pass@1 overall and per harness, status counts, calls per rollout."""
    out: dict[str, float] = {}
    if not results:
        return out
    by_harness: dict[str, list[float]] = defaultdict(list)
    for r in results:
        by_harness[r.harness].append(r.reward)
    rewards = [r.reward for r in results]
    out[f"{prefix}reward/mean"] = sum(rewards) / len(rewards)
    out[f"{prefix}pass@1"] = sum(x >= 1.0 for x in rewards) / len(rewards)
    for h, xs in sorted(by_harness.items()):
        out[f"{prefix}reward/{h}"] = sum(xs) / len(xs)
        out[f"{prefix}pass@1/{h}"] = sum(x >= 1.0 for x in xs) / len(xs)
    for status, n in sorted(Counter(r.status for r in results).items()):
        out[f"{prefix}status/{status}"] = float(n)
    out[f"{prefix}calls_per_rollout"] = sum(len(r.calls) for r in results) / len(results)
    out[f"{prefix}rollouts"] = float(len(results))
    verdicts = [r.info.get("verifier") for r in results]
    out[f"{prefix}verifier_errors"] = float(sum(v is not None and v.get("status") != "ok" for v in verdicts))
    infra = infra_counts(list(results))
    for name in ("retries", "infra_failures", "retried_rollouts"):
        out[f"{prefix}rollout/{name}"] = float(infra[name])
    out[f"{prefix}rollout/nodes_lost"] = float(len(infra["nodes_lost"]))
    for node, n in sorted(Counter(r.info["ray_node_id"] for r in results if r.info.get("ray_node_id")).items()):
        out[f"{prefix}rollout/node/{node[:NODE_ID_CHARS]}"] = float(n)
    return out


def subscore_means(results: Sequence[RolloutResult]) -> dict[str, float]:
    """``subscore/<name>``: the mean of each named sub-score of a graded verifier over the rollouts
    that report it. Names are usually a task's own, so only evals log them (a training run over
    thousands of tasks would log as many series)."""
    subscores: dict[str, list[float]] = defaultdict(list)
    for r in results:
        details = (r.info.get("verifier") or {}).get("details") or {}
        for name, value in details.get("subscores", {}).items():
            subscores[name].append(value)
    return {f"subscore/{name}": sum(xs) / len(xs) for name, xs in sorted(subscores.items())}


def metrics_by_tag(results: Sequence[RolloutResult], tasks: dict, tag: str) -> dict[str, float]:
    """pass@1 and mean reward per value of one task tag (``pass@1_difficulty/easy`` and
    ``reward_difficulty/easy`` for tag ``difficulty``; tag ``task`` means the task id), so an eval
    over mixed tasks shows where a change came from; tasks without the tag are left out."""
    by_value: dict[str, list[float]] = defaultdict(list)
    for r in results:
        value = r.task_id if tag == "task" else tasks[r.task_id].tags.get(tag)
        if value is not None:
            by_value[value].append(r.reward)
    out = {}
    for v, xs in sorted(by_value.items()):
        out[f"pass@1_{tag}/{v}"] = sum(x >= 1.0 for x in xs) / len(xs)
        out[f"reward_{tag}/{v}"] = sum(xs) / len(xs)
    return out


def score_counts(results: Sequence[RolloutResult]) -> dict[str, float]:
    """What an eval's scores rest on (``info["score"]``, `clawfast.tasks.scoring`): ``judged``,
    ``not_judged`` and ``judge_errors`` (rollouts of tasks with a rubric, by their judge's state),
    ``unscored`` (the last two: left out of pass@1), ``rollouts_all`` (scored or not), and ``grader_errors_task/<id>``, the rollouts of
    each task whose verifier could not score them."""
    states = Counter(r.info.get("score", {}).get("judge") for r in results)
    out = {"judged": float(states["judged"]), "not_judged": float(states["not judged"]),
           "judge_errors": float(states["judge_error"])}
    out["unscored"] = out["not_judged"] + out["judge_errors"]
    out["rollouts_all"] = float(len(results))
    errors = Counter(r.task_id for r in results if (r.info.get("verifier") or {}).get("status", "ok") != "ok")
    out.update({f"grader_errors_task/{task}": float(n) for task, n in sorted(errors.items())})
    return out

"""A task's score from its parts: the verifier's (code) and the judge's (a rubric), by the task's weights.

    score = (1 - w) * code + w * judged        w = task.rubric.weight (0 without a rubric)

ClawGym-Bench weighs a hybrid task 0.7 code / 0.3 rubric (`clawfast.tasks.clawgym`); PinchBench by its
grading type (automated: code alone, llm_judge: the judge alone, hybrid: its ``grading_weights``).

A part that is missing is said, never filled in: with no judge configured a rubric's part is ``not
judged`` and so is the task, whose `TaskScore.score` is None (its code part is still reported); a
judge that failed or answered nonsense makes it ``judge_error``, with the verdict kept. Only a task
whose every part was scored has a score, and only those count in pass@1 and the mean score
(`clawfast.train.report.suite_report`).

During training the reward is the verifier's score alone, as ClawGym trains: a rollout's judge
prompt is kept in its info, and `judge_results` scores it afterwards for evaluations. A task that only
a judge scores cannot be trained on (`clawfast.train.build.load_tasks` refuses it).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from clawfast.records import RolloutResult
from clawfast.tasks.judge import Judge, Verdict, ask
from clawfast.tasks.task import Task

JUDGE_STATES = ("no rubric", "judged", "not judged", "judge_error")


@dataclass
class TaskScore:
    """score: the task's score in [0, 1], None unless every judged part was scored (a verifier that
    failed counts 0, as its rollout's status says). code: the verifier's score
    (None for a task a judge alone scores, or when the verifier failed). judged: the judge's total
    (None unless `judge` is "judged"). weight: the judged share. judge: one of `JUDGE_STATES`."""

    score: float | None
    code: float | None
    judged: float | None
    weight: float
    judge: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def combine(task: Task, code: float | None, verdict: Verdict | None) -> TaskScore:
    """The score of one run of `task` from its verifier's score (`code`; None when the verifier could
    not score it) and its judge's verdict (None: not judged)."""
    weight = task.rubric.weight if task.rubric is not None else 0.0
    code = None if task.verifier is None else code
    if task.rubric is None:
        return TaskScore(code or 0.0, code, None, 0.0, "no rubric")
    if verdict is None:
        return TaskScore(None, code, None, weight, "not judged")
    if verdict.total is None:
        return TaskScore(None, code, None, weight, "judge_error")
    if task.verifier is None:
        return TaskScore(verdict.total, None, verdict.total, weight, "judged")
    # A verifier that could not score the run gives its part 0, as a training reward does; the
    # rollout's status says so.
    return TaskScore((1.0 - weight) * (code or 0.0) + weight * verdict.total, code, verdict.total, weight, "judged")


def judge_results(results: Sequence[RolloutResult], tasks: Mapping[str, Task], judge: Judge | None) -> None:
    """Score every result of a task with a rubric: ask `judge` (None: none configured) the prompt its
    rollout kept, store the verdict in ``info["judge"]`` beside that prompt and the `TaskScore` in
    ``info["score"]``, and set the result's reward to the task's score (while a part is unscored, the
    points already certain: the verifier's share; ``info["score"]`` says which). Results of tasks
    without a rubric get their `TaskScore` too, so every result reads alike. A rollout that ended
    before grading kept no prompt: with a judge configured that is a ``judge_error`` naming its status.
    Prompts go to the judge `judge.concurrency` at a time (1 when it does not say)."""
    def verdict_of(result: RolloutResult) -> Verdict | None:
        request = result.info.get("judge")
        if tasks[result.task_id].rubric is None or judge is None:
            return None
        if not isinstance(request, dict) or "prompt" not in request:
            return Verdict("", "", None, error=f"the rollout kept no judge prompt: it ended before grading "
                                               f"(status {result.status})", judge=judge.name)
        return ask(judge, request["prompt"])

    with ThreadPoolExecutor(max(1, getattr(judge, "concurrency", 1))) as pool:
        verdicts = list(pool.map(verdict_of, results))
    for result, verdict in zip(results, verdicts):
        task = tasks[result.task_id]
        code = result.reward if result.info.get("verifier", {}).get("status") == "ok" else None
        if verdict is not None:
            result.info["judge"] = {**result.info.get("judge", {}), "verdict": verdict.to_json()}
        score = combine(task, code, verdict)
        result.info["score"] = score.to_json()
        result.reward = score.score if score.score is not None else (code or 0.0) * (1.0 - score.weight)


def write_scores(path: Path, results: Sequence[RolloutResult]) -> None:
    """One JSON line per result: its ids, status, `TaskScore` (``info["score"]``, from
    `judge_results`), the verifier's details and the judge's prompt and verdict where it has them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({
                "rollout_id": r.rollout_id, "task_id": r.task_id, "harness": r.harness,
                "sample_index": r.sample_index, "status": r.status, "score": r.info.get("score"),
                "verifier": r.info.get("verifier"), "judge": r.info.get("judge"),
            }) + "\n")  # fmt: skip

"""End-to-end check of one real harness: proxy + sandbox + verifier, with the scripted engine replaying
a task's oracle through the harness's own shell tool.

`check_harness("mini-swe-agent")` installs the harness (cache), builds the embedded tokenizer, runs
one clawbench-mini task through a `RolloutService` on the oracle engine (`clawfast.rollout.oracle`:
the real proxy over HTTP in this process, a fresh sandbox, the verifier in another) and returns a
`CheckReport`: status, reward, the captured calls and their kinds (`clawfast.threads`), and whether consecutive
main-thread calls share an exact token prefix (call i+1's prompt starts with call i's prompt and
output: what training needs).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from clawfast.records import CallRecord, RolloutResult
from clawfast.rollout.oracle import FINAL_TEXT
from clawfast.rollout.service import ORACLE, HarnessConfig, RolloutService, SandboxConfig
from clawfast.rollout.spec import RolloutSpec, check_harness_options
from clawfast.tasks.task import Task
from clawfast.threads import reconstruct, shared_with_path, token_position, with_kinds

DEFAULT_TASK = "files-lines-0"  # two oracle commands, one a heredoc: newlines through tool-call JSON


@dataclass(frozen=True)
class PairContinuity:
    """Two consecutive main-thread calls a -> b. shared: tokens of a's path (prompt + output) that
    begin b's prompt. path: len(a's path). output_kept: a's sampled tokens appear verbatim in b's
    prompt (token in, token out), even where the harness moved other context around them."""

    first: int
    second: int
    shared: int
    path: int
    output_kept: bool

    @property
    def exact(self) -> bool:
        return self.shared == self.path


@dataclass
class CheckReport:
    """harness / task_id: what ran. result: the rollout (status, reward, calls, info).
    pairs: continuity of consecutive main-thread calls (see `PairContinuity`). turns_scripted: how
    many answers the script had. `ok`: the rollout is ok with reward 1.0 and every sampled output
    reappears verbatim in the next prompt (an exact prefix is reported, not required: OpenClaw, for
    one, moves its runtime-context message behind each new turn, which edits its own history)."""

    harness: str
    task_id: str
    result: RolloutResult
    turns_scripted: int
    pairs: list[PairContinuity] = field(default_factory=list)
    tags: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        r = self.result
        return r.status == "ok" and r.reward == 1.0 and all(p.output_kept for p in self.pairs)

    def lines(self) -> list[str]:
        r = self.result
        out = [
            f"harness   {self.harness}   task {self.task_id}   rollout {r.rollout_id}",
            f"status    {r.status}   reward {r.reward}",
            f"calls     {len(r.calls)} captured ({self.turns_scripted} scripted turns); tags "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.tags.items())),
        ]
        for c in r.calls:
            out.append(
                f"  call {c.call_index}: {'/'.join(c.tags)} {c.metadata.get('protocol', '')} "
                f"prompt {len(c.prompt_ids)} tok, output {len(c.output_ids)} tok, finish {c.finish_reason}"
            )
        exact = sum(p.exact for p in self.pairs)
        kept = sum(p.output_kept for p in self.pairs)
        out.append(f"prefix    {exact}/{len(self.pairs)} consecutive main calls extend the previous prompt + output "
                   f"exactly; {kept}/{len(self.pairs)} keep the previous output tokens verbatim")
        for p in self.pairs:
            if not p.exact:
                out.append(f"  call {p.first} -> {p.second}: shares {p.shared} of {p.path} tokens "
                           f"(the harness changed the last {p.path - p.shared})")
        timings = r.info.get("timings", {})
        out.append("timings   " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
        for key in ("error", "stderr_tail", "logs"):
            if r.info.get(key):
                out.append(f"{key:<9} {str(r.info[key]).strip()[-1500:]}")
        if r.info.get("verifier"):
            v = r.info["verifier"]
            out.append(f"verifier  {v.get('status')} score {v.get('score')} {v.get('error') or ''}".rstrip())
        return out


def continuity(calls: list[CallRecord]) -> list[PairContinuity]:
    """Continuity of each pair of consecutive main-thread (non-excluded) calls, in call order."""
    main = sorted((c for c in calls if not c.excluded), key=lambda c: c.call_index)
    return [
        PairContinuity(a.call_index, b.call_index, shared_with_path(b.prompt_ids, a.prompt_ids, a.output_ids),
                       len(a.prompt_ids) + len(a.output_ids),
                       token_position(b.prompt_ids.astype("<i4").tobytes(), a.output_ids.astype("<i4").tobytes()) != -1)
        for a, b in zip(main, main[1:])
    ]


def check_task(task_id: str = DEFAULT_TASK) -> Task:
    from clawfast.tasks import clawbench_mini

    for task in clawbench_mini():
        if task.id == task_id:
            return task
    raise ValueError(f"clawbench-mini has no task {task_id!r}")


def check_harness(
    name: str,
    *,
    backend: str = "bwrap",
    task: Task | None = None,
    timeout_s: float = 300.0,
    logs_dir: Path | None = None,
    model_dir: Path | None = None,
    options: Mapping[str, Any] | None = None,
) -> CheckReport:
    """Run `task` (default: clawbench-mini's `DEFAULT_TASK`) once through harness `name` with its
    oracle scripted; see the module docstring. `backend`: ``bwrap`` (default) or ``local``.
    `model_dir`: whose tokenizer and chat template the proxy renders with (default: the embedded model).
    `options`: the harness's own options (`Harness.own_options`; a `ValueError` for one it does not
    take or a bad value, as a run's config gives)."""
    from clawfast.embedded import ensure_embedded_model

    model_dir = model_dir or ensure_embedded_model()
    task = task or check_task()
    limits = {"timeout_s": timeout_s, "max_turns": 2 * len(task.oracle) + 4}
    turns = len(check_harness_options(name, options or {}, **limits).scripted_turns(list(task.oracle), FINAL_TEXT))
    options = {**(options or {}), **limits}
    with tempfile.TemporaryDirectory(prefix="clawfast-check-") as tmp:
        harnesses = HarnessConfig({name: options}, timeout_s=timeout_s, logs_dir=logs_dir or Path(tmp) / "logs")
        with RolloutService(ORACLE, model_dir, records_dir=Path(tmp) / "records", harnesses=harnesses,
                            sandbox=SandboxConfig(backend), oracle_tasks=[task]) as service:
            [result] = service.run([RolloutSpec(task, name, 0)])
    calls = with_kinds(result.calls, reconstruct(result.calls))  # main and side calls by structure
    tags = Counter(tag for c in calls for tag in c.tags)
    return CheckReport(name, task.id, result, turns, continuity(calls), tags)

"""Tasks, verifiers and task suites.

A **task** (`Task`) is what one rollout works on:

- ``id``: unique, ``[A-Za-z0-9][A-Za-z0-9._-]*``;
- ``instruction``: the prompt given to the harness;
- the **initial workspace**: inline files (``files``: path -> str/bytes) and/or a directory copied
  first (``workspace_dir``); `Task.materialize(dest)` writes it;
- a **verifier** that scores the final workspace (below);
- ``timeout``: seconds the harness gets;
- ``tags``: string -> string; ``category`` and ``split`` (``train`` | ``eval``) are required;
- an **oracle**: a list of bash command strings that solve the task when run in order with
  ``bash -c`` in the workspace. File writes are ``echo``/``printf``/heredocs, so a scripted engine can
  replay an oracle as tool calls through any harness (Claude Code's Bash tool, OpenClaw's exec,
  mini-swe-agent's bash). The *do-nothing* solution (no commands) must score 0.

**Verifier protocol.** A `CommandVerifier` is a command run with ``bash -c`` after the harness exits,
in a fresh sandbox whose working directory is a copy of the final workspace and where
``$VERIFIER_DIR`` holds the verifier's own files (hidden from the agent). It prints a JSON score
object ``{"score": <float in [0, 1]>, "details": {...}}`` on its last stdout line and exits 0. A
verifier that crashes, exits non-zero, times out or prints anything else scores 0 with status
``verifier_error`` and its stderr kept (`VerifierResult`); `run_verifier` never raises for it, so one
bad verifier cannot break a batch. The in-process form is a `CallableVerifier` wrapping
``verify(workspace: Path) -> VerifierResult`` (or a float): no sandbox and no timeout, for trusted
checks only.

Where a command runs is a `CommandRunner`: `SubprocessRunner` (plain child process, no isolation) or
the sandbox adapter in `clawfast.tasks.sandbox_runner` (a fresh clawfast.sandbox per verifier run).

**Task directories** (a user's own tasks) hold one folder per task with ``task.toml``,
``workspace/`` and optional ``verifier/``; `load_task_dir(path)` loads and validates them. The format
is in docs/TASKS.md; a minimal task.toml:

    id = "hello"
    instruction = "Create hello.txt containing exactly: hi"
    timeout = 120
    oracle = ["echo hi > hello.txt"]
    [tags]
    category = "files"
    split = "train"
    [verifier]
    command = "test \\"$(cat hello.txt)\\" = hi && echo '{\\"score\\": 1}' || echo '{\\"score\\": 0}'"
    timeout = 10

**ClawGym folders** (the layout of the ClawGym paper's suites: ``data_entry.json``, ``input_files/``,
``reward/reward.sh``) load as the suite ``clawgym:PATH[?eval=FRACTION]``
(`clawfast.tasks.clawgym.load_clawgym`): the workspace lies at the task's ``input_mount_dir``
(`Task.workdir`) and a `RewardScriptVerifier` runs ``reward.sh``, whose last stdout line is a graded
reward in [0, 1], with ``check.py``'s named sub-scores kept.

**PinchBench suites** (one Markdown file per task under ``tasks/``, graded by a Python ``grade(transcript,
workspace_path)`` and/or a judge's rubric) load as ``pinchbench:PATH[?eval=FRACTION][&exclude=ID,ID]``
(`clawfast.tasks.pinchbench.load_pinchbench`); their ``grade`` runs in a fresh sandbox
(`GradeFunctionVerifier`) with the run's transcript (`clawfast.tasks.transcript`). Tasks with a
`Rubric` are also scored by a judge model (`clawfast.tasks.judge`), combined by their weights
(`clawfast.tasks.scoring`: ClawGym hybrid 0.7 / 0.3, PinchBench by grading type).

**Built-in suite** ``clawbench-mini`` (`clawbench_mini(seed)`): 64 generated tasks in four
categories (files, code, data, shell), 48 train / 16 eval; see `clawfast.tasks.mini`.
`load_suite(name_or_dir, split)` returns either kind; `check_task(task)` replays the oracle and the
do-nothing solution and scores both.
"""

from clawfast.tasks.clawgym import load_clawgym
from clawfast.tasks.mini import clawbench_mini
from clawfast.tasks.pinchbench import load_pinchbench
from clawfast.tasks.suites import BUILTIN_SUITES, load_suite
from clawfast.tasks.task import (
    CallableVerifier,
    CommandVerifier,
    GradeFunctionVerifier,
    RewardScriptVerifier,
    Rubric,
    Task,
    TaskFormatError,
    VerifierResult,
)
from clawfast.tasks.taskdir import load_task, load_task_dir
from clawfast.tasks.verify import (
    CommandResult,
    CommandRunner,
    OracleRun,
    SubprocessRunner,
    TaskCheck,
    check_task,
    parse_score_line,
    run_commands,
    run_verifier,
)

__all__ = [
    "BUILTIN_SUITES",
    "CallableVerifier",
    "CommandResult",
    "CommandRunner",
    "CommandVerifier",
    "GradeFunctionVerifier",
    "OracleRun",
    "RewardScriptVerifier",
    "Rubric",
    "SubprocessRunner",
    "Task",
    "TaskCheck",
    "TaskFormatError",
    "VerifierResult",
    "check_task",
    "clawbench_mini",
    "load_clawgym",
    "load_pinchbench",
    "load_suite",
    "load_task",
    "load_task_dir",
    "parse_score_line",
    "run_commands",
    "run_verifier",
]

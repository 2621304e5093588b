"""The `Task` record, its verifier specifications (see the package docstring for the format) and
what a verifier returns (`VerifierResult`: `clawfast.tasks.verify` makes one per run, an in-process
verifier may return one itself).

Construction validates every field and raises `TaskFormatError` (a `ValueError`) naming the task and
the bad field, so a malformed task fails when it is loaded, never halfway through a training batch.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping

SPLITS = ("train", "eval")
# Matched in full (`fullmatch`): with `match` and `$`, an id ending in a newline would pass.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Every harness gets the instruction as one argv string, which exec refuses if it holds a NUL or, on Linux,
# if it is MAX_ARG_STRLEN (32 pages: 128 KiB with its terminating NUL) or longer: such a task would load
# and then fail every rollout at exec.
MAX_INSTRUCTION_BYTES = 128 * 1024 - 1
DEFAULT_TASK_TIMEOUT = 600.0
DEFAULT_VERIFIER_TIMEOUT = 60.0


class TaskFormatError(ValueError):
    """A task, or the file it is loaded from, is malformed. The message names where (the file, or
    ``task 'ID'`` for a task built in code) and, where one field is at fault, that `field` and its
    `problem`, which are kept so that a loader can name its file in place of the task (`at`)."""

    def __init__(self, message: str, *, field: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.problem = problem

    def at(self, where: str | Path) -> TaskFormatError:
        """This error located at `where` (the file the task was loaded from) instead of the task."""
        if self.field is None or self.problem is None:
            return TaskFormatError(f"{where}: {self}")
        return field_error(where, self.field, self.problem)


def field_error(where: str | Path, field_name: str, problem: str) -> TaskFormatError:
    """``WHERE: field 'NAME': PROBLEM``, the one shape of a bad field's error in every task format."""
    return TaskFormatError(f"{where}: field {field_name!r}: {problem}", field=field_name, problem=problem)


def _check_rel_path(where: str, field_name: str, path: str) -> str:
    """A workspace-relative POSIX path that cannot escape the directory it is written into."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or str(p) in ("", "."):
        raise field_error(where, field_name, f"path {path!r} must be relative, without '..'")
    return str(p)


def _check_files(where: str, field_name: str, files: Mapping[str, str | bytes]) -> dict[str, bytes]:
    if not isinstance(files, Mapping):
        raise field_error(where, field_name, f"must be a mapping of path -> content, got {type(files).__name__}")
    out: dict[str, bytes] = {}
    for path, content in files.items():
        if not isinstance(path, str):
            raise field_error(where, field_name, f"path {path!r} must be a string")
        rel = _check_rel_path(where, field_name, path)
        if isinstance(content, str):
            content = content.encode("utf-8")
        if not isinstance(content, bytes):
            raise field_error(where, field_name, f"content of {path!r} must be str or bytes")
        out[rel] = content
    return out


def _check_dir(where: str, field_name: str, directory: Path | str | None) -> Path | None:
    if directory is None:
        return None
    directory = Path(directory)
    if not directory.is_dir():
        raise field_error(where, field_name, f"{directory} is not a directory")
    return directory


def _check_instruction(where: str, instruction: str) -> None:
    """An instruction that an argv string can carry (`MAX_INSTRUCTION_BYTES`)."""
    if "\0" in instruction:
        raise field_error(where, "instruction", f"holds a NUL character at index {instruction.index(chr(0))}: "
                                                f"no argv string can carry one")
    try:
        size = len(instruction.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise field_error(where, "instruction", f"is not valid Unicode text ({exc.reason} at index {exc.start})"
                          ) from None
    if size > MAX_INSTRUCTION_BYTES:
        raise field_error(where, "instruction", f"is {size} bytes in UTF-8; a harness's argv string holds at most "
                                                f"{MAX_INSTRUCTION_BYTES} (Linux's MAX_ARG_STRLEN)")


def _check_timeout(where: str, field_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise field_error(where, field_name, f"must be a positive finite number of seconds, got {value!r}")
    return float(value)


def _materialize(files: Mapping[str, bytes], directory: Path | None, dest: Path) -> None:
    if directory is not None:
        # symlinks=True: copy links as links, never the file (or tree) a link points at.
        shutil.copytree(directory, dest, symlinks=True, dirs_exist_ok=True)
    for rel, content in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


@dataclass(frozen=True)
class CommandVerifier:
    """A verifier command, run with ``bash -c`` after the harness exits, in a fresh sandbox whose
    working directory is a copy of the final workspace and where ``$VERIFIER_DIR`` holds `files`
    (and a copy of `directory`); it must print ``{"score": s, "details": {...}}`` as its last stdout
    line and exit 0 within `timeout` seconds."""

    command: str
    files: Mapping[str, bytes] = field(default_factory=dict)
    directory: Path | None = None
    timeout: float = DEFAULT_VERIFIER_TIMEOUT

    def validate(self, where: str) -> CommandVerifier:
        if not isinstance(self.command, str) or not self.command.strip():
            raise field_error(where, "verifier.command", "must be a non-empty string")
        return CommandVerifier(
            command=self.command,
            files=_check_files(where, "verifier.files", self.files),
            directory=_check_dir(where, "verifier.directory", self.directory),
            timeout=_check_timeout(where, "verifier.timeout", self.timeout),
        )

    def materialize(self, dest: Path) -> None:
        """Write the verifier files into `dest` (created if needed)."""
        dest.mkdir(parents=True, exist_ok=True)
        _materialize(self.files, self.directory, dest)


@dataclass
class VerifierResult:
    """score: in [0, 1] (0.0 whenever status is ``verifier_error``).
    status: ``ok`` or ``verifier_error``.
    details: the verifier's own ``details`` object (empty on error).
    error: why the status is ``verifier_error`` (None when ok).
    stderr: the tail of the verifier's stderr (at most 8 KiB; empty for in-process verifiers).
    stdout: on ``verifier_error``, the tail of its stdout (at most 4,096 characters; empty when ok).
    duration_s: wall time of the verifier run."""

    score: float
    status: str = "ok"
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    stderr: str = ""
    duration_s: float = 0.0
    stdout: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"score": self.score, "status": self.status, "details": self.details, "error": self.error,
                "stderr": self.stderr, "stdout": self.stdout, "duration_s": self.duration_s}


@dataclass(frozen=True)
class CallableVerifier:
    """The in-process form: ``fn(workspace: Path) -> VerifierResult`` (or a bare float score).
    It runs in the caller's process on a copy of the final workspace: no sandbox and no timeout, so
    use it only for trusted checks that read files, never for running the agent's code."""

    fn: Callable[[Path], VerifierResult | float]

    def validate(self, where: str) -> CallableVerifier:
        if not callable(self.fn):
            raise field_error(where, "verifier", "callable verifier must be callable")
        return self


@dataclass(frozen=True)
class GradeFunctionVerifier:
    """PinchBench's grading protocol: `code` is Python source defining ``grade(transcript: list,
    workspace_path: str) -> dict`` that returns criterion -> score in [0, 1]. It runs in its own
    ``python3`` process in a fresh sandbox, with a copy of the final workspace as its working
    directory and ``workspace_path``, and the run's transcript (`clawfast.tasks.transcript`). The score
    is the mean of the criteria (0 when it returns none), the criteria are kept in
    ``details["criteria"]``; anything else it returns or raises is a ``verifier_error``."""

    code: str
    timeout: float = DEFAULT_VERIFIER_TIMEOUT

    RUNNER = "grade_runner.py"

    def validate(self, where: str) -> GradeFunctionVerifier:
        if not isinstance(self.code, str) or "def grade" not in self.code:
            raise field_error(where, "verifier.code",
                              "must be Python source defining grade(transcript, workspace_path)")
        try:
            compile(self.code, f"<{where} grade>", "exec")
        except SyntaxError as exc:
            raise field_error(where, "verifier.code", f"is not valid Python: line {exc.lineno}: {exc.msg}") from None
        return GradeFunctionVerifier(code=self.code, timeout=_check_timeout(where, "verifier.timeout", self.timeout))


@dataclass(frozen=True)
class Rubric:
    """The part of a task's score that a judge model gives (`clawfast.tasks.judge`).

    text: the rubric the judge reads (its criteria and what each score level means).
    weight: the rubric's share of the task's score, in (0, 1]; the verifier's score has the rest. A
        rubric of weight 1 is the whole score, and the task has no verifier (`Task.verifier` None).
    expected: what a good run does, shown to the judge beside the rubric (may be empty).
    files: workspace paths whose contents the judge reads (the rubric's rules are about them).
    """

    text: str
    weight: float
    expected: str = ""
    files: tuple[str, ...] = ()

    def validate(self, where: str) -> Rubric:
        if not isinstance(self.text, str) or not self.text.strip():
            raise field_error(where, "rubric.text", "must be a non-empty string")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not 0.0 < self.weight <= 1.0:
            raise field_error(where, "rubric.weight", f"must be a number in (0, 1], got {self.weight!r}")
        files = tuple(_check_rel_path(where, "rubric.files", f) for f in self.files)
        return Rubric(text=self.text, weight=float(self.weight), expected=self.expected or "", files=files)


@dataclass(frozen=True)
class RewardScriptVerifier:
    """ClawGym's reward protocol: `directory` (the task's ``reward/`` folder, holding ``reward.sh``)
    is copied to ``<workdir>/reward`` of a copy of the final workspace, placed at the task's `workdir`
    inside a fresh sandbox, and ``bash <workdir>/reward/reward.sh`` runs there within `timeout`
    seconds; the last non-empty stdout line is the reward, a float in [0, 1]. When the folder holds
    ``check.py``, ``python3 <workdir>/reward/check.py <workdir>`` runs after it in another fresh
    sandbox, and the JSON object of named sub-scores it prints is kept (the reward is reward.sh's
    alone). `metadata` is the task's own metadata object, passed to the script in the file
    ``$OPENCLAW_REWARD_PAYLOAD`` (see `clawfast.tasks.clawgym`)."""

    directory: Path
    timeout: float = DEFAULT_VERIFIER_TIMEOUT
    metadata: Mapping[str, object] = field(default_factory=dict)

    ENTRY = "reward.sh"
    SUBSCORES = "check.py"

    def validate(self, where: str) -> RewardScriptVerifier:
        directory = _check_dir(where, "verifier.directory", self.directory)
        if directory is None or not (directory / self.ENTRY).is_file():
            raise field_error(where, "verifier.directory", f"must hold {self.ENTRY}")
        return RewardScriptVerifier(directory=directory, metadata=dict(self.metadata),
                                    timeout=_check_timeout(where, "verifier.timeout", self.timeout))

    @property
    def has_subscores(self) -> bool:
        return (self.directory / self.SUBSCORES).is_file()


Verifier = CommandVerifier | CallableVerifier | RewardScriptVerifier | GradeFunctionVerifier
VERIFIER_TYPES = (CommandVerifier, CallableVerifier, RewardScriptVerifier, GradeFunctionVerifier)


def check_workdir_field(where: str, field_name: str, workdir: str | None) -> str | None:
    """A normalised absolute path other than /. Where a sandbox may mount a workspace is the
    sandbox's to say (`clawfast.sandbox.spec.check_workdir`, when the rollout's sandbox is made)."""
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/") or workdir == "/"
                                or workdir.startswith("//") or os.path.normpath(workdir) != workdir):
        raise field_error(where, field_name, f"must be a normalised absolute path other than /, got {workdir!r}")
    return workdir


@dataclass(frozen=True)
class Task:
    """One task. Fields:

    id: unique, ``[A-Za-z0-9][A-Za-z0-9._-]*`` (at most 128 characters).
    instruction: what the agent is told (the harness's prompt).
    files / workspace_dir: the initial workspace: inline ``path -> content`` and/or a directory copied
        first (inline files are written over it). Either may be empty.
    verifier: a `CommandVerifier`, `CallableVerifier`, `RewardScriptVerifier` or
        `GradeFunctionVerifier`; None only for a task that a judge alone scores (a `rubric` of weight 1).
    oracle: bash command strings that solve the task when run in order, each with ``bash -c`` in the
        workspace (a scripted engine replays them as tool calls through any harness).
    timeout: seconds the harness gets.
    workdir: where the workspace lies inside the sandbox, an absolute path (None: the sandbox
        backend's own place, /run/ws). The harness starts there and the verifier sees the final
        workspace there too, so tasks whose files name absolute paths keep working.
    private_dirs: host directories the agent must not see, hidden inside its sandbox: the folder of
        the suite the task was loaded from, which holds its verifier's files and the other tasks'.
    rubric: the part of the score a judge model gives (`Rubric`), None for tasks that code alone scores.
    tags: string tags; ``category`` and ``split`` (``train`` or ``eval``) are required, others
        (``difficulty``, ``template``, ``suite``) are free.
    """

    id: str
    instruction: str
    verifier: Verifier | None
    oracle: tuple[str, ...]
    tags: Mapping[str, str]
    files: Mapping[str, bytes] = field(default_factory=dict)
    workspace_dir: Path | None = None
    timeout: float = DEFAULT_TASK_TIMEOUT
    workdir: str | None = None
    private_dirs: tuple[Path, ...] = ()
    rubric: Rubric | None = None

    def __post_init__(self) -> None:
        where = f"task {self.id!r}"
        if not isinstance(self.id, str) or not ID_PATTERN.fullmatch(self.id):
            raise field_error(where, "id", f"must match {ID_PATTERN.pattern} (the whole id)")
        if not isinstance(self.instruction, str) or not self.instruction.strip():
            raise field_error(where, "instruction", "must be a non-empty string")
        _check_instruction(where, self.instruction)
        if self.rubric is not None and not isinstance(self.rubric, Rubric):
            raise field_error(where, "rubric", f"must be a Rubric, got {type(self.rubric).__name__}")
        judge_only = self.rubric is not None and self.rubric.weight == 1.0
        if self.verifier is None and not judge_only:
            raise field_error(where, "verifier", "is required (only a task scored by a rubric of weight 1 has none)")
        if self.verifier is not None and judge_only:
            raise field_error(where, "verifier", "must be None: a rubric of weight 1 is the whole score")
        if self.verifier is not None and not isinstance(self.verifier, VERIFIER_TYPES):
            raise field_error(where, "verifier", f"must be one of {', '.join(t.__name__ for t in VERIFIER_TYPES)}, "
                                                 f"got {type(self.verifier).__name__}")
        if isinstance(self.verifier, RewardScriptVerifier) and self.workdir is None:
            raise field_error(where, "workdir", "is required with a RewardScriptVerifier (its scripts name the "
                                                "workspace by its absolute path)")
        if isinstance(self.oracle, str) or not all(isinstance(c, str) for c in self.oracle):
            raise field_error(where, "oracle", "must be a list of bash command strings")
        if not isinstance(self.tags, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.tags.items()
        ):
            raise field_error(where, "tags", "must be a mapping of string -> string")
        if not self.tags.get("category"):
            raise field_error(where, "tags.category", "is required")
        if self.tags.get("split") not in SPLITS:
            raise field_error(where, "tags.split", f"must be one of {SPLITS}, got {self.tags.get('split')!r}")
        # Frozen dataclass: normalised values are set through object.__setattr__, once, here.
        if self.verifier is not None:
            object.__setattr__(self, "verifier", self.verifier.validate(where))
        if self.rubric is not None:
            object.__setattr__(self, "rubric", self.rubric.validate(where))
        object.__setattr__(self, "oracle", tuple(self.oracle))
        object.__setattr__(self, "tags", dict(self.tags))
        object.__setattr__(self, "files", _check_files(where, "files", self.files))
        object.__setattr__(self, "workspace_dir", _check_dir(where, "workspace_dir", self.workspace_dir))
        object.__setattr__(self, "timeout", _check_timeout(where, "timeout", self.timeout))
        object.__setattr__(self, "workdir", check_workdir_field(where, "workdir", self.workdir))
        object.__setattr__(self, "private_dirs", tuple(Path(p).resolve() for p in self.private_dirs))

    @property
    def category(self) -> str:
        return self.tags["category"]

    @property
    def split(self) -> str:
        return self.tags["split"]

    def materialize(self, dest: Path | str) -> Path:
        """Write the initial workspace into `dest` (created if missing; must be empty if present)."""
        dest = Path(dest)
        if dest.exists() and any(dest.iterdir()):
            raise FileExistsError(f"{dest} is not empty")
        dest.mkdir(parents=True, exist_ok=True)
        _materialize(self.files, self.workspace_dir, dest)
        return dest

"""Loading ClawGym-format task folders (the layout of ClawGym-Bench and ClawGym-Task; docs/TASKS.md).

    SUITE/
      task_0000/
        data_entry.json   {"task_id", "user_query", "input_mount_dir"?, "metadata": {"category", "grading_type"}}
        input_files/      copied verbatim into the workspace (optional)
        reward/           reward.sh (required: its last stdout line is the reward, a float in [0, 1]),
                          check.py and other helpers; rubric.json for hybrid tasks (below)

As a suite: ``clawgym:PATH`` (every task folder under PATH) or ``clawgym:PATH?eval=FRACTION`` (a
deterministic split by task id hash: a task is in ``eval`` when the first 8 bytes of the SHA-256 of
its id, read as a fraction of 2^64, are below FRACTION; in ``train`` otherwise). Without ``?eval=``
a folder is one split: its tasks are the tasks of whichever split is asked for (point training and
evaluation at different folders, e.g. ClawGym's ``clawgym_train/`` and ``clawgym_eval/``).

Each task's workspace lies at ``input_mount_dir`` (default ``/root/.openclaw/workspace``, where
ClawGym's reward scripts look for it) inside the sandbox, for the harness and the verifier alike;
``reward/`` is copied in only for verification (`RewardScriptVerifier`), and the suite's folder is
hidden from the agent's sandbox (`Task.private_dirs`). Tags: ``category`` (the
metadata's, ``uncategorized`` when empty), ``grading_type``, ``split`` and ``suite = clawgym``.

**Hybrid tasks** (``metadata.grading_type = "hybrid"``, as 44 of ClawGym-Bench's 200 are) score 0.7
by reward.sh and 0.3 by a judge reading a rubric (`clawfast.tasks.scoring`). The rubric lies in
``reward/rubric.json`` (hidden from the agent with the rest of ``reward/``) in the schema of ClawGym's
rubric generator: ``{"eval_type": "llm_rubric", "score_options": [...], "eval_input": "...", "rules":
[{"name", "file_path", "scores": {"0": "...", ..., "1": "..."}}]}``; each rule's ``file_path`` (relative
to the workspace, or absolute under ``input_mount_dir``) is a file the judge reads. An ``automated``
task holds no rubric.json.

Every problem raises `TaskFormatError` naming the folder and the field: a missing or unparsable
data_entry.json, a missing reward.sh, an unknown grading type, ``input_mount_dir`` without
``input_files/``, an unknown key, a sub-folder that is not a task folder, duplicate ids. Nothing is
skipped silently. Files are not read into memory: tasks refer to their folders, which must stay in place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from clawfast.tasks import suite_spec
from clawfast.tasks.task import (
    DEFAULT_TASK_TIMEOUT,
    SPLITS,
    RewardScriptVerifier,
    Rubric,
    Task,
    TaskFormatError,
    check_workdir_field,
    field_error,
)

PREFIX = "clawgym:"
ENTRY_FILE = "data_entry.json"
DEFAULT_MOUNT_DIR = "/root/.openclaw/workspace"
# automated: reward.sh alone; hybrid: reward.sh and a rubric (the published folders hold only automated).
GRADING_TYPES = ("automated", "hybrid")
RUBRIC_FILE = "rubric.json"
# ClawGym-Bench's split of a hybrid task's score: 0.7 code, 0.3 rubric.
RUBRIC_WEIGHT = 0.3
# ClawGym's own rollout gives reward.sh 120 s.
REWARD_TIMEOUT = 120.0
UNCATEGORIZED = "uncategorized"
_ENTRY_KEYS = {"task_id", "user_query", "input_mount_dir", "metadata"}


def parse_spec(spec: str) -> tuple[Path, float | None]:
    """``clawgym:PATH[?eval=FRACTION]`` -> (PATH, FRACTION or None). Raises ValueError."""
    path, options = suite_spec.parse_spec(spec, PREFIX, {"eval": "eval=FRACTION"})
    return path, suite_spec.eval_fraction(spec, options)


def _string(entry: dict[str, Any], where: Path, name: str, *, required: bool = True) -> str | None:
    if name not in entry:
        if required:
            raise field_error(where, name, "is required")
        return None
    value = entry[name]
    if not isinstance(value, str):
        raise field_error(where, name, f"must be a string, got {type(value).__name__}")
    return value


def load_rubric(path: Path, workdir: str) -> Rubric:
    """A ClawGym rubric file (see the module docstring) as a `Rubric` of weight `RUBRIC_WEIGHT`: its
    rules rendered as the text a judge reads, their files named relative to the workspace."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("eval_type") != "llm_rubric":
        raise field_error(path, "eval_type", "must be 'llm_rubric'")
    rules = data.get("rules")
    if not isinstance(rules, list) or not rules:
        raise field_error(path, "rules", "must be a non-empty list")
    lines, files = [], []
    if isinstance(data.get("eval_input"), str) and data["eval_input"].strip():
        lines.append(data["eval_input"].strip())
    for i, rule in enumerate(rules):
        where = f"rules[{i}]"
        if not isinstance(rule, dict) or not isinstance(rule.get("name"), str) or not isinstance(rule.get("scores"), dict):
            raise field_error(path, where, "must be an object with a name and a scores object")
        # The judge reads each rule by its heading and grades against its levels: a blank name or no
        # levels leaves it nothing to grade by.
        if not rule["name"].strip():
            raise field_error(path, f"{where}.name", "must be a non-blank string")
        if not rule["scores"]:
            raise field_error(path, f"{where}.scores", "must hold at least one score level")
        file_path = rule.get("file_path")
        if file_path is not None:
            if not isinstance(file_path, str) or not file_path:
                raise field_error(path, f"{where}.file_path", f"must be a non-empty string, got {file_path!r}")
            if file_path.startswith("/"):
                if not file_path.startswith(workdir.rstrip("/") + "/"):
                    raise field_error(path, f"{where}.file_path",
                                      f"{file_path!r} is not inside the workspace {workdir}")
                file_path = file_path[len(workdir.rstrip("/")) + 1:]
            files.append(file_path)
        lines.append(f"### {rule['name']}" + (f" (file: {file_path})" if file_path else ""))
        for level, text in sorted(rule["scores"].items(), key=lambda kv: float(kv[0]) if _number(kv[0]) else 2.0):
            if not _number(level) or not isinstance(text, str):
                raise field_error(path, f"{where}.scores", f"levels must be finite numbers with descriptions, "
                                                           f"got {level!r}")
            lines.append(f"**Score {level}**: {text}")
    return Rubric(text="\n".join(lines), weight=RUBRIC_WEIGHT, files=tuple(dict.fromkeys(files)))


def _number(text: str) -> bool:
    """Whether `text` is a finite number (``float`` also reads "NaN", "Infinity" and "1e999")."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def load_clawgym_task(folder: Path | str, split: str | Callable[[str], str], suite: Path | None = None) -> Task:
    """Load one ClawGym task folder (holding data_entry.json) as a task of `split` (or of
    `split(task_id)`); `suite` (default: the folder itself) is hidden from the agent's sandbox."""
    folder = Path(folder)
    where = folder / ENTRY_FILE
    try:
        entry = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskFormatError(f"{where}: missing (a ClawGym task folder holds {ENTRY_FILE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{where}: invalid JSON: {exc}") from None
    if not isinstance(entry, dict):
        raise TaskFormatError(f"{where}: must hold a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise field_error(where, unknown[0], f"unknown key (allowed: {', '.join(sorted(_ENTRY_KEYS))})")
    task_id = _string(entry, where, "task_id")
    user_query = _string(entry, where, "user_query")
    mount_dir = _string(entry, where, "input_mount_dir", required=False)
    metadata = entry.get("metadata")
    if not isinstance(metadata, dict):
        raise field_error(where, "metadata", "is required and must be an object" if metadata is None
                          else f"must be an object, got {type(metadata).__name__}")
    grading = metadata.get("grading_type")
    if grading not in GRADING_TYPES:
        raise field_error(where, "metadata.grading_type", f"{grading!r} is not supported (supported: "
                                                          f"{', '.join(GRADING_TYPES)})")
    category = metadata.get("category", "")
    if not isinstance(category, str):
        raise field_error(where, "metadata.category", f"must be a string, got {type(category).__name__}")

    inputs, reward = folder / "input_files", folder / "reward"
    if inputs.exists() and not inputs.is_dir():
        raise TaskFormatError(f"{folder}: input_files must be a directory")
    if mount_dir is not None and not inputs.is_dir():
        raise field_error(where, "input_mount_dir", f"is set but {inputs} does not exist")
    if not (reward / RewardScriptVerifier.ENTRY).is_file():
        raise TaskFormatError(f"{folder}: reward/{RewardScriptVerifier.ENTRY} is missing (every ClawGym task "
                              f"needs one)")
    check_workdir_field(where, "input_mount_dir", mount_dir)
    rubric_path = reward / RUBRIC_FILE
    if grading == "hybrid" and not rubric_path.is_file():
        raise field_error(where, "metadata.grading_type", f"a hybrid task needs reward/{RUBRIC_FILE}")
    if grading != "hybrid" and rubric_path.exists():
        raise field_error(where, "metadata.grading_type",
                          f"is {grading!r} but reward/{RUBRIC_FILE} exists (use 'hybrid')")
    rubric = load_rubric(rubric_path, mount_dir or DEFAULT_MOUNT_DIR) if grading == "hybrid" else None
    try:
        return Task(
            id=task_id,
            instruction=user_query,
            verifier=RewardScriptVerifier(reward, timeout=REWARD_TIMEOUT, metadata=metadata),
            oracle=(),
            tags={"category": category or UNCATEGORIZED, "grading_type": grading,
                  "split": split(task_id) if callable(split) else split,
                  "suite": "clawgym"},
            workspace_dir=inputs if inputs.is_dir() else None,
            timeout=DEFAULT_TASK_TIMEOUT,
            workdir=mount_dir or DEFAULT_MOUNT_DIR,
            private_dirs=(suite or folder,),
            rubric=rubric,
        )
    except TaskFormatError as exc:
        raise exc.at(where) from None


def _task_folders(path: Path) -> list[Path]:
    """The task folders under `path`; anything else there (but hidden entries) is an error."""
    if (path / ENTRY_FILE).is_file():
        return [path]
    folders = []
    for child in sorted(path.iterdir()):
        if child.name.startswith("."):
            continue
        if not child.is_dir():
            raise TaskFormatError(f"{path}: {child.name} is not a task folder (a ClawGym suite holds only "
                                  f"task folders, each with {ENTRY_FILE})")
        if not (child / ENTRY_FILE).is_file():
            nested = any((grand / ENTRY_FILE).is_file() for grand in child.iterdir() if grand.is_dir())
            hint = (f"; it holds task folders itself: point the suite at {child}" if nested else "")
            raise TaskFormatError(f"{child}: not a task folder: no {ENTRY_FILE}{hint}")
        folders.append(child)
    if not folders:
        raise TaskFormatError(f"{path}: no task folders (sub-folders holding {ENTRY_FILE})")
    return folders


def load_clawgym(spec: str, split: str | None = None) -> list[Task]:
    """The tasks of the suite ``clawgym:PATH[?eval=FRACTION]`` (see the module docstring), sorted by
    id, only those of `split` when it is given."""
    path, eval_fraction = parse_spec(spec)
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not path.is_dir():
        raise TaskFormatError(f"{path}: not a directory")
    own_split = suite_spec.split_rule(split, eval_fraction)
    tasks, seen = [], {}
    for folder in _task_folders(path):
        task = load_clawgym_task(folder, own_split, suite=path)
        if task.id in seen:
            raise TaskFormatError(f"{folder / ENTRY_FILE}: field 'task_id': {task.id!r} is also the id of "
                                  f"{seen[task.id] / ENTRY_FILE}")
        seen[task.id] = folder
        if split is None or task.split == split:
            tasks.append(task)
    return sorted(tasks, key=lambda t: t.id)

"""Loading ClawGym-format task folders (the layout of ClawGym-Bench and ClawGym-Task; docs/TASKS.md).

    SUITE/
      task_0000/
        data_entry.json   {"task_id", "user_query", "input_mount_dir"?, "metadata": {"category", "grading_type"}}
        input_files/      copied verbatim into the workspace (optional)
        reward/           reward.sh (required: its last stdout line is the reward, a float in [0, 1]),
                          check.py and other helpers

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

Every problem raises `TaskFormatError` naming the folder and the field: a missing or unparsable
data_entry.json, a missing reward.sh, an unknown grading type, ``input_mount_dir`` without
``input_files/``, an unknown key, a sub-folder that is not a task folder, duplicate ids. Nothing is
skipped silently. Files are not read into memory: tasks refer to their folders, which must stay in place.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl

from clawfast.tasks.task import (
    DEFAULT_TASK_TIMEOUT,
    SPLITS,
    RewardScriptVerifier,
    Task,
    TaskFormatError,
    check_workdir_field,
)

PREFIX = "clawgym:"
ENTRY_FILE = "data_entry.json"
DEFAULT_MOUNT_DIR = "/root/.openclaw/workspace"
# Grading types whose reward.sh scores the workspace (the published suites hold only these).
GRADING_TYPES = ("automated",)
# ClawGym's own rollout gives reward.sh 120 s.
REWARD_TIMEOUT = 120.0
UNCATEGORIZED = "uncategorized"
_ENTRY_KEYS = {"task_id", "user_query", "input_mount_dir", "metadata"}


def parse_spec(spec: str) -> tuple[Path, float | None]:
    """``clawgym:PATH[?eval=FRACTION]`` -> (PATH, FRACTION or None). Raises ValueError."""
    if not spec.startswith(PREFIX):
        raise ValueError(f"{spec!r} is not a clawgym suite ({PREFIX}PATH)")
    body = spec[len(PREFIX):]
    path, _, query = body.partition("?")
    if not path:
        raise ValueError(f"{spec!r}: no path after {PREFIX}")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    unknown = sorted(set(options) - {"eval"})
    if unknown:
        raise ValueError(f"{spec!r}: unknown option {unknown[0]!r} (allowed: eval=FRACTION)")
    if "eval" not in options:
        return Path(path), None
    try:
        fraction = float(options["eval"])
    except ValueError:
        raise ValueError(f"{spec!r}: eval={options['eval']!r} is not a number") from None
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{spec!r}: eval={fraction} must lie strictly between 0 and 1")
    return Path(path), fraction


def hash_split(task_id: str, eval_fraction: float) -> str:
    """``eval`` or ``train`` for `task_id`, the same on every machine and in every run."""
    h = int.from_bytes(hashlib.sha256(task_id.encode("utf-8")).digest()[:8], "big")
    return "eval" if h / 2.0**64 < eval_fraction else "train"


def _fail(where: Path, name: str, problem: str) -> TaskFormatError:
    return TaskFormatError(f"{where}: field {name!r}: {problem}")


def _string(entry: dict[str, Any], where: Path, name: str, *, required: bool = True) -> str | None:
    if name not in entry:
        if required:
            raise _fail(where, name, "is required")
        return None
    value = entry[name]
    if not isinstance(value, str):
        raise _fail(where, name, f"must be a string, got {type(value).__name__}")
    return value


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
        raise _fail(where, unknown[0], f"unknown key (allowed: {', '.join(sorted(_ENTRY_KEYS))})")
    task_id = _string(entry, where, "task_id")
    user_query = _string(entry, where, "user_query")
    mount_dir = _string(entry, where, "input_mount_dir", required=False)
    metadata = entry.get("metadata")
    if not isinstance(metadata, dict):
        raise _fail(where, "metadata", "is required and must be an object" if metadata is None
                    else f"must be an object, got {type(metadata).__name__}")
    grading = metadata.get("grading_type")
    if grading not in GRADING_TYPES:
        raise _fail(where, "metadata.grading_type", f"{grading!r} is not supported (supported: "
                                                    f"{', '.join(GRADING_TYPES)})")
    category = metadata.get("category", "")
    if not isinstance(category, str):
        raise _fail(where, "metadata.category", f"must be a string, got {type(category).__name__}")

    inputs, reward = folder / "input_files", folder / "reward"
    if inputs.exists() and not inputs.is_dir():
        raise TaskFormatError(f"{folder}: input_files must be a directory")
    if mount_dir is not None and not inputs.is_dir():
        raise _fail(where, "input_mount_dir", f"is set but {inputs} does not exist")
    if not (reward / RewardScriptVerifier.ENTRY).is_file():
        raise TaskFormatError(f"{folder}: reward/{RewardScriptVerifier.ENTRY} is missing (every ClawGym task "
                              f"needs one)")
    check_workdir_field(where, "input_mount_dir", mount_dir)
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
        )
    except TaskFormatError as exc:
        raise TaskFormatError(f"{where}: {exc}") from None


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
    if eval_fraction is None:
        own_split: str | Callable[[str], str] = split or "train"
    else:
        own_split = lambda task_id: hash_split(task_id, eval_fraction)  # noqa: E731
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

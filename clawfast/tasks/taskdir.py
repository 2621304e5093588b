"""Loading a user's tasks from disk: one folder per task (format in docs/TASKS.md).

    my-tasks/
      fix-add/
        task.toml        id, instruction, timeout, [tags], [verifier], oracle
        workspace/       initial workspace files (optional; copied as they are, modes and links kept)
        verifier/        files the verifier command finds in $VERIFIER_DIR (optional)

`load_task_dir(path)` returns the tasks sorted by id. Every problem raises `TaskFormatError` naming
the task.toml and the field, or the folder: a non-hidden sub-folder without task.toml (a misnamed
``Task.toml``, say) is an error, not skipped; plain files such as a README are passed over. Unknown
keys are errors too, so a typo never silently falls back to a default. Files are not read into
memory: the task refers to its `workspace/` and `verifier/` folders, which must stay in place while
the task is used. The suite's folder is hidden from the
agent's sandbox (`Task.private_dirs`), so its verifier files stay out of its reach.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from clawfast.tasks.task import (
    DEFAULT_TASK_TIMEOUT,
    DEFAULT_VERIFIER_TIMEOUT,
    CommandVerifier,
    Task,
    TaskFormatError,
    field_error,
)

TASK_FILE = "task.toml"
_TOP_KEYS = {"id", "instruction", "timeout", "tags", "verifier", "oracle"}
_VERIFIER_KEYS = {"command", "timeout"}


def _get(data: dict[str, Any], where: str, name: str, kind: type | tuple[type, ...], *,
         required: bool = True, default: Any = None, prefix: str = "") -> Any:
    if name not in data:
        if required:
            raise field_error(where, prefix + name, "is required")
        return default
    value = data[name]
    # bool is an int subclass in Python; `timeout = true` is still a type error.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise field_error(where, prefix + name, f"must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", int: "a number", float: "a number", list: "a list", dict: "a table"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _unknown(data: dict[str, Any], allowed: set[str], where: str, prefix: str = "") -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise field_error(where, prefix + extra[0], f"unknown key (allowed: {', '.join(sorted(allowed))})")


def load_task(folder: Path | str, suite: Path | None = None) -> Task:
    """Load one task folder (holding task.toml); `suite` (default: the folder itself) is hidden from
    the agent's sandbox."""
    folder = Path(folder)
    toml_path = folder / TASK_FILE
    where = str(toml_path)
    try:
        with open(toml_path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise TaskFormatError(f"{where}: missing") from None
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"{where}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib raises this bare, without the file
        raise TaskFormatError(f"{where}: not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset "
                              f"{exc.start}") from None

    _unknown(data, _TOP_KEYS, where)
    task_id = _get(data, where, "id", str)
    instruction = _get(data, where, "instruction", str)
    timeout = _get(data, where, "timeout", (int, float), required=False, default=DEFAULT_TASK_TIMEOUT)
    tags = _get(data, where, "tags", dict)
    for key, value in tags.items():
        if not isinstance(value, str):
            raise field_error(where, f"tags.{key}", f"must be a string, got {type(value).__name__}")
    verifier = _get(data, where, "verifier", dict)
    _unknown(verifier, _VERIFIER_KEYS, where, "verifier.")
    command = _get(verifier, where, "command", str, prefix="verifier.")
    verifier_timeout = _get(verifier, where, "timeout", (int, float), required=False,
                            default=DEFAULT_VERIFIER_TIMEOUT, prefix="verifier.")
    oracle = _get(data, where, "oracle", list)
    for i, cmd in enumerate(oracle):
        if not isinstance(cmd, str):
            raise field_error(where, f"oracle[{i}]", f"must be a bash command string, got {type(cmd).__name__}")

    workspace_dir = folder / "workspace"
    verifier_dir = folder / "verifier"
    for path in (workspace_dir, verifier_dir):
        if path.exists() and not path.is_dir():
            raise TaskFormatError(f"{where}: {path.name}/ must be a directory")
    # Task validates the values themselves (id syntax, split, positive timeouts) and says which.
    try:
        return Task(
            id=task_id,
            instruction=instruction,
            verifier=CommandVerifier(command, directory=verifier_dir if verifier_dir.is_dir() else None,
                                     timeout=verifier_timeout),
            oracle=tuple(oracle),
            tags=tags,
            workspace_dir=workspace_dir if workspace_dir.is_dir() else None,
            timeout=timeout,
            private_dirs=(suite or folder,),
        )
    except TaskFormatError as exc:
        raise exc.at(where) from None


def _task_folders(path: Path) -> list[Path]:
    """The sub-folders of `path`, each of which must hold a task.toml: a task's files live in its own
    folder, so any other sub-folder is a mistake (a misnamed task file, a suite of suites), never a
    folder to skip. Hidden entries and plain files (a README) are not task folders and are passed over."""
    folders = []
    for child in sorted(path.iterdir()):
        if child.name.startswith(".") or not child.is_dir():
            continue
        if not (child / TASK_FILE).is_file():
            nested = any((grand / TASK_FILE).is_file() for grand in child.iterdir() if grand.is_dir())
            hint = f"; it holds task folders itself: point the suite at {child}" if nested else ""
            raise TaskFormatError(f"{child}: not a task folder: no {TASK_FILE}{hint}")
        folders.append(child)
    return folders


def load_task_dir(path: Path | str) -> list[Task]:
    """Load every task under `path`: each sub-folder is one task and must hold a task.toml (hidden
    entries and plain files are passed over); if `path` itself holds a task.toml it is loaded as a
    single task. Ids must be unique. Returns the tasks sorted by id."""
    path = Path(path)
    if not path.is_dir():
        raise TaskFormatError(f"{path}: not a directory")
    if (path / TASK_FILE).is_file():
        return [load_task(path)]
    folders = _task_folders(path)
    if not folders:
        raise TaskFormatError(f"{path}: no task folders (sub-folders holding {TASK_FILE})")
    tasks = [load_task(folder, suite=path) for folder in folders]
    seen: dict[str, Path] = {}
    for folder, task in zip(folders, tasks):
        if task.id in seen:
            raise TaskFormatError(f"{folder / TASK_FILE}: field 'id': {task.id!r} is also the id of "
                                  f"{seen[task.id] / TASK_FILE}")
        seen[task.id] = folder
    return sorted(tasks, key=lambda t: t.id)

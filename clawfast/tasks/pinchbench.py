"""Loading PinchBench suites (the format of the public ``pinchbench/skill`` repository; docs/TASKS.md).

    SUITE/
      tasks/task_XX_name.md   one task per file: YAML front matter, then Markdown sections
      assets/                 files the tasks' ``workspace_files`` copy into the workspace

A task file starts with a front matter between ``---`` lines: ``id``, ``name``, ``category``,
``grading_type`` (``automated`` | ``llm_judge`` | ``hybrid``), ``timeout_seconds``, optional
``workspace_files`` (a list of ``{source, dest}``, the source a file under ``assets/`` or under the
suite's root, or ``{path, content}`` written inline) and, for hybrid tasks, optional
``grading_weights: {automated: a, llm_judge: b}`` (default 0.5 / 0.5, as PinchBench scores them).
The body's ``## `` sections: ``Prompt`` (what the harness is told), ``Expected Behavior``,
``Grading Criteria``, ``Automated Checks`` (automated and hybrid: a fenced Python block defining
``grade(transcript, workspace_path) -> dict``, run by `GradeFunctionVerifier`; as in Markdown, only a
line that is just backticks closes the fence, so a ``` inside the code is code) and ``LLM Judge
Rubric`` (llm_judge and hybrid; without one the judge reads the grading criteria, as PinchBench's
runner does). A horizontal rule (``---``) closing a section is not part of it.

As a suite: ``pinchbench:PATH`` (PATH is the suite's root, holding ``tasks/``) with options
``?eval=FRACTION`` (a hash split by task id, as for ``clawgym:``; without it the suite is one split,
given to whichever split is asked for) and ``exclude=ID,ID`` (tasks left out by name, e.g. the
multi-session tasks clawfast cannot run: one rollout is one harness session).

Tags: ``category``, ``grading_type``, ``split`` and ``suite = pinchbench``. Every problem raises
`TaskFormatError` naming the file and the field; nothing is skipped silently. The suite's root is
hidden from the agent's sandbox (its task files hold the graders). Workspace files are read when the
suite loads (PinchBench's assets are small).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import yaml

from clawfast.tasks import suite_spec
from clawfast.tasks.task import SPLITS, GradeFunctionVerifier, Rubric, Task, TaskFormatError, field_error

PREFIX = "pinchbench:"
TASKS_DIR = "tasks"
ASSETS_DIR = "assets"
GRADING_TYPES = ("automated", "llm_judge", "hybrid")
# PinchBench's own default split of a hybrid task's score.
DEFAULT_WEIGHTS = {"automated": 0.5, "llm_judge": 0.5}
# The grader of a task file gets as long as PinchBench's judge would; its own code is quick.
GRADE_TIMEOUT = 120.0
_KEYS = {"id", "name", "category", "grading_type", "timeout_seconds", "workspace_files", "grading_weights",
         "multi_session", "sessions"}
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)(.*)\Z", re.DOTALL)
_SECTION = re.compile(r"^## +(.+?)\s*$")
_RULE = re.compile(r"^\s*(?:-{3,}|\*{3,}|_{3,})\s*$")
# A fence closes only on a line that is just backticks (Markdown's rule): a ``` inside the code, in a
# string say, is code.
_FENCE_CLOSE = re.compile(r"^[ \t]*```+[ \t]*$")
_PYTHON_BLOCK = re.compile(r"^[ \t]*```python[^\n]*\n(.*?)^[ \t]*```+[ \t]*$", re.DOTALL | re.MULTILINE)


def parse_spec(spec: str) -> tuple[Path, float | None, frozenset[str]]:
    """``pinchbench:PATH[?eval=FRACTION][&exclude=ID,ID]`` -> (PATH, FRACTION or None, excluded ids)."""
    path, options = suite_spec.parse_spec(spec, PREFIX, {"eval": "eval=FRACTION", "exclude": "exclude=ID,ID"})
    excluded = frozenset(x for x in options.get("exclude", "").split(",") if x)
    return path, suite_spec.eval_fraction(spec, options), excluded


def split_sections(body: str) -> dict[str, str]:
    """The ``## Title`` sections of a task body: title -> text, stripped, without a closing rule.
    Text before the first section (a ``# Task`` heading) belongs to none."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    fenced = False
    for line in body.splitlines():
        if not fenced and line.lstrip().startswith("```"):
            fenced = True
        elif fenced and _FENCE_CLOSE.match(line):
            fenced = False
        match = None if fenced else _SECTION.match(line)
        if match:
            current = sections.setdefault(match.group(1), [])
        elif current is not None:
            current.append(line)
    out = {}
    for title, lines in sections.items():
        while lines and (not lines[-1].strip() or _RULE.match(lines[-1])):
            lines.pop()
        out[title] = "\n".join(lines).strip()
    return out


def _front_matter(path: Path) -> tuple[dict[str, Any], str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFormatError(f"{path}: not UTF-8 text: {exc}") from None
    match = _FRONT_MATTER.match(text)
    if match is None:
        raise TaskFormatError(f"{path}: no front matter (the file must start with a YAML block between '---' lines)")
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        raise TaskFormatError(f"{path}: front matter is not valid YAML: {exc}") from None
    if not isinstance(meta, dict):
        raise TaskFormatError(f"{path}: front matter must be a mapping, got {type(meta).__name__}")
    return meta, match.group(2)


def _string(meta: dict[str, Any], where: Path, name: str) -> str:
    value = meta.get(name)
    if not isinstance(value, str) or not value.strip():
        raise field_error(where, name, "is required" if value is None else f"must be a non-empty string, got {value!r}")
    return value.strip()


def _inside(root: Path, rel: str, where: Path, name: str) -> Path:
    parts = PurePosixPath(rel).parts
    if not rel or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise field_error(where, name, f"{rel!r} must be a relative path without '..'")
    return root.joinpath(*parts)


def _workspace_files(meta: dict[str, Any], root: Path, where: Path) -> dict[str, bytes]:
    entries = meta.get("workspace_files") or []
    if not isinstance(entries, list):
        raise field_error(where, "workspace_files", f"must be a list, got {type(entries).__name__}")
    files: dict[str, bytes] = {}
    for i, entry in enumerate(entries):
        name = f"workspace_files[{i}]"
        if not isinstance(entry, dict):
            raise field_error(where, name, f"must be a mapping, got {type(entry).__name__}")
        if set(entry) == {"path", "content"}:
            if not isinstance(entry["path"], str) or not isinstance(entry["content"], str):
                raise field_error(where, name, "path and content must be strings")
            _inside(root, entry["path"], where, f"{name}.path")
            files[entry["path"]] = entry["content"].encode("utf-8")
            continue
        if set(entry) != {"source", "dest"} or not all(isinstance(entry[k], str) for k in entry):
            raise field_error(where, name, f"must be {{source, dest}} or {{path, content}} of strings, got keys "
                                           f"{sorted(entry)}")
        _inside(root, entry["dest"], where, f"{name}.dest")
        # PinchBench's runner reads sources under assets/; suites that name them from their root
        # ("assets/x.csv") are read there.
        candidates = [_inside(root / ASSETS_DIR, entry["source"], where, f"{name}.source"),
                      _inside(root, entry["source"], where, f"{name}.source")]
        source = next((c for c in candidates if c.is_file()), None)
        if source is None:
            raise field_error(where, f"{name}.source", f"{entry['source']!r} is not a file (looked at "
                                                       f"{' and '.join(str(c) for c in candidates)})")
        files[entry["dest"]] = source.read_bytes()
    return files


def _weights(meta: dict[str, Any], grading: str, where: Path) -> float:
    """The judged share of the task's score."""
    if grading != "hybrid":
        if "grading_weights" in meta:
            raise field_error(where, "grading_weights", f"is only for hybrid tasks, not {grading}")
        return {"automated": 0.0, "llm_judge": 1.0}[grading]
    weights = meta.get("grading_weights", DEFAULT_WEIGHTS)
    if not isinstance(weights, dict) or set(weights) - set(DEFAULT_WEIGHTS):
        raise field_error(where, "grading_weights",
                          f"must be a mapping with keys automated and llm_judge, got {weights!r}")
    values = {k: weights.get(k, DEFAULT_WEIGHTS[k]) for k in DEFAULT_WEIGHTS}
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in values.values()):
        raise field_error(where, "grading_weights", f"weights must be non-negative numbers, got {weights!r}")
    total = values["automated"] + values["llm_judge"]
    if total <= 0 or values["llm_judge"] == 0 or values["automated"] == 0:
        raise field_error(where, "grading_weights", f"a hybrid task weighs both parts above 0, got {weights!r}")
    return values["llm_judge"] / total


def load_pinchbench_task(path: Path | str, root: Path, split: str | Callable[[str], str]) -> Task:
    """One PinchBench task file of the suite at `root`, as a task of `split` (or of `split(id)`)."""
    path = Path(path)
    return _task_of(path, *_front_matter(path), root, split)


def _task_of(path: Path, meta: dict[str, Any], body: str, root: Path, split: str | Callable[[str], str]) -> Task:
    """The task of the file at `path`, from its front matter and body."""
    unknown = sorted(set(meta) - _KEYS)
    if unknown:
        raise field_error(path, unknown[0], f"unknown key (allowed: {', '.join(sorted(_KEYS))})")
    if meta.get("multi_session") or "sessions" in meta:
        raise field_error(path, "multi_session", "a multi-session task runs several harness sessions on one workspace; "
                                                 "a clawfast rollout is one session: leave it out with "
                                                 f"{PREFIX}PATH?exclude={meta.get('id', 'ID')}")
    task_id = _string(meta, path, "id")
    category = _string(meta, path, "category")
    grading = meta.get("grading_type")
    if grading not in GRADING_TYPES:
        raise field_error(path, "grading_type", f"{grading!r} is not one of {', '.join(GRADING_TYPES)}")
    timeout = meta.get("timeout_seconds")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise field_error(path, "timeout_seconds", f"must be a positive number, got {timeout!r}")
    sections = split_sections(body)
    prompt = sections.get("Prompt", "")
    if not prompt:
        raise field_error(path, "## Prompt", "the section is missing or empty")
    judged = _weights(meta, grading, path)

    verifier = None
    if grading in ("automated", "hybrid"):
        checks = sections.get("Automated Checks")
        if not checks:
            raise field_error(path, "## Automated Checks", f"is required for a {grading} task")
        blocks = _PYTHON_BLOCK.findall(checks)
        if len(blocks) != 1:
            raise field_error(path, "## Automated Checks", f"must hold one ```python block, found {len(blocks)}")
        verifier = GradeFunctionVerifier(code=blocks[0], timeout=GRADE_TIMEOUT)
    rubric = None
    if judged > 0:
        text = sections.get("LLM Judge Rubric") or sections.get("Grading Criteria")
        if not text:
            raise field_error(path, "## LLM Judge Rubric", f"a {grading} task needs a rubric (or ## Grading Criteria)")
        rubric = Rubric(text=text, weight=judged, expected=sections.get("Expected Behavior", ""))
    try:
        return Task(
            id=task_id, instruction=prompt, verifier=verifier, rubric=rubric, oracle=(),
            tags={"category": category, "grading_type": grading,
                  "split": split(task_id) if callable(split) else split, "suite": "pinchbench"},
            files=_workspace_files(meta, root, path), timeout=float(timeout), private_dirs=(root,),
        )  # fmt: skip
    except TaskFormatError as exc:
        raise exc.at(path) from None


def load_pinchbench(spec: str, split: str | None = None) -> list[Task]:
    """The tasks of the suite ``pinchbench:PATH[?eval=FRACTION][&exclude=ID,ID]`` (see the module
    docstring), sorted by id, only those of `split` when it is given."""
    root, eval_fraction, excluded = parse_spec(spec)
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tasks_dir = root / TASKS_DIR
    if not tasks_dir.is_dir():
        raise TaskFormatError(f"{root}: no {TASKS_DIR}/ folder (a PinchBench suite holds tasks/*.md)")
    own_split = suite_spec.split_rule(split, eval_fraction)
    # The template PinchBench ships beside its tasks is documentation, not a task.
    files = [p for p in sorted(tasks_dir.glob("*.md")) if p.name != "TASK_TEMPLATE.md"]
    if not files:
        raise TaskFormatError(f"{tasks_dir}: no task files (*.md)")
    tasks, seen, found = [], {}, set()
    for path in files:
        meta, body = _front_matter(path)
        # The id is read before the rest is checked, so an excluded task may hold what clawfast cannot load.
        declared = meta["id"].strip() if isinstance(meta.get("id"), str) else None
        if declared in excluded:
            found.add(declared)
            continue
        task = _task_of(path, meta, body, root, own_split)
        if task.id in seen:
            raise field_error(path, "id", f"{task.id!r} is also the id of {seen[task.id]}")
        seen[task.id] = path
        if split is None or task.split == split:
            tasks.append(task)
    missing = sorted(excluded - found)
    if missing:
        raise ValueError(f"{spec!r}: exclude names {', '.join(missing)}, which no task file has as its id")
    return sorted(tasks, key=lambda t: t.id)


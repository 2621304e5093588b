"""clawbench-mini: size, determinism, fixed split, and every task sound (oracle 1.0, do-nothing 0.0)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import pytest

from clawfast.tasks import check_task, clawbench_mini, load_suite, run_commands, run_verifier
from clawfast.tasks.mini import CATEGORIES, FILTER_COLUMNS, LINE_MARKERS, LOG_LEVELS, SUM_COLUMNS

# The published split of seed 0. Changing it invalidates every eval number reported so far.
EVAL_IDS = {
    "code-count-vowels-1", "code-largest-0", "code-scale-0", "code-shout-1",
    "data-count-0", "data-count-1", "data-filter-0", "data-group-sum-0",
    "files-append-1", "files-create-0", "files-delete-line-1", "files-replace-1",
    "shell-chmod-0", "shell-json-set-0", "shell-rename-2", "shell-symlink-0",
}


def _fingerprint(tasks) -> str:
    """Everything that defines the suite's content, except the checker source (checks.py may be
    fixed without changing any task)."""
    h = hashlib.sha256()
    for t in tasks:
        vfiles = {k: hashlib.sha256(v).hexdigest() for k, v in t.verifier.files.items() if k != "checks.py"}
        files = {k: hashlib.sha256(v).hexdigest() for k, v in t.files.items()}
        h.update(json.dumps([t.id, t.instruction, files, list(t.oracle), t.tags, vfiles, t.verifier.command,
                             t.timeout], sort_keys=True).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def suite():
    return clawbench_mini()


def test_size_categories_and_unique_ids(suite):
    assert len(suite) == 64
    assert len({t.id for t in suite}) == 64
    assert Counter(t.category for t in suite) == {c: 16 for c in CATEGORIES}
    assert Counter(t.split for t in suite) == {"train": 48, "eval": 16}
    assert Counter(t.category for t in suite if t.split == "eval") == {c: 4 for c in CATEGORIES}
    # Both splits hold easy tasks: a briefly trained tiny model must be able to score on eval.
    for split in ("train", "eval"):
        assert {t.tags["difficulty"] for t in suite if t.split == split} == {"easy", "medium", "hard"}


def test_split_is_the_published_one(suite):
    assert {t.id for t in suite if t.split == "eval"} == EVAL_IDS
    assert {t.id for t in load_suite("clawbench-mini", "eval")} == EVAL_IDS
    assert len(load_suite("clawbench-mini", "train")) == 48


def test_deterministic_from_seed(suite):
    assert _fingerprint(clawbench_mini(0)) == _fingerprint(suite)
    other = clawbench_mini(1)
    assert [t.id for t in other] == [t.id for t in suite]
    assert {t.id for t in other if t.split == "eval"} == EVAL_IDS  # split depends on ids only
    assert _fingerprint(other) != _fingerprint(suite)
    # Another seed changes the content of most tasks, not just one.
    assert sum(a.instruction != b.instruction or a.files != b.files for a, b in zip(suite, other)) > 40


def test_no_argument_value_is_tied_to_a_slot():
    """A template's argument values are drawn per instance: were a value tied to a slot (slot k of
    data-count always counting ERROR), an eval slot would ask for a value no training slot of any
    seed ever shows, and held-out tasks would test that value instead of the trained skill."""
    values = {"data-count": LOG_LEVELS, "files-delete-line": LINE_MARKERS, "data-sum": SUM_COLUMNS,
              "data-filter": FILTER_COLUMNS}
    seen: dict[str, set] = {}
    for seed in range(32):
        for t in clawbench_mini(seed):
            template = t.id.rsplit("-", 1)[0]
            if template in values:  # whole words: "grades.csv" names a file, not the grade column
                words = set(re.findall(r"\w+", t.instruction))
                seen.setdefault(t.id, set()).update(v for v in values[template] if v in words)
    assert len(seen) == 10
    for task_id, found in seen.items():
        assert found == set(values[task_id.rsplit("-", 1)[0]]), task_id


def test_oracles_are_bash_command_lists(suite):
    for t in suite:
        assert t.oracle and all(isinstance(c, str) and c.strip() for c in t.oracle), t.id
        assert len(t.instruction) <= 110, t.id
        if t.tags["difficulty"] == "easy":
            assert len(t.oracle) == 1 and "\n" not in t.oracle[0] and len(t.oracle[0]) <= 45, t.id
    very_short = [t for t in suite if t.tags["template"] == "create"]
    assert len(very_short) >= 4 and all(t.oracle[0].startswith("echo ") for t in very_short)


def test_every_oracle_scores_one_and_doing_nothing_scores_zero(suite):
    failures = []
    for t in suite:
        c = check_task(t)
        if not c.sound:
            failures.append((t.id, c.oracle_run.ok, c.oracle.score, c.oracle.error, c.oracle.details,
                             c.nothing.score, c.nothing.error))
    assert failures == []


def test_a_sibling_task_oracle_does_not_solve_a_task(suite, tmp_path):
    """Verifiers are specific: replaying the oracle of another instance of the same template (different
    file names, words or numbers) must not score 1."""
    by_template: dict[str, list] = {}
    for t in suite:
        by_template.setdefault(f"{t.category}/{t.tags['template']}", []).append(t)
    for name, tasks in by_template.items():
        a, b = tasks[0], tasks[1]
        ws = b.materialize(tmp_path / b.id)
        run_commands(a.oracle, ws)
        result = run_verifier(b, ws)
        assert result.status == "ok" and result.score == 0.0, (name, result.details)

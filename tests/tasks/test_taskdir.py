"""User task directories: loading, using them like built-in tasks, and clear errors for bad task.toml."""

from __future__ import annotations

import os
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from clawfast.tasks import TaskFormatError, check_task, load_suite, load_task_dir, run_verifier

GOOD_TOML = textwrap.dedent('''\
    id = "fix-add"
    instruction = "Fix add() in calc.py so that the tests pass."
    timeout = 120
    oracle = ["sed -i 's/a - b/a + b/' calc.py"]

    [tags]
    category = "code"
    split = "eval"
    difficulty = "easy"

    [verifier]
    command = "python3 $VERIFIER_DIR/score.py"
    timeout = 10
''')

SCORE_PY = textwrap.dedent('''\
    import json, subprocess, sys
    ok = subprocess.run([sys.executable, "-c", "from calc import add; assert add(2, 3) == 5"]).returncode == 0
    print(json.dumps({"score": 1.0 if ok else 0.0, "details": {"ok": ok}}))
''')


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def task_root(tmp_path: Path) -> Path:
    root = tmp_path / "my-tasks"
    _write(root / "fix-add" / "task.toml", GOOD_TOML)
    _write(root / "fix-add" / "workspace" / "calc.py", "def add(a, b):\n    return a - b\n")
    _write(root / "fix-add" / "verifier" / "score.py", SCORE_PY)
    # A second task: an executable initial file and a symlink, which must survive materialize.
    t2 = root / "make-link"
    _write(t2 / "task.toml", textwrap.dedent('''\
        id = "make-link"
        instruction = "Point the link current at v2.sh and keep run.sh executable."
        oracle = ["ln -sfn v2.sh current"]
        tags = { category = "shell", split = "train" }
        [verifier]
        command = 'test "$(readlink current)" = v2.sh && test -x run.sh && echo "{\\"score\\": 1}" || echo "{\\"score\\": 0}"'
    '''))
    _write(t2 / "workspace" / "run.sh", "#!/bin/sh\necho hi\n")
    os.chmod(t2 / "workspace" / "run.sh", 0o755)
    _write(t2 / "workspace" / "v1.sh", "v1\n")
    _write(t2 / "workspace" / "v2.sh", "v2\n")
    os.symlink("v1.sh", t2 / "workspace" / "current")
    (root / "README.txt").write_text("not a task")  # stray entries are ignored
    return root


def test_load_and_check_a_task_directory(task_root, tmp_path):
    tasks = load_task_dir(task_root)
    assert [t.id for t in tasks] == ["fix-add", "make-link"]
    fix, link = tasks
    assert fix.timeout == 120 and fix.verifier.timeout == 10 and link.timeout == 600
    assert fix.tags == {"category": "code", "split": "eval", "difficulty": "easy"}
    assert fix.oracle == ("sed -i 's/a - b/a + b/' calc.py",)
    ws = link.materialize(tmp_path / "ws")
    assert os.readlink(ws / "current") == "v1.sh" and os.stat(ws / "run.sh").st_mode & stat.S_IXUSR
    for t in tasks:
        c = check_task(t)
        assert c.sound, (t.id, c.oracle, c.nothing)
    assert run_verifier(fix, fix.materialize(tmp_path / "again")).details == {"ok": False}


def test_suite_lookup_and_split_filter(task_root):
    assert [t.id for t in load_suite(task_root, "eval")] == ["fix-add"]
    assert [t.id for t in load_suite(str(task_root), "train")] == ["make-link"]
    assert [t.id for t in load_task_dir(task_root / "fix-add")] == ["fix-add"]  # a single task folder
    with pytest.raises(ValueError, match="unknown suite"):
        load_suite(task_root / "nope")
    with pytest.raises(ValueError, match="split"):
        load_suite(task_root, "test")


@pytest.mark.parametrize("old, new, field", [
    ('id = "fix-add"\n', "", "'id': is required"),
    ('id = "fix-add"', 'id = "fix add!"', "'id': must match"),
    ('id = "fix-add"', "id = 3", "'id': must be a string, got int"),
    ('instruction = "Fix add() in calc.py so that the tests pass."', 'instruction = "  "', "'instruction'"),
    ("timeout = 120", "timeout = -5", "'timeout': must be a positive"),
    ("timeout = 120", 'timeout = "2m"', "'timeout': must be a number, got str"),
    ("timeout = 120", "timeout = true", "'timeout': must be a number, got bool"),
    ("timeout = 120", "timeout = 120\ninstructions = 'typo'", "'instructions': unknown key"),
    ('split = "eval"', 'split = "test"', "'tags.split': must be one of"),
    ('category = "code"\n', "", "'tags.category': is required"),
    ("difficulty = \"easy\"", "difficulty = 1", "'tags.difficulty': must be a string"),
    ('command = "python3 $VERIFIER_DIR/score.py"', "", "'verifier.command': is required"),
    ("timeout = 10", "timeout = 0", "'verifier.timeout': must be a positive"),
    ("timeout = 10", "timeoutt = 10", "'verifier.timeoutt': unknown key"),
    ("oracle = [\"sed -i 's/a - b/a + b/' calc.py\"]", 'oracle = "echo hi"', "'oracle': must be a list"),
    ("oracle = [\"sed -i 's/a - b/a + b/' calc.py\"]", "oracle = ['ok', 2]", "'oracle[1]': must be a bash"),
    ("[verifier]", "[verifierr]", "unknown key"),
    ('id = "fix-add"', 'id = "fix-add', "invalid TOML"),
    # `$` also matches before a final newline: the id is matched in full.
    ('id = "fix-add"', 'id = "fix-add\\n"', "'id': must match"),
    # Loads, then fails every rollout at exec: no argv string can carry a NUL.
    ('instruction = "Fix add()', 'instruction = "Fix\\u0000 add()', "'instruction': holds a NUL character at index 3"),
])
def test_malformed_task_toml_names_the_field(task_root, old, new, field):
    toml = task_root / "fix-add" / "task.toml"
    assert old in toml.read_text()
    toml.write_text(toml.read_text().replace(old, new, 1))
    with pytest.raises(TaskFormatError) as info:
        load_task_dir(task_root)
    # One shape whichever check caught it (the file's reader or Task's own): the file, then the field.
    message = str(info.value)
    assert message.startswith(f"{toml}: ") and "task '" not in message
    assert f"{toml}: field {field}" in message if field.startswith("'") else field in message


def test_structural_errors(task_root, tmp_path):
    with pytest.raises(TaskFormatError, match="no task folders"):
        load_task_dir(tmp_path / "my-tasks" / "make-link" / "workspace")
    with pytest.raises(TaskFormatError, match="not a directory"):
        load_task_dir(tmp_path / "missing")
    dup = task_root / "copy"
    _write(dup / "task.toml", (task_root / "fix-add" / "task.toml").read_text())
    with pytest.raises(TaskFormatError, match="'fix-add' is also the id of"):
        load_task_dir(task_root)
    (dup / "task.toml").unlink()
    dup.rmdir()
    (task_root / "fix-add" / "verifier" / "score.py").unlink()
    (task_root / "fix-add" / "verifier").rmdir()
    (task_root / "fix-add" / "verifier").write_text("oops")
    with pytest.raises(TaskFormatError, match="verifier/ must be a directory"):
        load_task_dir(task_root)


def test_an_instruction_longer_than_one_argv_string_is_refused_at_load(task_root):
    from clawfast.tasks.task import MAX_INSTRUCTION_BYTES

    toml = task_root / "fix-add" / "task.toml"
    text = toml.read_text()
    old = 'instruction = "Fix add() in calc.py so that the tests pass."'
    # 'é' is two bytes in UTF-8: the limit is on bytes, as exec counts them.
    for size, ok in [(MAX_INSTRUCTION_BYTES, True), (MAX_INSTRUCTION_BYTES + 1, False)]:
        instruction = "é" * (size // 2) + "x" * (size % 2)
        toml.write_text(text.replace(old, f'instruction = "{instruction}"'))
        if ok:
            [task] = [t for t in load_task_dir(task_root) if t.id == "fix-add"]
            # What sandbox.run ends up exec'ing: one argv string of that size, which exec takes.
            assert subprocess.run(["/bin/true", task.instruction]).returncode == 0
        else:
            with pytest.raises(TaskFormatError, match=f"'instruction': is {size} bytes in UTF-8"):
                load_task_dir(task_root)


def test_a_task_toml_that_is_not_utf8_names_its_file(task_root):
    toml = task_root / "fix-add" / "task.toml"
    toml.write_bytes(toml.read_bytes() + b"# caf\xe9\n")
    with pytest.raises(TaskFormatError, match=f"^{toml}: not UTF-8 text: byte 0xe9"):
        load_task_dir(task_root)


def test_a_sub_folder_without_task_toml_is_an_error_not_a_skip(task_root):
    # Hidden folders and plain files are passed over (README.txt is in the fixture).
    (task_root / ".git").mkdir()
    assert [t.id for t in load_task_dir(task_root)] == ["fix-add", "make-link"]
    typo = task_root / "copy"
    _write(typo / "Task.toml", (task_root / "fix-add" / "task.toml").read_text())
    with pytest.raises(TaskFormatError, match=f"^{typo}: not a task folder: no task.toml$"):
        load_task_dir(task_root)
    # A folder of suites says which one to use.
    _write(typo / "inner" / "task.toml", "")
    with pytest.raises(TaskFormatError, match=f"holds task folders itself: point the suite at {typo}"):
        load_task_dir(task_root)

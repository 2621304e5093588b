"""`clawfast tasks list|check` through the real CLI dispatcher."""

from __future__ import annotations

import json
import textwrap

from clawfast.cli import main

from .test_mini_suite import EVAL_IDS


def test_list_json_eval(capsys):
    assert main(["tasks", "list", "--split", "eval", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {t["id"] for t in listed} == EVAL_IDS
    first = next(t for t in listed if t["id"] == "files-create-0")
    assert first["oracle"] == ["echo honey > note.txt"] and first["tags"]["split"] == "eval"


def test_list_table(capsys):
    assert main(["tasks", "list", "--suite", "clawbench-mini"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["id", "split", "category", "difficulty", "instruction"]
    assert "64 tasks" in out and "code-largest-0" in out


def _task(root, name, oracle):
    d = root / name
    (d / "workspace").mkdir(parents=True)
    (d / "task.toml").write_text(textwrap.dedent(f'''\
        id = "{name}"
        instruction = "Create hello.txt containing exactly: hi"
        oracle = [{json.dumps(oracle)}]
        tags = {{ category = "files", split = "train" }}
        [verifier]
        command = 'test "$(cat hello.txt)" = hi && echo "{{\\"score\\": 1}}" || echo "{{\\"score\\": 0}}"'
        timeout = 5
    '''))


def test_check_a_user_directory(tmp_path, capsys):
    _task(tmp_path, "good", "echo hi > hello.txt")
    assert main(["tasks", "check", "--suite", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1/1 tasks sound" in out
    _task(tmp_path, "bad", "echo ho > hello.txt")
    assert main(["tasks", "check", "--suite", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == 1
    bad = next(r for r in report["tasks"] if r["id"] == "bad")
    assert bad["oracle"] == 0.0 and bad["problem"] == "oracle below 1"


def test_bad_suite_is_exit_2(tmp_path, capsys):
    assert main(["tasks", "list", "--suite", str(tmp_path / "nope")]) == 2
    assert "unknown suite" in capsys.readouterr().err
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "task.toml").write_text("id = 1\n")
    assert main(["tasks", "list", "--suite", str(tmp_path)]) == 2
    assert "field 'id'" in capsys.readouterr().err

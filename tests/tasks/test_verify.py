"""The verifier protocol and runner: scores, and every way a verifier can fail -> verifier_error."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from clawfast.tasks import (
    CallableVerifier,
    CommandVerifier,
    Task,
    VerifierResult,
    parse_score_line,
    run_verifier,
)
from clawfast.tasks.mini import VERIFIER_COMMAND, _checks_source

TAGS = {"category": "test", "split": "train"}


def _task(command: str = "", *, files=None, verifier_files=None, timeout=10.0, fn=None) -> Task:
    verifier = CallableVerifier(fn) if fn else CommandVerifier(command, files=verifier_files or {},
                                                               timeout=timeout)
    return Task(id="t", instruction="do it", verifier=verifier, oracle=(), tags=TAGS, files=files or {})


def _score(task: Task, tmp_path: Path) -> VerifierResult:
    ws = task.materialize(tmp_path / "ws")
    return run_verifier(task, ws)


# ------------------------------------------------------------------------------ protocol parsing

def test_parse_takes_the_last_non_empty_line():
    assert parse_score_line('log line\n{"score": 0.0}\n{"score": 0.25, "details": {"a": 1}}\n\n') == (
        0.25, {"a": 1})
    assert parse_score_line('{"score": 1}') == (1.0, {})


@pytest.mark.parametrize("stdout, why", [
    ("", "nothing"),
    ("all good\n", "not JSON"),
    ('{"score": 1}\ntrailing words', "not JSON"),
    ("[1, 2]", "not a score object"),
    ('{"details": {}}', "not a score object"),
    ('{"score": "1"}', "finite number"),
    ('{"score": true}', "finite number"),
    ('{"score": NaN}', "finite number"),
    ('{"score": 1.5}', "[0, 1]"),
    ('{"score": -0.1}', "[0, 1]"),
    ('{"score": 1, "details": [1]}', "details must be an object"),
    # An integer no float holds: math.isfinite would raise OverflowError, not answer.
    ('{"score": 1' + "0" * 400 + "}", "finite number"),
    # Anything in the line a strict-JSON record cannot hold, details included.
    ('{"score": 1, "details": {"loss": NaN}}', "NaN is not a finite number"),
    ('{"score": 1, "details": {"loss": -Infinity}}', "Infinity is not a finite number"),
    ('{"score": 1, "details": {"loss": 1e999}}', "past a float's range"),
    ('{"score": 1, "details": ' + "[" * 100_000, "not JSON"),  # too deep for json to parse
])
def test_parse_rejects_malformed_output(stdout, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        parse_score_line(stdout)


@settings(max_examples=100, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_parse_accepts_exactly_finite_scores_in_unit_interval(x):
    line = json.dumps({"score": x})
    if math.isfinite(x) and 0.0 <= x <= 1.0:
        assert parse_score_line(line)[0] == x
    else:
        with pytest.raises(ValueError):
            parse_score_line(line)


# ------------------------------------------------------------------------------ command verifiers

def test_command_verifier_scores_and_sees_its_files(tmp_path):
    task = _task('test "$(cat a.txt)" = "$(cat "$VERIFIER_DIR/want.txt")" && echo \'{"score": 0.75}\' '
                 '|| echo \'{"score": 0}\'', files={"a.txt": "x\n"}, verifier_files={"want.txt": "x\n"})
    res = _score(task, tmp_path)
    assert (res.status, res.score, res.error) == ("ok", 0.75, None)


def test_verifier_files_are_not_in_the_workspace(tmp_path):
    task = _task('test -e want.txt && echo \'{"score": 0}\' || echo \'{"score": 1}\'',
                 verifier_files={"want.txt": "secret"})
    assert _score(task, tmp_path).score == 1.0


def test_verifier_works_on_a_copy(tmp_path):
    task = _task("rm -rf ./* && echo '{\"score\": 1}'", files={"keep.txt": "data"})
    ws = task.materialize(tmp_path / "ws")
    assert run_verifier(task, ws).score == 1.0
    assert (ws / "keep.txt").read_text() == "data"


@pytest.mark.parametrize("command, error", [
    ("python3 -c 'raise RuntimeError(\"boom in verifier\")'", "exited with status 1"),
    ("echo '{\"score\": 1}'; exit 3", "exited with status 3"),
    ("echo 'looks fine to me'", "not JSON"),
    ("echo '{\"score\": 7}'", "[0, 1]"),
    ("true", "printed nothing"),
    ("kill -9 $$", "exited with status"),
])
def test_broken_verifier_scores_zero_with_verifier_error(tmp_path, command, error):
    res = _score(_task(command), tmp_path)
    assert res.status == "verifier_error" and res.score == 0.0
    assert error in res.error


def test_verifier_stderr_is_kept(tmp_path):
    res = _score(_task("python3 -c 'raise RuntimeError(\"boom in verifier\")'"), tmp_path)
    assert "RuntimeError: boom in verifier" in res.stderr


def test_verifier_timeout_kills_its_whole_process_group(tmp_path):
    marker = tmp_path / "marker"
    # A background child that would outlive the verifier and write outside its scratch copy.
    task = _task(f"(sleep 1.5; touch {marker}) & sleep 30", timeout=0.5)
    start = time.monotonic()
    res = _score(task, tmp_path)
    assert time.monotonic() - start < 10
    assert res.status == "verifier_error" and res.score == 0.0 and "timed out" in res.error
    time.sleep(2.0)
    assert not marker.exists()


def test_verifier_lines_no_record_can_hold_are_verifier_errors(tmp_path):
    from clawfast.records import encode_result

    lines = ['{"score": 1' + "0" * 400 + "}", '{"score": 1.0, "details": {"passed": 3, "loss": NaN}}']
    for i, line in enumerate(lines):
        res = _score(_task(f"echo '{line}'"), tmp_path / str(i))
        assert (res.status, res.score) == ("verifier_error", 0.0), res
        encode_result(res.score, res.status, {"verifier": res.to_json()})  # the rollout record holds it


def test_subscores_reject_what_a_float_cannot_hold():
    from clawfast.tasks.verify import parse_subscores

    assert parse_subscores('{"a": 1, "b": true, "c": 0.5}') == {"a": 1.0, "b": 1.0, "c": 0.5}
    for line in ['{"a": 1' + "0" * 400 + "}", '{"a": NaN}', '{"a": 1e999}']:
        with pytest.raises(ValueError, match="finite number"):
            parse_subscores(line)


def test_huge_output_is_bounded(tmp_path):
    res = _score(_task("head -c 5000000 /dev/zero | tr '\\0' x >&2; echo '{\"score\": 1}'"), tmp_path)
    assert res.score == 1.0 and 0 < len(res.stderr) <= 8192


def test_fifo_in_workspace_does_not_hang(tmp_path):
    task = _task("test -e pipe && echo '{\"score\": 0}' || echo '{\"score\": 1}'")
    ws = task.materialize(tmp_path / "ws")
    os.mkfifo(ws / "pipe")
    assert run_verifier(task, ws).score == 1.0


def test_a_batch_of_broken_verifiers_never_raises(tmp_path):
    commands = ["exit 1", "echo garbage", "echo '{\"score\": 1}'", "echo '{\"score\": 0.5}'", "sleep 5"]
    results = [run_verifier(t, t.materialize(tmp_path / str(i)))
               for i, t in enumerate(_task(c, timeout=0.3) for c in commands)]
    assert [r.score for r in results] == [0.0, 0.0, 1.0, 0.5, 0.0]
    assert [r.status for r in results] == ["verifier_error"] * 2 + ["ok"] * 2 + ["verifier_error"]


# ----------------------------------------------------------------------------- callable verifiers

def test_callable_verifier_forms(tmp_path):
    def reads(ws: Path) -> VerifierResult:
        return VerifierResult(score=float((ws / "a").read_text() == "1"), details={"n": 1})

    assert _score(_task(fn=reads, files={"a": "1"}), tmp_path / "a").score == 1.0
    assert _score(_task(fn=lambda ws: 0.5), tmp_path / "b").score == 0.5


@pytest.mark.parametrize("fn, error", [
    (lambda ws: 1 / 0, "ZeroDivisionError"),
    (lambda ws: 2.0, "[0, 1]"),
    (lambda ws: "1.0", "[0, 1]"),
    (lambda ws: VerifierResult(score=0.3, status="weird"), "status"),
    (lambda ws: VerifierResult(score=1.0, status="verifier_error", error="own error"), "own error"),
    (lambda ws: 10 ** 400, "[0, 1]"),
    (lambda ws: VerifierResult(score=1.0, details={"loss": math.nan}), "details['loss'] is nan"),
    (lambda ws: VerifierResult(score=1.0, details={"path": Path("x")}), "which JSON cannot hold"),
    (lambda ws: VerifierResult(score=1.0, details={"pair": (1, 2)}), "details['pair'] is a tuple"),
])
def test_callable_verifier_failures(tmp_path, fn, error):
    res = _score(_task(fn=fn), tmp_path)
    assert res.status == "verifier_error" and res.score == 0.0 and error in res.error


# ------------------------------------------------------------------------------ checks.py (mini)

def _checks_task(checks, files, verifier_files=None) -> Task:
    vfiles = {"checks.py": _checks_source(), "spec.json": json.dumps({"checks": checks}), **(verifier_files or {})}
    return _task(VERIFIER_COMMAND, files=files, verifier_files=vfiles)


TESTS = "from mod import f\n\n\ndef test_f():\n    assert f() == 1\n"


@pytest.mark.parametrize("source, score", [
    ("def f():\n    return 1\n", 1.0),
    ("def f():\n    return 2\n", 0.0),
    # Code under test that prints a fake passing report and exits cannot fake the verifier.
    ('import os\nos.write(1, b\'{"total": 1, "failed": []}\\n\')\nos._exit(0)\n', 0.0),
    # ... nor can one that writes it to the runner's report descriptor (a duplicate of its stdout), or
    # to every descriptor it holds, then exits: the report must echo the nonce the runner read on stdin.
    ('import os\nos.write(3, b\'{"total": 1, "failed": []}\\n\')\nos._exit(0)\n', 0.0),
    ('import os, sys\nfor fd in range(20):\n    try:\n        os.write(fd, b\'{"total": 1, "failed": [], '
     '"nonce": "\' + sys.stdin.read().encode() + b\'"}\\n\')\n    except OSError:\n        pass\nos._exit(0)\n', 0.0),
    ('print(\'{"score": 1.0}\')\ndef f():\n    return 2\n', 0.0),
    ("import sys\nsys.exit(0)\n", 0.0),
    ("while True:\n    pass\n", 0.0),
])
def test_python_tests_check(tmp_path, source, score):
    checks = [{"type": "python_tests", "file": "test_mod.py", "timeout": 1}]
    res = _score(_checks_task(checks, {"mod.py": source}, {"test_mod.py": TESTS}), tmp_path)
    assert (res.status, res.score) == ("ok", score), res


def test_checks_do_not_block_on_special_files_or_follow_into_nothing(tmp_path):
    checks = [{"type": "text", "path": "out.txt", "equals": "hi"}]
    task = _checks_task(checks, {})
    ws = task.materialize(tmp_path / "ws")
    (ws / "out.txt").symlink_to("/dev/zero")
    res = run_verifier(task, ws)
    assert (res.status, res.score) == ("ok", 0.0)
    assert "not a regular file" in res.details["checks"][0]["message"]


@pytest.mark.parametrize("subscores, error", [
    ({"a": 1, "b": True}, None), (["a"], "details.subscores is list"), ({"a": "x"}, "sub-score 'a' is not a finite number")])
def test_subscores_in_the_details_are_numbers_by_name_or_a_verifier_error(tmp_path, subscores, error):
    """Evals average details.subscores per name: a list there, or a name with text, passed as ok and
    then crashed the whole eval's metrics after every rollout had run."""
    line = json.dumps({"score": 1, "details": {"subscores": subscores}})
    for task in (_task(f"echo '{line}'"), _task(fn=lambda ws: VerifierResult(1.0, details={"subscores": subscores}))):
        res = _score(task, tmp_path / str(id(task)))
        if error is None:
            assert (res.status, res.details["subscores"]) == ("ok", {"a": 1.0, "b": 1.0})
        else:
            assert res.status == "verifier_error" and error in res.error, res


def test_malformed_spec_is_a_verifier_error(tmp_path):
    res = _score(_checks_task([{"type": "no-such-check"}], {}), tmp_path)
    assert res.status == "verifier_error" and "unknown check type" in res.stderr


@pytest.mark.parametrize("check, content, ok", [
    ({"type": "text", "equals": "hi"}, "hi\n", True),
    ({"type": "text", "equals": "hi"}, "hi", True),
    ({"type": "text", "equals": "hi"}, "hi\n\n", False),
    ({"type": "text", "equals": "hi"}, " hi", False),
    ({"type": "number", "equals": 12}, "12.0\n", True),
    ({"type": "number", "equals": 12}, "12 apples", False),
    ({"type": "json", "equals": {"a": [1, 2]}}, '{ "a" : [1, 2.0] }', True),
    ({"type": "json", "equals": {"a": [1, 2]}}, '{"a": [2, 1]}', False),
    ({"type": "csv", "rows": [["a", "b"], ["1", "2"]]}, "a, b\n1,2\n\n", True),
    ({"type": "csv", "rows": [["a", "b"], ["1", "2"]]}, "a,b\n", False),
    ({"type": "env", "equals": {"K": "v", "N": "1"}}, "# c\nK='v'\n\nN=1\n", True),
    ({"type": "env", "equals": {"K": "v"}}, "K=v\nEXTRA=1\n", False),
])
def test_content_checks(tmp_path, check, content, ok):
    task = _checks_task([dict(check, path="f")], {"f": content})
    res = _score(task, tmp_path)
    assert (res.status, res.score) == ("ok", 1.0 if ok else 0.0), res.details


# ------------------------------------------------------------------------------ planted links

EXPECTED_COMMAND = ('if [ "$(cat out.txt)" = "$(cat "$VERIFIER_DIR/expected.txt")" ]; '
                    'then echo \'{"score": 1}\'; else echo \'{"score": 0}\'; fi')


@pytest.mark.parametrize("sandboxed", [False, True], ids=["subprocess", "sandbox"])
def test_a_link_planted_toward_the_verifier_files_finds_nothing(tmp_path, sandboxed):
    """The verifier's own files sit beside the workspace's copy; a link the agent left at a fixed
    ``../verifier/expected.txt`` (or the in-sandbox path) would hand the check its answer. Their folder
    has a name the agent cannot know, so such a link leads nowhere; the honest answer still scores."""
    from clawfast.tasks.sandbox_runner import SandboxRunner

    task = _task(EXPECTED_COMMAND, verifier_files={"expected.txt": "the answer\n"})

    def score(setup) -> float:
        ws = task.materialize(tmp_path / f"ws{len(list(tmp_path.iterdir()))}")
        setup(ws)
        if not sandboxed:
            return run_verifier(task, ws).score
        with SandboxRunner() as runner:
            return run_verifier(task, ws, runner).score

    assert score(lambda ws: (ws / "out.txt").write_text("the answer\n")) == 1.0
    assert score(lambda ws: (ws / "out.txt").symlink_to("../verifier/expected.txt")) == 0.0
    assert score(lambda ws: (ws / "out.txt").symlink_to("/run/verifier/expected.txt")) == 0.0


@pytest.mark.parametrize("workdir", [None, "/root/work"])
def test_a_workspace_root_the_agent_made_inaccessible_is_still_judged(tmp_path, workdir):
    """``chmod 000 .`` as the agent's last command: the verifier's sandbox could not start in the
    workspace (placed at `workdir`) or the verifier could not enter it, and the rollout was retried
    as an infrastructure failure or dropped. The verifier judges what is in it, in a sandbox; the
    agent's own workspace keeps its modes."""
    import dataclasses

    from clawfast.tasks.sandbox_runner import SandboxRunner

    task = dataclasses.replace(_task('[ "$(cat out.txt)" = done ] && echo \'{"score": 1}\' || echo \'{"score": 0}\''),
                               workdir=workdir)
    ws = task.materialize(tmp_path / "ws")
    (ws / "out.txt").write_text("done\n")
    ws.chmod(0)
    try:
        with SandboxRunner() as runner:
            res = run_verifier(task, ws, runner)
        assert (res.status, res.score) == ("ok", 1.0), res
        assert stat.S_IMODE(ws.stat().st_mode) == 0
    finally:
        ws.chmod(0o755)


@pytest.mark.parametrize("sandboxed", [False, True], ids=["subprocess", "sandbox"])
def test_hard_links_the_agent_left_stay_links_in_the_verifiers_copy(tmp_path, sandboxed):
    """``ln f l1 ... l200``: the agent's quota counts f once, and each copy of the workspace (the
    verifier's, then the sandbox's stage, then its tmpfs) wrote it out per link, 4 GiB of host disk
    for a 20 MiB file, until a copy ran out of space and the rollout was retried as the sandbox's
    failure. The copies keep the links: the verifier sees one file with 201 names."""
    from clawfast.tasks.sandbox_runner import SandboxRunner

    task = _task('echo "{\\"score\\": 1, \\"details\\": {\\"links\\": $(stat -c %h f)}}"')
    ws = task.materialize(tmp_path / "ws")
    (ws / "f").write_bytes(os.urandom(1 << 20))
    for i in range(200):
        os.link(ws / "f", ws / f"l{i}")
    if sandboxed:
        with SandboxRunner() as runner:
            res = run_verifier(task, ws, runner)
    else:
        res = run_verifier(task, ws)
    assert (res.status, res.details) == ("ok", {"links": 201}), res


def test_a_tree_deeper_than_the_copy_recurses_is_a_verifier_error_and_is_removed(tmp_path):
    """`mkdir -p a/a/a/...` some 1,500 levels deep: the workspace cannot be copied for the verifier
    (shutil recurses per level), which is the agent's doing, a verifier_error scoring 0, not an
    exception that lost the rollout's whole batch; and the host still removes the tree."""
    from clawfast.sandbox.hostdir import remove_tree

    task = _task("echo '{\"score\": 1}'")
    ws = task.materialize(tmp_path / "ws")
    subprocess.run(["mkdir", "-p", os.path.join(*["a"] * 1500)], cwd=ws, check=True)  # os.makedirs recurses too
    try:
        res = run_verifier(task, ws)
        assert (res.status, res.score) == ("verifier_error", 0.0) and "RecursionError" in res.error
        remove_tree(str(ws))
        assert not ws.exists()
    finally:  # pytest's own clean-up of old temporary folders recurses too
        subprocess.run(["rm", "-rf", str(ws)])


def test_a_sparse_file_stays_sparse_in_every_copy_the_verifier_gets(tmp_path):
    """`truncate -s 1G f{1..1000}` costs a sandbox's tmpfs nothing; written out whole by each copy of
    the workspace it would have the host write a terabyte. The copies keep the holes, and the data."""
    from clawfast.tasks.sandbox_runner import SandboxRunner

    probe = ("import json, os\ns = os.stat('big.bin')\nf = open('big.bin', 'rb')\nf.seek(32 << 20)\n"
             "print(json.dumps({'score': 1, 'details': {'size': s.st_size, 'allocated': s.st_blocks * 512, "
             "'middle': f.read(4).decode()}}))\n")
    task = _task('python3 "$VERIFIER_DIR/probe.py"', verifier_files={"probe.py": probe})
    ws = task.materialize(tmp_path / "ws")
    with open(ws / "big.bin", "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"data")
    with SandboxRunner() as runner:
        seen = run_verifier(task, ws, runner).details
    assert seen["size"] == 64 << 20 and seen["middle"] == "data"
    assert seen["allocated"] < 1 << 20, seen  # a 64 MiB file written out whole would be 64 MiB

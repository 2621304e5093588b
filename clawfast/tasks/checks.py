"""Declarative workspace checks: the verifier of every clawbench-mini task.

This file is deliberately standalone (standard library only, no clawfast imports): a task ships it
as a verifier file and runs it *inside the verifier sandbox* as

    python3 "$VERIFIER_DIR/checks.py" "$VERIFIER_DIR/spec.json"

with the final workspace as the working directory. It prints one JSON score object on its last
stdout line, ``{"score": 1.0 | 0.0, "details": {...}}``, and exits 0 whenever it could judge the
workspace (a failed check is a score of 0, not an error). A malformed spec is a programming error and
exits non-zero, which the runner reports as ``verifier_error``.

A spec is ``{"checks": [check, ...]}``; the score is 1.0 iff every check passes (all or nothing, so a
do-nothing solution scores 0). Check types (paths relative to the workspace):

- ``text``: file ``path`` holds exactly ``equals`` (UTF-8), ignoring one trailing newline on either
  side, so ``echo hi > f`` and ``printf hi > f`` both satisfy ``equals = "hi"``.
- ``number``: file ``path`` holds one number equal to ``equals`` (absolute tolerance 1e-6).
- ``json``: file ``path`` parses as JSON equal to ``equals`` (key order is irrelevant; 3 == 3.0).
- ``csv``: file ``path`` parses as CSV rows equal to ``rows`` (cells stripped, blank lines ignored).
- ``env``: file ``path`` holds ``KEY=VALUE`` lines (blank and ``#`` lines ignored, surrounding quotes
  stripped) defining exactly the keys of ``equals`` with those values.
- ``absent``: nothing exists at ``path``.
- ``executable``: ``path`` is a regular file with the owner execute bit set.
- ``symlink``: ``path`` is a symbolic link whose target string is ``target``.
- ``python_tests``: the plain-assert test file ``file`` (in the verifier directory) passes: every
  ``test_*`` function returns without raising. It runs in a child process (workspace on
  ``sys.path``) with a ``timeout`` (default 5 s), so agent code that loops or exits cannot hang the
  verifier; its stdout never reaches ours. The child's report counts only if it echoes a fresh random
  nonce this script hands it on stdin (read to the end before any workspace code is imported) and is
  the last line the child wrote, after every test ran: code under test that prints, exits early, or
  writes a report line to a descriptor it inherited (the child's report channel) fails the check.
- ``command_output``: ``bash -c command`` in the workspace exits 0 and prints exactly ``equals``
  (one trailing newline ignored) within ``timeout`` seconds (default 5).

Guarantees: only regular files are read (a FIFO or device planted by the agent fails the check rather
than blocking), at most 1 MiB of each. Not guaranteed: isolation. Checks that run workspace code
(``python_tests``, ``command_output``) are only as contained as the sandbox this script runs in.
Not guaranteed either: that code written to defeat the checker fails. ``python_tests`` runs the code
under test in the same interpreter as the tests and the runner that reports on them, so such code can
still pass: return objects whose ``__eq__`` is always true, patch the runner, or read the nonce out of
the runner's frame. The nonce closes the channel a bug or a blind guess can reach (an inherited
descriptor); only tests that compare serialized outputs in a process the code cannot reach could close
the rest, and these tests are plain asserts. The score is sound for code that tries to solve the task.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import secrets
import stat
import subprocess
import sys

MAX_READ = 1 << 20


class CheckFailed(Exception):
    """The workspace does not satisfy a check (a score of 0, not a verifier error)."""


def _read_text(path: str) -> str:
    try:
        st = os.stat(path)  # follows symlinks: a link to a regular file is fine
    except FileNotFoundError:
        raise CheckFailed(f"{path}: missing") from None
    except OSError as exc:
        raise CheckFailed(f"{path}: cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckFailed(f"{path}: not a regular file")
    if st.st_size > MAX_READ:
        raise CheckFailed(f"{path}: larger than {MAX_READ} bytes")
    try:
        with open(path, "rb") as f:
            return f.read(MAX_READ).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckFailed(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise CheckFailed(f"{path}: cannot read ({exc.strerror})") from None


def _strip_one_newline(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


def _check_text(check: dict) -> None:
    got = _strip_one_newline(_read_text(check["path"]))
    want = _strip_one_newline(check["equals"])
    if got != want:
        raise CheckFailed(f"{check['path']}: content differs: got {got[:200]!r}, want {want[:200]!r}")


def _check_number(check: dict) -> None:
    raw = _read_text(check["path"]).strip()
    try:
        got = float(raw)
    except ValueError:
        raise CheckFailed(f"{check['path']}: not a number: {raw[:100]!r}") from None
    if not math.isclose(got, float(check["equals"]), rel_tol=0.0, abs_tol=1e-6):
        raise CheckFailed(f"{check['path']}: got {got}, want {check['equals']}")


def _check_json(check: dict) -> None:
    try:
        got = json.loads(_read_text(check["path"]))
    except json.JSONDecodeError as exc:
        raise CheckFailed(f"{check['path']}: invalid JSON ({exc.msg})") from None
    if got != check["equals"]:
        raise CheckFailed(f"{check['path']}: JSON differs: got {json.dumps(got)[:200]}")


def _check_csv(check: dict) -> None:
    text = _read_text(check["path"])
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
    rows = [row for row in rows if row and any(row)]
    if rows != check["rows"]:
        raise CheckFailed(f"{check['path']}: rows differ: got {rows[:5]}")


def _parse_env(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise CheckFailed(f"not a KEY=VALUE line: {line[:100]!r}")
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _check_env(check: dict) -> None:
    got = _parse_env(_read_text(check["path"]))
    if got != check["equals"]:
        raise CheckFailed(f"{check['path']}: got {got}, want {check['equals']}")


def _check_absent(check: dict) -> None:
    if os.path.lexists(check["path"]):
        raise CheckFailed(f"{check['path']}: still exists")


def _check_executable(check: dict) -> None:
    path = check["path"]
    try:
        st = os.stat(path)
    except OSError:
        raise CheckFailed(f"{path}: missing") from None
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXUSR:
        raise CheckFailed(f"{path}: not an executable regular file")


def _check_symlink(check: dict) -> None:
    path = check["path"]
    if not os.path.islink(path):
        raise CheckFailed(f"{path}: not a symbolic link")
    target = os.readlink(path)
    if target.rstrip("/") != check["target"] and os.path.normpath(target) != check["target"]:
        raise CheckFailed(f"{path}: points to {target!r}, want {check['target']!r}")


def _run_child(argv: list, timeout: float, label: str, stdin: str = "") -> subprocess.CompletedProcess:
    """Run `argv` with `stdin` as its whole input (then end of file), its output captured."""
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, errors="replace",
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{label}: timed out after {timeout} s") from None


def _check_python_tests(check: dict, verifier_dir: str) -> None:
    test_file = os.path.join(verifier_dir, check["file"])
    nonce = secrets.token_hex(16)
    # -S: the tests and the code under test use the standard library only; skipping site saves
    # start-up time (see VERIFIER_COMMAND in mini.py).
    proc = _run_child([sys.executable, "-S", os.path.abspath(__file__), "--run-tests", test_file],
                      float(check.get("timeout", 5)), check["file"], stdin=nonce + "\n")
    lines = proc.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        report = None
    # The runner writes the nonce's report last, after the last test: any other last line (none, a
    # line the code under test wrote, a report with another nonce) means the run did not end there.
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        raise CheckFailed(f"{check['file']}: test run ended without its report (exit {proc.returncode}): "
                          f"{proc.stderr.strip()[-300:]}")
    if report["failed"]:
        raise CheckFailed(f"{check['file']}: {len(report['failed'])} of {report['total']} tests "
                          f"failed: {report['failed'][:3]}")


def _check_command_output(check: dict) -> None:
    proc = _run_child(["bash", "-c", check["command"]], float(check.get("timeout", 5)), check["command"])
    if proc.returncode != 0:
        raise CheckFailed(f"{check['command']!r} exited {proc.returncode}: {proc.stderr.strip()[-200:]}")
    got, want = _strip_one_newline(proc.stdout), _strip_one_newline(check["equals"])
    if got != want:
        raise CheckFailed(f"{check['command']!r} printed {got[:200]!r}, want {want[:200]!r}")


_CHECKS = {
    "text": _check_text,
    "number": _check_number,
    "json": _check_json,
    "csv": _check_csv,
    "env": _check_env,
    "absent": _check_absent,
    "executable": _check_executable,
    "symlink": _check_symlink,
    "command_output": _check_command_output,
}


def run_checks(spec: dict, verifier_dir: str) -> dict:
    """Evaluate `spec` against the current directory; returns the score object."""
    results = []
    for check in spec["checks"]:
        kind = check["type"]
        if kind != "python_tests" and kind not in _CHECKS:
            raise ValueError(f"unknown check type {kind!r}")
        try:
            if kind == "python_tests":
                _check_python_tests(check, verifier_dir)
            else:
                _CHECKS[kind](check)
            results.append({"type": kind, "ok": True})
        except CheckFailed as exc:
            results.append({"type": kind, "ok": False, "message": str(exc)})
    passed = sum(r["ok"] for r in results)
    score = 1.0 if passed == len(results) else 0.0
    return {"score": score, "details": {"passed": passed, "total": len(results), "checks": results}}


def run_test_file(test_file: str) -> dict:
    """Import `test_file` with the cwd on sys.path and call each ``test_*`` function."""
    import importlib.util
    import traceback

    sys.path.insert(0, os.getcwd())
    failed, names = [], []
    try:
        spec = importlib.util.spec_from_file_location("clawfast_verifier_tests", test_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names = sorted(n for n in vars(module) if n.startswith("test_") and callable(getattr(module, n)))
        for name in names:
            try:
                getattr(module, name)()
            except Exception as exc:  # a failing test, whatever it raised
                failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:100]}")
    except Exception:
        failed.append("import: " + traceback.format_exc(limit=2)[-300:])
    return {"total": max(len(names), 1), "failed": failed}


def _run_tests_main(test_file: str) -> int:
    # The nonce, read to end of file before any workspace code is imported: that code finds stdin
    # empty, and a report line it writes lacks the nonce.
    nonce = sys.stdin.read().strip()
    # Bound before the code under test can replace them in their modules.
    dumps, write = json.dumps, os.write
    # The code under test may print (print, os.write(1), child processes, atexit hooks): point fd 1
    # at /dev/null for good and write the one report line to a private duplicate of it.
    report_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    report = run_test_file(test_file)
    write(report_fd, (dumps({**report, "nonce": nonce}) + "\n").encode())
    return 0


def main(argv: list) -> int:
    if len(argv) == 2 and argv[0] == "--run-tests":
        return _run_tests_main(argv[1])
    if len(argv) != 1:
        print("usage: checks.py SPEC.json | --run-tests TEST_FILE", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    print(json.dumps(run_checks(spec, os.path.dirname(os.path.abspath(argv[0])))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

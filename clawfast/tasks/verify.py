"""Running verifiers and oracles.

`run_verifier(task, workspace, runner)` scores a final workspace. A command verifier runs through a
`CommandRunner`, the one abstraction over *where* a command runs: `SubprocessRunner` (a plain child
process; no isolation) or a sandbox adapter (`clawfast.tasks.sandbox_runner`) that runs it in a
fresh sandbox. Either way the verifier works on a scratch *copy* of the workspace (regular files,
directories and symlinks; FIFOs, sockets and devices are skipped; its root the owner's to enter),
so what it writes never reaches the caller's workspace. Only the sandbox enforces that: under `SubprocessRunner` a verifier could still
write anywhere by absolute path, so use it for trusted verifiers.

Guaranteed: `run_verifier` never raises for anything the verifier does. A verifier that exits
non-zero, times out, is killed, prints more stdout than its runner keeps the end of
(`CommandResult.stdout_lost`), prints no score on its last stdout line (a JSON score object for a
`CommandVerifier`, a bare float for a `RewardScriptVerifier`), prints a score outside [0, 1], or puts
NaN, Infinity or a number past a float's range anywhere in its JSON line (a rollout record, strict
JSON, cannot hold it; a `CallableVerifier`'s details likewise) yields
``VerifierResult(score=0.0, status="verifier_error")`` with the reason in `error` and the tails of its
stdout and stderr kept. Only a runner that itself fails to run anything (for example a sandbox that
cannot start, or `SubprocessRunner` asked for a task whose workspace must lie at an absolute path)
raises, since that is an infrastructure fault, not a score.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from clawfast.records import json_problem
from clawfast.tasks.task import (
    CallableVerifier,
    CommandVerifier,
    GradeFunctionVerifier,
    RewardScriptVerifier,
    Task,
    VerifierResult,
)

VERIFIER_STATUSES = ("ok", "verifier_error")
# Enough of a verifier's stderr to see a traceback; bounded so a chatty verifier cannot bloat records.
STDERR_TAIL_BYTES = 8192
STDOUT_TAIL_BYTES = 65536
# Characters of a failed verifier's stdout kept in its result: enough to see why the score line is wrong.
KEPT_STDOUT_CHARS = 4096
# ClawGym's reward payload file, written into the verifier's copy of the workspace.
PAYLOAD_FILE = ".openclaw_reward_payload.json"


@dataclass
class CommandResult:
    """What a `CommandRunner` reports: `returncode` (None if killed on timeout), output tails, and
    `timed_out`. `stdout_lost`: why the stdout kept does not end where the command's stdout ended (a
    runner that keeps only the head of a long output says so here), or None: its last line is then not
    the command's last line, so no score is read from it."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    stdout_lost: str | None = None


class CommandRunner(Protocol):
    """Run ``bash -c command`` with `workspace` as the working directory and, if `verifier_dir` is
    given, ``$VERIFIER_DIR`` naming a (possibly read-only) view of it; kill everything it started after
    `timeout` seconds. The workspace passed in is a scratch copy the command may change freely.
    `workdir`: the absolute path the workspace must have where the command runs (None: anywhere).
    `env`: variables added to the command's environment."""

    def __call__(self, command: str, workspace: Path, *, verifier_dir: Path | None, timeout: float,
                 workdir: str | None = None, env: Mapping[str, str] | None = None) -> CommandResult: ...


def _tail(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", errors="replace")


def _child_env(verifier_dir: Path | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    # A small, explicit environment: the host's secrets (API keys, tokens) never reach task code.
    # The running interpreter's directory comes first on PATH so `python3` is this Python, not a
    # version-manager shim that costs ~150 ms a start.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")])
    env = {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if verifier_dir is not None:
        env["VERIFIER_DIR"] = str(verifier_dir)
    env.update(extra or {})
    return env


class SubprocessRunner:
    """`CommandRunner` that runs the command as a plain child process in its own process group.

    Not a sandbox: the command can read and write anything the caller can. It is the fallback where
    no sandbox backend is available, and the runner for trusted commands (oracles in tests).
    Output goes to temporary files, of which only the tails are read back, so memory stays bounded.
    """

    def __call__(self, command: str, workspace: Path, *, verifier_dir: Path | None = None, timeout: float,
                 workdir: str | None = None, env: Mapping[str, str] | None = None) -> CommandResult:
        if workdir is not None:
            # A plain process cannot see the workspace at another path, and writing the host's own
            # `workdir` would touch files outside every scratch copy.
            raise ValueError(f"this task's workspace must lie at {workdir}: a plain subprocess cannot put it "
                             f"there; run its verifier in a sandbox (clawfast.tasks.sandbox_runner.SandboxRunner)")
        with tempfile.TemporaryDirectory(prefix="clawfast-out-") as tmp:
            out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(["bash", "-c", command], cwd=workspace, stdout=out, stderr=err,
                                        stdin=subprocess.DEVNULL, env=_child_env(verifier_dir, env),
                                        start_new_session=True)
                timed_out = False
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    # Kill the whole group (the command's own children too), also after a normal exit.
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            return CommandResult(
                returncode=None if timed_out else proc.returncode,
                stdout=_tail(out_path, STDOUT_TAIL_BYTES),
                stderr=_tail(err_path, STDERR_TAIL_BYTES),
                timed_out=timed_out,
                duration_s=time.monotonic() - start,
            )


def finite_number(value: Any) -> float | None:
    """`value` as a float if it is a number (not a bool) a float holds finitely, else None. An integer
    too large for a float is None: `math.isfinite` would raise OverflowError on it, not answer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def short_repr(value: Any) -> str:
    """A short repr of `value` for an error message; an int too long to print (past
    `sys.get_int_max_str_digits`) must not turn the message itself into a ValueError."""
    try:
        text = repr(value)
    except ValueError:
        return "an integer too long to print"
    return text if len(text) <= 100 else text[:97] + "..."


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e999: past a float's range
        raise ValueError(f"{text[:50]} is not a finite number (past a float's range)")
    return number


def loads_finite(text: str) -> Any:
    """`json.loads` that refuses NaN, Infinity and numbers past a float's range with ValueError: Python's
    parser accepts them, but no record (encoded with allow_nan=False) can hold them."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _last_json(stdout: str, who: str) -> tuple[Any, str]:
    """The JSON value on the last non-empty stdout line of `who`, and that line. ValueError if none, or
    if it holds a non-finite number (`loads_finite`)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{who} printed nothing on stdout")
    try:
        return loads_finite(lines[-1]), lines[-1]
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep to parse
        raise ValueError(f"last stdout line of {who} is not JSON: {lines[-1][:200]!r}") from None
    except ValueError as exc:
        raise ValueError(f"last stdout line of {who}: {exc}: {lines[-1][:200]!r}") from None


def parse_score_line(stdout: str) -> tuple[float, dict[str, Any]]:
    """Parse the verifier protocol: the last non-empty stdout line is a JSON object with a finite
    ``score`` in [0, 1] and an optional ``details`` object (its ``subscores``, if any: `subscores_of`).
    Raises ValueError saying what is wrong."""
    obj, line = _last_json(stdout, "verifier")
    if not isinstance(obj, dict) or "score" not in obj:
        raise ValueError(f"last stdout line is not a score object: {line[:200]!r}")
    score = finite_number(obj["score"])
    if score is None:
        raise ValueError(f"score must be a finite number, got {short_repr(obj['score'])}")
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"score must lie in [0, 1], got {score!r}")
    details = obj.get("details", {})
    if not isinstance(details, dict):
        raise ValueError(f"details must be an object, got {type(details).__name__}")
    if "subscores" in details:
        details = {**details, "subscores": subscores_of(details["subscores"], "details.subscores is")}
    return score, details


def _error(reason: str, stderr: str = "", duration: float = 0.0, stdout: str = "") -> VerifierResult:
    return VerifierResult(score=0.0, status="verifier_error", error=reason, stderr=stderr,
                          duration_s=duration, stdout=stdout[-KEPT_STDOUT_CHARS:])


def _failed_run(res: CommandResult, timeout: float) -> VerifierResult | None:
    """The error of a verifier run that timed out, exited non-zero or lost the end of its stdout (None
    if it exited 0 and its last stdout line is the one it printed last)."""
    if res.timed_out:
        return _error(f"verifier timed out after {timeout} s", res.stderr, res.duration_s, res.stdout)
    if res.returncode != 0:
        return _error(f"verifier exited with status {res.returncode}", res.stderr, res.duration_s, res.stdout)
    if res.stdout_lost is not None:
        return _error(res.stdout_lost, res.stderr, res.duration_s, res.stdout)
    return None


def _scored(res: CommandResult, timeout: float) -> VerifierResult:
    """The result of a verifier run that prints the JSON score line (`parse_score_line`)."""
    failed = _failed_run(res, timeout)
    if failed is not None:
        return failed
    try:
        score, details = parse_score_line(res.stdout)
    except ValueError as exc:
        return _error(str(exc), res.stderr, res.duration_s, res.stdout)
    return VerifierResult(score=score, details=details, stderr=res.stderr, duration_s=res.duration_s)


def hidden_dir_name() -> str:
    """A name for the folder of a verifier's own files (hidden tests, expected outputs) that nothing
    the agent left can know: a link planted in the workspace to a fixed ``../verifier/expected.txt``
    would lead a check that follows links (a link to a regular file is fine) to the answer."""
    return f"verifier-{secrets.token_hex(8)}"


def _unlink_links_into(root: Path, placed: Sequence[Path]) -> None:
    """Remove every link under `root` that resolves into one of `placed` (what the verifier put into
    the workspace's copy after the agent ended): the agent could only have planted it there."""
    def under(path: str, tops: list[str]) -> bool:
        return any(path == top or path.startswith(top + os.sep) for top in tops)

    own, real = [str(p) for p in placed], [os.path.realpath(p) for p in placed]
    for folder, dirs, files in os.walk(root):  # links to folders are listed, not followed
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path) and not under(path, own) and under(os.path.realpath(path), real):
                os.unlink(path)


def _run_command_verifier(verifier: CommandVerifier, scratch: Path, workspace: Path,
                          runner: CommandRunner, workdir: str | None) -> VerifierResult:
    verifier_dir = scratch / hidden_dir_name()
    verifier.materialize(verifier_dir)
    res = runner(verifier.command, workspace, verifier_dir=verifier_dir, timeout=verifier.timeout,
                 workdir=workdir)
    return _scored(res, verifier.timeout)


def parse_float_line(stdout: str) -> float:
    """ClawGym's reward line: the last non-empty stdout line is one finite float in [0, 1]. Raises
    ValueError saying what is wrong."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("reward script printed nothing on stdout")
    try:
        value = float(lines[-1])
    except ValueError:
        raise ValueError(f"last stdout line is not a number: {lines[-1][:200]!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"reward must be a finite number in [0, 1], got {lines[-1][:200]!r}")
    return value


def parse_subscores(stdout: str) -> dict[str, float]:
    """The sub-scores a ClawGym ``check.py`` prints: its last non-empty stdout line is a JSON object
    of name -> finite number (booleans count as 0 / 1, as ``float()`` in the reward scripts reads
    them). Raises ValueError saying what is wrong."""
    obj, _ = _last_json(stdout, "check.py")
    return subscores_of(obj, "check.py printed")


def subscores_of(obj: Any, who: str) -> dict[str, float]:
    """`obj` as sub-scores, name -> finite number (booleans count as 0 / 1); a ValueError starting with
    `who` otherwise. Metrics average them per name (`clawfast.train.metrics.subscore_means`)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{who} {type(obj).__name__}, not an object of sub-scores")
    out = {}
    for name, value in obj.items():
        # isinstance(True, int): booleans pass, as documented.
        number = float(value) if isinstance(value, bool) else finite_number(value)
        if number is None:
            raise ValueError(f"sub-score {name!r} is not a finite number: {short_repr(value)}")
        out[name] = number
    return out


def _reward_payload(task: Task, verifier: RewardScriptVerifier, final_message: str,
                    transcript: list[dict[str, Any]]) -> dict[str, Any]:
    # The fields ClawGym's rollout writes.
    return {"task_id": task.id, "user_query": task.instruction, "metadata": dict(verifier.metadata),
            "final_message": final_message, "transcript": transcript}


def _run_grade_function(verifier: GradeFunctionVerifier, scratch: Path, workspace: Path, runner: CommandRunner,
                        workdir: str | None, transcript: list[dict[str, Any]]) -> VerifierResult:
    verifier_dir = scratch / hidden_dir_name()
    verifier_dir.mkdir()
    shutil.copyfile(Path(__file__).with_name(verifier.RUNNER), verifier_dir / verifier.RUNNER)
    (verifier_dir / "grade.py").write_text(verifier.code, encoding="utf-8")
    (verifier_dir / "transcript.json").write_text(json.dumps(transcript), encoding="utf-8")
    res = runner(f'python3 "$VERIFIER_DIR/{verifier.RUNNER}"', workspace, verifier_dir=verifier_dir,
                 timeout=verifier.timeout, workdir=workdir)
    return _scored(res, verifier.timeout)


def _remove(path: Path) -> None:
    """Remove what is at `path` (a directory tree, a file or a link, which is not followed), if anything."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _run_reward_script(task: Task, verifier: RewardScriptVerifier, workspace: Path, runner: CommandRunner,
                       final_message: str, transcript: list[dict[str, Any]]) -> VerifierResult:
    workdir = task.workdir
    reward = workspace / "reward"
    # Whatever the agent left at reward/ and at the payload's name is replaced: only the task's own
    # scripts judge it, and a link planted there must not carry the payload's write out of the copy.
    _remove(reward)
    shutil.copytree(verifier.directory, reward, symlinks=True)
    _remove(workspace / PAYLOAD_FILE)
    # Imported here: the sandbox package loads its backends, which the trainer, a user of this module,
    # must not import (tests/test_dependencies.py, R5).
    from clawfast.sandbox.workspace import write_files

    payload = _reward_payload(task, verifier, final_message, transcript)
    write_files(str(workspace), {PAYLOAD_FILE: json.dumps(payload)})
    # reward/ has the name ClawGym's scripts are run by: a link the agent left toward it (or the
    # payload) would hand a check the scripts' own text.
    _unlink_links_into(workspace, [reward, workspace / PAYLOAD_FILE])
    # The scripts run in the agent's workspace and pipe JSON through ``python3 -c 'import json, ...'``,
    # whose first import path is the working directory: a json.py the agent left there scored 1.0.
    # No interpreter of theirs puts the working directory (or a script's folder) on the path; the
    # scripts' own folder is, for helpers beside check.py.
    env = {"OPENCLAW_REWARD_PAYLOAD": f"{workdir}/{PAYLOAD_FILE}", "PYTHONSAFEPATH": "1",
           "PYTHONPATH": f"{workdir}/reward"}
    inside = shlex.quote(f"{workdir}/reward")
    res = runner(f"bash {inside}/{verifier.ENTRY}", workspace, verifier_dir=None, timeout=verifier.timeout,
                 workdir=workdir, env=env)
    failed = _failed_run(res, verifier.timeout)
    if failed is not None:
        return failed
    try:
        score = parse_float_line(res.stdout)
    except ValueError as exc:
        return _error(str(exc), res.stderr, res.duration_s, res.stdout)
    details: dict[str, Any] = {}
    duration = res.duration_s
    if verifier.has_subscores:
        sub = runner(f"python3 {inside}/{verifier.SUBSCORES} {shlex.quote(workdir)}", workspace, verifier_dir=None,
                     timeout=verifier.timeout, workdir=workdir, env=env)
        duration += sub.duration_s
        try:
            bad = _failed_run(sub, verifier.timeout)
            if bad is not None:
                raise ValueError(f"check.py: {bad.error}")
            details["subscores"] = parse_subscores(sub.stdout)
        except ValueError as exc:
            # The reward stands: sub-scores only explain it.
            details["subscores_error"] = str(exc)
    return VerifierResult(score=score, details=details, stderr=res.stderr, duration_s=duration)


def _run_callable_verifier(verifier: CallableVerifier, workspace: Path) -> VerifierResult:
    start = time.monotonic()
    try:
        out = verifier.fn(workspace)
    except Exception as exc:  # a crashing verifier is a verifier_error, never a crashed batch
        return _error(f"verifier raised {type(exc).__name__}: {exc}", duration=time.monotonic() - start)
    duration = time.monotonic() - start
    if isinstance(out, VerifierResult):
        if out.status not in VERIFIER_STATUSES:
            return _error(f"verifier returned status {out.status!r}", duration=duration)
        if out.status == "verifier_error":
            return _error(out.error or "verifier reported an error", out.stderr, duration)
        score, details = out.score, out.details
        if not isinstance(details, dict):
            return _error(f"details must be a dict, got {type(details).__name__}", duration=duration)
        if "subscores" in details:
            try:
                details = {**details, "subscores": subscores_of(details["subscores"], "details.subscores is")}
            except ValueError as exc:
                return _error(str(exc), duration=duration)
    else:
        score, details = out, {}
    number = finite_number(score)
    if number is None or not 0.0 <= number <= 1.0:
        return _error(f"score must be a number in [0, 1], got {short_repr(score)}", duration=duration)
    # The rollout's record holds the details as JSON that must read back as they are; what it cannot
    # hold fails here, as the verifier's error, rather than when the rollout is closed.
    problem = json_problem(details, "details")
    if problem:
        return _error(problem, duration=duration)
    return VerifierResult(score=number, details=dict(details), duration_s=duration)


def _special_files(directory: str, names: list[str]) -> set[str]:
    """FIFOs, sockets and devices the agent left: skipped, since copying a FIFO would block forever
    and none of them can hold a result."""
    skipped = set()
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.add(name)
    return skipped


def run_verifier(task: Task, workspace: Path | str, runner: CommandRunner | None = None, *,
                 final_message: str = "", transcript: list[dict[str, Any]] | None = None) -> VerifierResult:
    """Score the final `workspace` of `task`. The verifier runs on a scratch copy of it; `runner`
    (default `SubprocessRunner()`) runs command, reward-script and grade-function verifiers, with the
    copy at `task.workdir` where the task has one. `final_message`: the agent's last answer, for
    reward scripts that grade it (`RewardScriptVerifier`'s payload). `transcript`: the run's
    transcript events (`clawfast.tasks.transcript`; None: an empty one, as for a run that did
    nothing), for `GradeFunctionVerifier` and the reward payload. A task that a judge alone scores
    (no verifier) gets score 0 with ``details["verifier"] = "none"``: its score is the judge's
    (`clawfast.tasks.scoring`). See the module docstring for the error contract."""
    workspace = Path(workspace)
    if not workspace.is_dir():
        raise FileNotFoundError(f"workspace {workspace} is not a directory")
    if task.verifier is None:
        return VerifierResult(score=0.0, details={"verifier": "none"})
    transcript = transcript or []
    with tempfile.TemporaryDirectory(prefix=f"clawfast-verify-{task.id}-") as tmp:
        scratch = Path(tmp)
        copy = scratch / "workspace"
        # The verifier enters the workspace to judge what is in it: a root the agent made inaccessible
        # (``chmod 000 .``) stopped the verifier's sandbox from starting there, an infrastructure
        # failure that ran the rollout again. The copy's root is the owner's (the agent's workspace
        # gets its mode back); below it, modes are as the agent left them.
        mode = stat.S_IMODE(os.lstat(workspace).st_mode)
        granted = mode | stat.S_IRWXU != mode
        try:
            if granted:
                os.chmod(workspace, mode | stat.S_IRWXU)
            # A link the agent planted is copied as a link, not followed on the host; holes and hard links
            # stay so (`copy_workspace`). Imported here: see _run_reward_script.
            from clawfast.sandbox.workspace import copy_workspace

            copy_workspace(workspace, copy, ignore=_special_files)
            os.chmod(copy, mode | stat.S_IRWXU)
        except (OSError, shutil.Error, RecursionError) as exc:
            # Unreadable or special files the agent left, or a tree deeper than the copy recurses:
            # the workspace cannot be judged.
            return _error(f"cannot copy workspace: {type(exc).__name__}: {str(exc)[:500]}")
        finally:
            if granted:
                with contextlib.suppress(OSError):  # a workspace not the host user's was never changed
                    os.chmod(workspace, mode)
        if isinstance(task.verifier, CallableVerifier):
            return _run_callable_verifier(task.verifier, copy)
        if isinstance(task.verifier, RewardScriptVerifier):
            return _run_reward_script(task, task.verifier, copy, runner or SubprocessRunner(), final_message,
                                      transcript)
        if isinstance(task.verifier, GradeFunctionVerifier):
            return _run_grade_function(task.verifier, scratch, copy, runner or SubprocessRunner(), task.workdir,
                                       transcript)
        return _run_command_verifier(task.verifier, scratch, copy, runner or SubprocessRunner(), task.workdir)


@dataclass
class OracleRun:
    """The outcome of replaying a command list: one `CommandResult` per command that ran; `ok` is
    False if a command failed or timed out (the rest are then not run)."""

    results: list[CommandResult]
    ok: bool


def run_commands(commands: Sequence[str], workspace: Path | str, *, timeout: float = 30.0) -> OracleRun:
    """Run `commands` in order with ``bash -c`` in `workspace`, in place, stopping at the first
    failure: the way a scripted engine replays an oracle as tool calls. They run as plain
    subprocesses (`SubprocessRunner`), so use it for trusted commands (oracles) only."""
    runner = SubprocessRunner()
    results = []
    for command in commands:
        res = runner(command, Path(workspace), verifier_dir=None, timeout=timeout)
        results.append(res)
        if res.timed_out or res.returncode != 0:
            return OracleRun(results, ok=False)
    return OracleRun(results, ok=True)


@dataclass
class TaskCheck:
    """`check_task`'s answer: the oracle's and the do-nothing solution's scores (the task is sound iff
    they are 1.0 and 0.0), with both verifier results and the oracle replay."""

    task_id: str
    oracle: VerifierResult
    nothing: VerifierResult
    oracle_run: OracleRun

    @property
    def sound(self) -> bool:
        return self.oracle_run.ok and self.oracle.score == 1.0 and self.nothing.score == 0.0 and (
            self.oracle.status == "ok" and self.nothing.status == "ok"
        )


def score_do_nothing(task: Task, runner: CommandRunner | None = None) -> VerifierResult:
    """The verifier's verdict on an untouched copy of the initial workspace (the do-nothing solution)."""
    with tempfile.TemporaryDirectory(prefix=f"clawfast-nothing-{task.id}-") as tmp:
        return run_verifier(task, task.materialize(Path(tmp) / "nothing"), runner)


def check_task(task: Task, runner: CommandRunner | None = None) -> TaskCheck:
    """Replay the oracle on a fresh copy of the initial workspace and score it, then score an
    untouched copy (the do-nothing solution). The oracle runs with `run_commands` (a trusted plain
    subprocess); `runner` runs the verifier, as in `run_verifier`."""
    with tempfile.TemporaryDirectory(prefix=f"clawfast-check-{task.id}-") as tmp:
        solved = task.materialize(Path(tmp) / "oracle")
        oracle_run = run_commands(task.oracle, solved)
        oracle = run_verifier(task, solved, runner)
    return TaskCheck(task.id, oracle, score_do_nothing(task, runner), oracle_run)

"""`RunResult`: what one command of a sandbox came to, with its output capped."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunResult:
    """The outcome of one command.

    exit_code: the command's exit status; 128+N when signal N ended it (the shell convention; e.g. 137
        after the OOM killer); None when it was killed for running past its timeout.
    stdout, stderr: what it wrote, at most `Limits.max_output_bytes` of each (the beginning).
    timed_out: the command ran past `timeout` and its whole process tree was killed.
    duration_s: wall time from start to exit (or kill), including sandbox start-up.
    stdout_truncated, stderr_truncated: output beyond the cap was dropped.
    limit: which of the sandbox's limits this command ran into, when the backend can tell (one of
        `LIMIT_NAMES`; None: none that it saw): ``time`` (killed at the timeout), ``memory`` (the
        memory limit killed a process), ``processes`` (a fork was refused at the process limit),
        ``file size`` (SIGXFSZ ended it), ``disk`` (it failed with the sandbox's disk full).
        `limit_message` says it in words.
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    limit: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


LIMIT_NAMES = ("time", "memory", "processes", "file size", "disk")
# 128 + SIGXFSZ: a process that wrote past RLIMIT_FSIZE.
EXIT_FILE_SIZE = 153


def limit_message(result: RunResult, limits) -> str | None:
    """`result.limit` in words, with the limit's value from `limits` (`clawfast.sandbox.Limits`), or
    None when the command ran into none."""
    if result.limit is None:
        return None
    mib = lambda n: f"{n / (1 << 20):g} MiB"  # noqa: E731
    value = {"memory": limits.memory_bytes and mib(limits.memory_bytes),
             "processes": limits.max_processes and f"{limits.max_processes} processes",
             "file size": limits.max_file_bytes and mib(limits.max_file_bytes),
             "disk": limits.disk_bytes and mib(limits.disk_bytes)}.get(result.limit)
    what = {"time": "ran past its time limit and was killed",
            "memory": "was killed by the sandbox's memory limit",
            "processes": "hit the sandbox's process limit (a fork was refused)",
            "file size": "wrote a file past the sandbox's file-size limit (SIGXFSZ)",
            "disk": "ran out of the sandbox's disk"}[result.limit]
    return f"{what}{f' ({value})' if value else ''}"


def capped_result(
    exit_code: int | None, stdout: bytes, stderr: bytes, cap: int, *, timed_out: bool, duration_s: float
) -> RunResult:
    """A RunResult keeping the first `cap` bytes of each output; pass a little more than `cap` of each
    so that truncation is detected."""
    return RunResult(
        exit_code=exit_code,
        stdout=stdout[:cap],
        stderr=stderr[:cap],
        timed_out=timed_out,
        duration_s=duration_s,
        stdout_truncated=len(stdout) > cap,
        stderr_truncated=len(stderr) > cap,
    )

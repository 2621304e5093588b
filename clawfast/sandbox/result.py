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
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


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

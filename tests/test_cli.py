"""The `clawfast` program's process-wide setting (SIGPIPE) stays out of in-process `main` calls."""

from __future__ import annotations

import signal
import subprocess
import sys

from clawfast.cli import main


def test_main_leaves_the_callers_sigpipe_alone(capsys):
    # Python ignores SIGPIPE so that a broken pipe raises; a library call must not turn that into
    # "die on the next write to any broken pipe" for the whole caller (a test runner, a trainer)
    before = signal.getsignal(signal.SIGPIPE)
    assert main(["--help"]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN
    assert "usage" in capsys.readouterr().out


def test_the_program_dies_quietly_into_a_closed_pipe():
    # `clawfast tasks list | head -1`: the reader leaves, the program ends without a traceback
    proc = subprocess.run(f"{sys.executable} -m clawfast.cli tasks list --suite clawbench-mini | head -1",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split()[0] == "id"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr

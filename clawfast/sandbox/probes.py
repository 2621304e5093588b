"""Host-side probes of sandboxed processes, for the leak checks of tests and benchmarks.

Read from /proc, so Linux only. A snapshot: a process may start or end while /proc is read, and one
that ends meanwhile is left out. The backends do not use these: they track their own processes.
"""

from __future__ import annotations

import os


def pids_with(text: str) -> list[int]:
    """Host pids whose command line contains `text`, the calling process excluded (its own command
    line may name `text`)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # it ended while /proc was read: left out, as the docstring says
            continue
        if text.encode() in cmdline:
            found.append(int(entry))
    return found

"""The pieces of bwrap's command line that depend on the host, not on one sandbox: the rebuilt "room"
around a `workdir` inside a read-only system directory (`room_for`, `copy_of`, `mode_of`), the mount
points bwrap would make (`parents_to_make`) and the capabilities `setpriv` needs as root. The whole
command line of one run, and why it is what it is, is `BwrapSandbox._launch_argv` and the
`clawfast.sandbox.bwrap` module docstring. `room_for` checks a workdir before anything is made on the
host.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from clawfast.sandbox.base import SandboxError
from clawfast.sandbox.spec import TMPFS_DIRS
from clawfast.sandbox.view import RootView, ancestors

# What setpriv needs to drop to the sandbox user and empty the bounding set; all of it is gone once the
# command runs (a change of every uid away from 0 clears the capabilities).
SWITCH_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


def room_for(workdir: str, view: RootView) -> str | None:
    """The directory to rebuild so that bwrap can make the mount point `workdir` (see the docstring
    of `clawfast.sandbox.bwrap`): its deepest ancestor that exists on the host, when that lies in a
    directory the view binds read-only; None when none is needed. ValueError when `workdir` or one of
    its ancestors there exists on the host as something other than a directory."""
    if any(workdir.startswith(d + "/") for d in TMPFS_DIRS):
        return None
    for link in view.system_paths:
        if workdir.startswith(link + "/") and link not in view.mounted:
            raise ValueError(f"SandboxSpec.workdir {workdir!r}: {link!r} is a symbolic link in the sandbox")
    top = next((p for p in view.mounted if workdir.startswith(p + "/")), None)
    if top is None:
        return None  # bwrap makes it in its own root tmpfs
    existing = top
    for part in workdir[len(top) + 1:].split("/"):
        path = os.path.join(existing, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return existing
        except OSError as exc:
            raise SandboxError(f"cannot inspect {path!r} for the workdir {workdir!r}: {exc}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(
                f"SandboxSpec.workdir {workdir!r}: {path!r} exists on the host and is not a directory"
                " (a symlink is refused too), so the workspace cannot be mounted there"
            )
        existing = path
    return None


def parents_to_make(targets: Sequence[str], view: RootView) -> list[str]:
    """The ancestors of `targets` that bwrap would make, outermost first, each once: those in its root
    tmpfs, in a private tmpfs (/tmp, /run) or in a rebuilt room, not those a view directory holds."""
    out: dict[str, None] = {}
    for target in targets:
        for path in ancestors(os.path.dirname(os.path.normpath(target))):
            if path in TMPFS_DIRS or path in view.system_paths or (view.shows(path) and os.path.isdir(path)):
                continue  # mounted by the sandbox itself, or present in a view directory
            out[path] = None
    return list(out)


def copy_of(directory: str) -> list[str]:
    """bwrap arguments that show each entry of the host's `directory` at the same path, read-only:
    directories and files bound (`-try`: an entry removed after this listing is left out rather than
    failing every run), symlinks recreated, never followed."""
    argv = []
    try:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            else:
                argv += ["--ro-bind-try", path, path]
    except OSError as exc:
        raise SandboxError(f"cannot list {directory!r} to make room for the workdir: {exc}") from exc
    return argv


def mode_of(directory: str) -> str:
    try:
        return f"{stat.S_IMODE(os.stat(directory).st_mode):04o}"
    except OSError as exc:
        raise SandboxError(f"cannot stat {directory!r} to make room for the workdir: {exc}") from exc

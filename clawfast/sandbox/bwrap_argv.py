"""The pieces of bwrap's command line that depend on the host, not on one sandbox: the rebuilt "room"
around a `workdir` inside a read-only system directory (`room_for`, `copy_of`, `mode_of`), the mount
points bwrap would make (`parents_to_make`) and the capabilities `setpriv` needs as root. The whole
command line of one run, and why it is what it is, is `BwrapSandbox._launch_argv` and the
`clawfast.sandbox.bwrap` module docstring; the covers of `hide_paths` (`hide_argv`). `room_for` and
`hide_argv` check a workdir and the hidden paths before anything is made on the host.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence

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


def hide_argv(paths: Sequence[str], view: RootView, ro_binds: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """bwrap arguments that cover each of the host `paths` wherever the sandbox would show it: in a
    view directory, and inside each `ro_binds` source at its target. Returns (the covers of view
    paths, to come before the binds; the covers inside bind targets, to come after them).

    Each path is resolved on the host first (`realpath`), so that a path named through a link
    (/lib/x where /lib -> usr/lib) is covered where it lies (/usr/lib/x); the links, followed inside,
    then lead to the cover too. A directory is covered by an empty tmpfs, anything else by an
    unreadable empty file. A path that does not exist, or that neither the view nor a bind shows, is
    invisible already and needs nothing. ValueError for a path that resolves to / (it cannot be
    covered without covering everything)."""
    in_view: list[str] = []
    in_binds: list[str] = []
    for path in paths:
        real = os.path.realpath(path)
        if real == "/":
            raise ValueError(f"hide_paths: {path!r} resolves to /, which cannot be hidden")
        if not os.path.lexists(real):
            continue
        cover = ["--tmpfs"] if os.path.isdir(real) else ["--ro-bind", view.blank]
        if view.shows(real):
            in_view += cover + [real]
        for source, target in ro_binds.items():
            rel = os.path.relpath(real, os.path.realpath(source))
            if rel == ".":
                in_binds += cover + [os.path.normpath(target)]
            elif rel != ".." and not rel.startswith("../"):
                in_binds += cover + [os.path.join(os.path.normpath(target), rel)]
    return in_view, in_binds


def check_bind_targets(targets: Sequence[str], view: RootView, room: str | None, hidden: Sequence[str]) -> None:
    """ValueError for a `ro_binds` target bwrap could not make: one missing on the host inside a view
    directory, which is a read-only bind when the target's mount point is made (as for a workdir,
    `room_for`; /usr/local/harness on a host without it). Fine where it is made in something writable:
    the workdir's rebuilt `room`, or a directory of `hidden` (covered by an empty tmpfs)."""
    writable = [room] if room is not None else []
    writable += [real for real in map(os.path.realpath, hidden) if os.path.isdir(real)]
    for target in targets:
        # As the sandbox resolves it: the view's top-level links are the host's.
        real = os.path.realpath(target)
        if not view.shows(real) or os.path.lexists(real):
            continue
        if any(real.startswith(w + "/") for w in writable):
            continue
        raise ValueError(
            f"SandboxSpec.ro_binds: target {target!r} does not exist on the host, and a system directory"
            " is read-only in the sandbox; choose a target outside them (e.g. under /opt) or one that exists"
        )


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

"""What a bwrap sandbox sees of the host: the one place that lists it (docs/SANDBOX.md explains why).

Visible, read-only:
- `SYSTEM_PATHS` that exist on the host: the programs and libraries (/usr, /bin, /sbin, /lib*) and
  /etc. A top-level entry that is a symbolic link on the host (merged /usr: /bin -> usr/bin) is
  recreated as the same link, never followed.
- in /etc, only what an unprivileged account on the host could read: every entry that is not readable
  by others (a file without o+r, a directory without o+rx: /etc/shadow, /etc/gshadow, /etc/ssl/private,
  ssh host keys, ...) is covered by an unreadable empty file or directory. /etc/passwd and /etc/group
  are replaced by generated ones that name root, nobody and the sandbox's own user (`agent`), so that
  programs which look their user up (Node's os.userInfo(), ssh, git) find it, and the host's accounts
  stay unlisted.
- whatever the spec binds (`SandboxSpec.ro_binds`: a harness install, the language runtime it was
  built on) at the spec's target.
Private to the sandbox: its workspace (read-write), its home (read-write), a /tmp, /dev/shm and /run of
its own (tmpfs), a minimal /dev and a /proc of its own PID namespace.
Nothing else: no /root, /home, /opt, /srv, /var, /sys, /work or any other host directory, so no
checkout, cache, task folder, verifier file, record or host socket is there to read or connect to.
The view is taken when the backend is made: a secret added to /etc later is not covered.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
USER_NAME = "agent"


def etc_secrets(etc: str = "/etc") -> list[tuple[str, bool]]:
    """The entries under `etc` that others may not read, as (path, is_directory); a directory that
    others may not enter is listed whole, not descended into. Symbolic links are left out: what they
    point to is judged where it lies."""
    secrets: list[tuple[str, bool]] = []
    for dirpath, dirnames, filenames in os.walk(etc, followlinks=False):
        readable = []
        for name in sorted(dirnames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            if st.st_mode & 0o005 != 0o005:
                secrets.append((path, True))
            else:
                readable.append(name)
        dirnames[:] = readable
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not stat.S_ISLNK(st.st_mode) and not st.st_mode & 0o004:
                secrets.append((path, False))
    return secrets


def identity_files(directory: str, uid: int, gid: int) -> tuple[str, str]:
    """Write the sandbox's /etc/passwd and /etc/group into `directory`; returns their paths."""
    home = "/run/home"
    users = [("root", 0, 0, "/root"), ("nobody", 65534, 65534, "/nonexistent")]
    if uid not in (0, 65534):
        users.append((USER_NAME, uid, gid, home))
    groups = [("root", 0), ("nogroup", 65534)] + ([(USER_NAME, gid)] if gid not in (0, 65534) else [])
    passwd = os.path.join(directory, "passwd")
    group = os.path.join(directory, "group")
    with open(passwd, "w") as f:
        f.writelines(f"{name}:x:{u}:{g}:{name}:{h}:/bin/sh\n" for name, u, g, h in users)
    with open(group, "w") as f:
        f.writelines(f"{name}:x:{g}:\n" for name, g in groups)
    for path in (passwd, group):
        os.chmod(path, 0o644)
    return passwd, group


class RootView:
    """The bwrap arguments of the minimal root, computed once per backend.

    `directory` is a host directory the sandbox never sees (the backend's own), where the generated
    identity files and the empty file that covers secret files are kept."""

    def __init__(self, directory: str, uid: int, gid: int, system_paths: Sequence[str] = SYSTEM_PATHS) -> None:
        self.system_paths = tuple(p for p in system_paths if os.path.lexists(p))
        self.mounted = tuple(p for p in self.system_paths if not os.path.islink(p))
        passwd, group = identity_files(directory, uid, gid)
        # The unreadable empty file that covers a file (the /etc secrets, `hide_paths`).
        self.blank = blank = os.path.join(directory, "covered")
        with open(blank, "w"):
            pass
        os.chmod(blank, 0)
        argv: list[str] = []
        # Parents of a nested system path, made readable (bwrap would make them root's 0700).
        parents = {os.path.dirname(p) for p in self.system_paths if os.path.dirname(p) != "/"}
        for path in sorted({a for p in parents for a in ancestors(p)}):
            argv += ["--perms", "0755", "--dir", path]
        for path in self.system_paths:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            else:
                argv += ["--ro-bind", path, path]
        self.system_argv = argv
        covers: list[str] = []
        if "/etc" in self.mounted:
            for path, is_dir in etc_secrets("/etc"):
                covers += ["--perms", "0000", "--tmpfs", path] if is_dir else ["--ro-bind", blank, path]
            covers += ["--ro-bind", passwd, "/etc/passwd", "--ro-bind", group, "/etc/group"]
        self.cover_argv = covers

    def shows(self, path: str) -> bool:
        """Whether `path` lies in a host directory the view binds (so it is visible unless covered)."""
        return any(path == p or path.startswith(p + "/") for p in self.mounted)


def ancestors(path: str) -> list[str]:
    """`path` and its ancestors below /: /a/b -> [/a, /a/b]; / -> []."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]

"""What the isolating backends (bwrap, docker) share: the sandbox's host directory and its start script.

`HostDir` is one sandbox's directory on the host: `data/ws/` (the workspace, bound at the sandbox's
workdir: /run/ws unless `SandboxSpec.workdir` says otherwise), `data/home/` (bound at /run/home),
`proxy/` (one Unix socket per allowed port, bound read-only at /run/proxy) and, if asked, `io/` (stdin
files for docker). bwrap keeps its capture files in the top directory, which is never visible inside.
`close()` stops the forwarders and removes it all. (Every directory counts: `rmdir` on this machine's
ext4 costs ~2.4 ms against ~0.01 ms on tmpfs; see bench/bench_sandbox.py.)

The disk quota (`Limits.disk_bytes`): `data/` is a tmpfs of that size, mounted on the host when the
process may mount (root); elsewhere `HostDir.quota` is None and the quota is not enforced (the
backends say so in `Sandbox.enforced` and log it once). The capture files stay outside it, so a
sandbox that filled its disk still reports what its next command printed. A mount left by an owner
that was killed is unmounted by `sweep_stale_dirs`.

The sandbox's user: with `owner` (uid, gid) set, `hand_over()` gives the workspace and home, and each
proxy socket, to that user; the backends call it before every command, since the host writes into
the workspace between commands (the pool's files, a verifier's tests, a harness's configuration).

`start_script` is the POSIX sh that runs inside before the command: rlimits, proxy forwarders, then a
readiness marker on stderr and `exec` of the command. A run whose stderr does not begin with the
marker never reached the command: the sandbox failed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping

from clawfast.sandbox.base import SandboxBackend, SandboxError
from clawfast.sandbox.forward import HostForwarder, inner_forwarders_script, socat_check
from clawfast.sandbox.spec import DEFAULT_PATH, HOMEDIR, PROXYDIR, SandboxSpec, check_env_entry, name_label
from clawfast.sandbox.workspace import populate

READY = b"clawfast-sandbox-ready\n"
log = logging.getLogger("clawfast.sandbox")

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount_tmpfs(target: str, size_bytes: int, mode: int = 0o755) -> None:
    """Mount a tmpfs of `size_bytes` on `target` (OSError with the kernel's errno on failure)."""
    options = f"size={size_bytes},mode={mode:o}".encode()
    if _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def unmount(target: str) -> None:
    # Detached: a process still holding a file in it (a late reader) cannot keep the directory busy.
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point (any more)
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts_under(directory: str) -> list[str]:
    """Mount points of this mount namespace at or below `directory`, deepest first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split(" ", 5)[4]
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
            if point == directory or point.startswith(directory + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


class HostDir:
    """quota: the size of `data/` when it is a tmpfs of its own, else None (not enforced here).
    owner: (uid, gid) the sandbox runs as, to hand its files to; None when it runs as this process's
    own user."""

    def __init__(
        self,
        spec: SandboxSpec,
        base_dir: str,
        forwarder: Callable[[], HostForwarder],
        *,
        io_dir: bool = False,
        owner: tuple[int, int] | None = None,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix=name_label(spec.name) + "-", dir=base_dir)
        self.data = os.path.join(self.dir, "data")
        self.workspace = os.path.join(self.data, "ws")
        self.home = os.path.join(self.data, "home")
        self.proxy = os.path.join(self.dir, "proxy")
        self.io = os.path.join(self.dir, "io")
        self.owner = owner
        self.quota: int | None = None
        self._forwarder: HostForwarder | None = None
        self._servers: list = []
        try:
            os.mkdir(self.data, 0o755)
            if spec.limits.disk_bytes is not None and os.geteuid() == 0:
                mount_tmpfs(self.data, spec.limits.disk_bytes)
                self.quota = spec.limits.disk_bytes
            try:
                populate(self.workspace, spec.source_dir, spec.files)
                populate(self.home, None, spec.home_files)
            except OSError as exc:
                if exc.errno == errno.ENOSPC and self.quota is not None:
                    raise SandboxError(f"the task's files exceed the sandbox's disk quota ({self.quota} bytes)") from exc
                raise
            if io_dir:
                os.mkdir(self.io)
            if spec.allow_ports:
                os.mkdir(self.proxy)
                self._forwarder = forwarder()
                for port in spec.allow_ports:
                    self._servers.append(self._forwarder.add(os.path.join(self.proxy, f"{port}.sock"), port))
            self.hand_over()
        except OSError as exc:
            self.close()
            raise SandboxError(f"cannot provision the sandbox directory: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def hand_over(self) -> None:
        """Give what the host wrote into the workspace and home, and the proxy sockets, to the
        sandbox's user (nothing to do when it runs as this process's own user)."""
        if self.owner is None:
            return
        uid, gid = self.owner
        for root in (self.workspace, self.home):
            _chown_tree(root, uid, gid)
        for server in self._servers:
            os.lchown(server.path, uid, gid)

    def close(self) -> None:
        try:
            for server in self._servers:
                self._forwarder.remove(server)
            self._servers = []
        finally:
            try:
                if self.quota is not None:
                    unmount(self.data)
            finally:
                remove_tree(self.dir)


def remove_tree(path: str) -> None:
    """Remove `path` and everything in it, as far as possible: what cannot be removed is logged (a
    warning), not raised, so that a close always gets to the rest of its cleanup.

    Not root, a directory the sandbox closed to its owner (`chmod 000 d`: unreadable, or without
    write permission) would stop `shutil.rmtree`; the sandbox's files belong to this process's user,
    so the directory's rights are given back (u+rwx) and the step retried."""

    def retry(func, failed: str, exc) -> None:
        error = exc if isinstance(exc, BaseException) else exc[1]  # onexc, or onerror's exc_info
        if isinstance(error, PermissionError):
            try:
                _grant_owner(os.path.dirname(failed))  # the parent may lack write or search permission
                if func in (os.unlink, os.rmdir, os.remove):
                    func(failed)
                    return
                # The directory itself could not be opened or listed: open it up, remove it whole.
                _grant_owner(failed)
                shutil.rmtree(failed, **{handler: retry})
                return
            except OSError as again:
                error = again
        if not isinstance(error, FileNotFoundError):  # gone meanwhile: nothing is left there
            log.warning("could not remove %s: %s", failed, error)

    # `onerror` is deprecated from Python 3.12 on, in favour of `onexc` (an exception, not exc_info).
    handler = "onexc" if sys.version_info >= (3, 12) else "onerror"
    try:
        shutil.rmtree(path, **{handler: retry})
    except RecursionError:
        # A tree deeper than Python's recursion (the agent's `mkdir -p a/a/a/...`, ~1,000 levels):
        # rm walks it without recursing.
        subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True)
        if os.path.lexists(path):
            log.warning("could not remove %s: a tree too deep for shutil.rmtree, and rm -rf left it", path)


def _grant_owner(directory: str) -> None:
    """u+rwx on `directory` if it is one (never through a link)."""
    st = os.lstat(directory)
    if stat.S_ISDIR(st.st_mode):
        os.chmod(directory, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)


def _chown_tree(root: str, uid: int, gid: int) -> None:
    """Give every entry under `root` (itself included) that is not already the user's to it.

    The sandbox may be running another command meanwhile and swap a directory for a link to a host
    directory: the walk goes by directory descriptors (`os.fwalk`, which skips a directory replaced
    between its listing and its opening) and changes owners relative to them without following
    links, so it never leaves the tree. A file with several names, or on another filesystem, is
    left as it is: it may be a host file under another name."""
    device = os.lstat(root).st_dev

    def give(name: str, dir_fd: int | None) -> None:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return  # removed by a command running meanwhile
        if (st.st_uid, st.st_gid) == (uid, gid) or st.st_dev != device:
            return
        if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
            return
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    give(root, None)
    for _, dirnames, filenames, dir_fd in os.fwalk(root, follow_symlinks=False):
        for name in dirnames + filenames:
            give(name, dir_fd)


def merge_env(spec: SandboxSpec, env: Mapping[str, str] | None, *, home: str = HOMEDIR, tmp: str = "/tmp") -> dict[str, str]:
    """Defaults, then the spec's environment, then the run's (validated)."""
    full = {"PATH": DEFAULT_PATH, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8"}
    full.update(spec.env)
    for key, value in (env or {}).items():
        check_env_entry(key, value)
        full[key] = value
    return full


class ForwardingBackend(SandboxBackend):
    """A backend whose sandboxes reach allowed host ports through one shared HostForwarder, started
    the first time a sandbox needs it (bwrap and docker). `_release` stops it, then removes
    `base_dir`, the directory the subclass made its sandboxes' directories in."""

    base_dir: str

    def __init__(self) -> None:
        super().__init__()
        self._forwarder: HostForwarder | None = None

    def forwarder(self) -> HostForwarder:
        with self._lock:
            if self._forwarder is None:
                self._forwarder = HostForwarder()
            return self._forwarder

    def _release(self) -> None:
        if self._forwarder is not None:
            self._forwarder.close()
        remove_tree(self.base_dir)


def start_script(spec: SandboxSpec, socat: str, forwarders: bool = True, chdir: str | None = None) -> str:
    """The sh run inside before `exec "$@"` (the command comes as the script's arguments). With
    `forwarders=False` (a start probe) it only checks that socat exists when ports are allowed.
    `chdir`: the directory to start in, entered here as the sandbox's user (bwrap's own --chdir runs
    before the switch to that user, without the right to enter a workspace the user closed to others)."""
    limits = spec.limits
    lines = [] if chdir is None else [f"cd {shlex.quote(chdir)} || exit 125"]
    if limits.max_file_bytes is not None:
        lines.append(f"ulimit -f {-(-limits.max_file_bytes // 512)} || exit 125")  # 512-byte blocks
    if limits.address_space_bytes is not None:
        lines.append(f"ulimit -v {-(-limits.address_space_bytes // 1024)} || exit 125")
    if spec.allow_ports and forwarders:
        lines.append(inner_forwarders_script(socat, spec.allow_ports, PROXYDIR))
    elif spec.allow_ports:
        lines.append(socat_check(socat))
    lines.append(f"printf '{READY.decode().strip()}\\n' >&2")
    lines.append('exec "$@"')
    return "\n".join(lines)


def split_ready(stderr: bytes) -> tuple[bool, bytes]:
    """(whether the command was started, its stderr without the marker)."""
    if stderr.startswith(READY):
        return True, stderr[len(READY):]
    return False, stderr


def sweep_stale_dirs(parent: str | None, prefix: str) -> list[str]:
    """Remove `<parent>/<prefix><pid>-*` directories whose owner pid is no longer alive (left by a
    process killed before it could clean up), unmounting the quota filesystems in them first.
    Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for entry in os.listdir(parent):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-.+", entry)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            path = os.path.join(parent, entry)
            for point in mounts_under(path):
                unmount(point)
            remove_tree(path)
            removed.append(path)
    return removed

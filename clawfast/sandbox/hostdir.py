"""What the isolating backends (bwrap, docker) share: the sandbox's host directory and its start script.

`HostDir` is one sandbox's directory on the host: `ws/` (the workspace, bound at the sandbox's
workdir: /run/ws unless `SandboxSpec.workdir` says otherwise), `home/` (bound at /run/home), `proxy/`
(one Unix socket per allowed port, bound read-only at /run/proxy) and, if asked, `io/` (stdin files
for docker). bwrap keeps its capture files in the top directory, which is never visible inside.
`close()` stops the forwarders and removes it all. (Every directory counts: `rmdir` on this machine's
ext4 costs ~2.4 ms against ~0.01 ms on tmpfs; see bench/bench_sandbox.py.)

`start_script` is the POSIX sh that runs inside before the command: rlimits, proxy forwarders, then a
readiness marker on stderr and `exec` of the command. A run whose stderr does not begin with the
marker never reached the command: the sandbox failed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping

from clawfast.sandbox.base import (
    DEFAULT_PATH,
    HOMEDIR,
    PROXYDIR,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    check_env_entry,
    populate,
)
from clawfast.sandbox.forward import HostForwarder, inner_forwarders_script, socat_check

READY = b"clawfast-sandbox-ready\n"


class HostDir:
    def __init__(
        self, spec: SandboxSpec, base_dir: str, forwarder: Callable[[], HostForwarder], *, io_dir: bool = False
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix=spec.name + "-", dir=base_dir)
        self.workspace = os.path.join(self.dir, "ws")
        self.home = os.path.join(self.dir, "home")
        self.proxy = os.path.join(self.dir, "proxy")
        self.io = os.path.join(self.dir, "io")
        self._forwarder: HostForwarder | None = None
        self._servers: list = []
        try:
            populate(self.workspace, spec.source_dir, spec.files)
            populate(self.home, None, spec.home_files)
            if io_dir:
                os.mkdir(self.io)
            if spec.allow_ports:
                os.mkdir(self.proxy)
                self._forwarder = forwarder()
                for port in spec.allow_ports:
                    self._servers.append(self._forwarder.add(os.path.join(self.proxy, f"{port}.sock"), port))
        except OSError as exc:
            self.close()
            raise SandboxError(f"cannot provision the sandbox directory: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            for server in self._servers:
                self._forwarder.remove(server)
            self._servers = []
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


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
    the first time a sandbox needs it and stopped by `_close_forwarder` (bwrap and docker)."""

    def __init__(self) -> None:
        super().__init__()
        self._forwarder: HostForwarder | None = None

    def forwarder(self) -> HostForwarder:
        with self._lock:
            if self._forwarder is None:
                self._forwarder = HostForwarder()
            return self._forwarder

    def _close_forwarder(self) -> None:
        if self._forwarder is not None:
            self._forwarder.close()


def start_script(spec: SandboxSpec, socat: str, forwarders: bool = True) -> str:
    """The sh run inside before `exec "$@"` (the command comes as the script's arguments). With
    `forwarders=False` (a start probe) it only checks that socat exists when ports are allowed."""
    limits = spec.limits
    lines = []
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
    process killed before it could clean up). Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for entry in os.listdir(parent):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-.+", entry)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            path = os.path.join(parent, entry)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed

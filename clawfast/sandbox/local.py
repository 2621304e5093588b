"""The `local` backend: a plain subprocess in a temporary directory. NO ISOLATION.

For debugging a harness outside any sandbox only; it must be asked for with `allow_unsafe=True`.
The command runs as the current user with the host's network (`allow_ports` are not enforced: every
host port is reachable) and can write anywhere the user can. What it does give: a fresh temporary
workspace and HOME (its `workdir`/`home` are host paths), a clean environment (the host's is not
inherited), RLIMIT_FSIZE/RLIMIT_AS like bwrap, and on timeout the command's whole process group is
killed, and so is whatever the command left running in it when it exits (a process that calls
setsid() escapes both: there is no PID namespace here). A spec with `workdir` is refused (ValueError):
without a mount namespace the workspace cannot appear at an absolute path.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Mapping

from clawfast.sandbox.base import Sandbox, SandboxBackend, SandboxError
from clawfast.sandbox.hostdir import remove_tree
from clawfast.sandbox.process import kill_group, wait_exit
from clawfast.sandbox.result import RunResult, capped_result
from clawfast.sandbox.spec import DEFAULT_PATH, SandboxSpec, check_env_entry, name_label, rlimit_enforced
from clawfast.sandbox.workspace import populate


class LocalSandbox(Sandbox):
    def __init__(self, backend: LocalBackend, spec: SandboxSpec) -> None:
        super().__init__(backend, spec)
        self.dir = tempfile.mkdtemp(prefix=name_label(spec.name) + "-", dir=backend.base_dir)
        self.host_workdir = self.workdir = os.path.join(self.dir, "ws")
        self.home = self.host_home = os.path.join(self.dir, "home")
        self.enforced = {"wall": "SIGKILL of the process group at the timeout"}
        self.enforced.update(rlimit_enforced(spec.limits))
        self._running: set[subprocess.Popen] = set()

    def start(self) -> None:
        """Fill the new workspace and home from the spec."""
        populate(self.host_workdir, self.spec.source_dir, self.spec.files)
        populate(self.home, None, self.spec.home_files)

    def _run_command(
        self, argv: list[str], env: Mapping[str, str] | None, timeout: float, stdin: bytes | None
    ) -> RunResult:
        full_env = {"PATH": DEFAULT_PATH, "HOME": self.home, "TMPDIR": self.dir, "LANG": "C.UTF-8"}
        full_env.update(self.spec.env)
        for key, value in (env or {}).items():
            check_env_entry(key, value)
            full_env[key] = value
        limits = self.spec.limits
        ulimits = []
        if limits.max_file_bytes is not None:
            ulimits.append(f"ulimit -f {-(-limits.max_file_bytes // 512)}")
        if limits.address_space_bytes is not None:
            ulimits.append(f"ulimit -v {-(-limits.address_space_bytes // 1024)}")
        wrapped = ["/bin/sh", "-c", "; ".join(ulimits + ['exec "$@"']), "sh"] + argv
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as inp:
            inp.write(stdin or b"")
            inp.seek(0)
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen(
                    wrapped, cwd=self.workdir, env=full_env, stdin=inp, stdout=out, stderr=err, start_new_session=True
                )
            except OSError as exc:
                raise SandboxError(f"cannot start the command: {exc}") from exc
            with self._lock:
                self._running.add(proc)
            timed_out = False
            try:
                timed_out = not wait_exit(proc, timeout)
            finally:
                # Also after a normal exit: background processes left in the group die with the run.
                kill_group(proc)
                with self._lock:
                    self._running.discard(proc)
            duration = time.monotonic() - t0
            cap = limits.max_output_bytes
            out.seek(0)
            stdout = out.read(cap + 1)
            err.seek(0)
            stderr = err.read(cap + 1)
        if self._closed:
            raise SandboxError("sandbox was closed while the command ran")
        code = proc.returncode
        exit_code = None if timed_out else (128 - code if code < 0 else code)
        return capped_result(exit_code, stdout, stderr, cap, timed_out=timed_out, duration_s=duration)

    def _in_flight(self) -> list[subprocess.Popen]:
        return list(self._running)

    def _stop(self, in_flight: list[subprocess.Popen]) -> None:
        for proc in in_flight:
            kill_group(proc)

    def _remove(self) -> None:
        remove_tree(self.dir)


class LocalBackend(SandboxBackend):
    name = "local"
    sandbox_type = LocalSandbox

    def __init__(self, *, allow_unsafe: bool = False, base_dir: str | None = None) -> None:
        if not allow_unsafe:
            raise ValueError("the local backend does not isolate anything; pass allow_unsafe=True to use it")
        # Absolute: a relative one would name another directory once the process changed directory.
        self.base_dir = os.path.abspath(tempfile.mkdtemp(prefix=f"clawfast-local-{os.getpid()}-", dir=base_dir))
        super().__init__()

    def _check_spec(self, spec: SandboxSpec) -> None:
        if spec.workdir is not None:
            # Refused rather than ignored: the task's files and verifier name that absolute path.
            raise ValueError(
                f"the local backend cannot put the workspace at workdir {spec.workdir!r} (it has no mount"
                " namespace); use the bwrap or docker backend"
            )

    def _release(self) -> None:
        remove_tree(self.base_dir)

"""The sandbox contract: one isolated workspace per rollout, commands run inside it, files read back.

A `SandboxBackend` turns a `SandboxSpec` into a started `Sandbox` (or raises `SandboxError`). A
`Sandbox` runs commands (`run` -> `RunResult`), exposes its workspace for scoring (`read_file`,
`read_files`) and is destroyed by `close()`. The concrete backends (`bwrap`, `docker`, `local`) say in
their own docstrings what they isolate and which limits they enforce; this module holds what they share.

Guaranteed by every backend:
- `SandboxError` means the sandbox itself failed (did not start, died, its forwarder broke), never that
  the command failed: a command's failure is a `RunResult` with its exit code. Callers mark the rollout
  `sandbox_error` on the former and score the latter.
- `run` returns within `timeout` plus a bounded kill grace; on timeout the whole process tree of the
  command is killed and `timed_out` is set.
- `close()` is idempotent and leaves no process, mount or temporary directory behind.
- Files are read back and written without following symbolic links, so a sandbox cannot make the host
  read or write a file outside its workspace; reads are bounded (`read_file(max_bytes=)`,
  `read_files(max_total_bytes=)`, by the files' sizes, a sparse file counting in full).
- `SandboxBackend.close()` during a `create` in another thread leaves nothing either: each sandbox's
  `close` waits for its start. One sandbox that fails to close does not stop the others closing.

This module holds the contract and the lifecycle every backend shares: `SandboxBackend.create` and
`close`, `Sandbox.close`, with hooks for what each backend does differently. What a sandbox starts
from is in `clawfast.sandbox.spec`, what a command returns in `clawfast.sandbox.result`.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor

from clawfast.sandbox.result import RunResult
from clawfast.sandbox.spec import MiB, SandboxSpec, warm_key
from clawfast.sandbox.workspace import populate, read_file, read_tree, write_files

# The host uid and gid every sandboxed process runs as when clawfast runs as root (the isolating
# backends' `uid` option changes it). Not a login account: outside the ranges Debian gives to users
# (1000-59999) and to system accounts, so no host file belongs to it unless a sandbox wrote it. Inside
# it is called "agent" (see clawfast.sandbox.view).
SANDBOX_UID = 61000


class SandboxError(RuntimeError):
    """The sandbox failed to start, died, or lost its proxy forwarder. The rollout is `sandbox_error`."""


def check_command(cmd: Sequence[str]) -> list[str]:
    if isinstance(cmd, (str, bytes)) or not cmd:
        raise ValueError("command must be a non-empty list of arguments (use ['sh', '-c', ...] for a shell line)")
    out = list(cmd)
    for arg in out:
        if not isinstance(arg, str) or "\0" in arg:
            raise ValueError(f"command argument {arg!r} must be a str without NUL")
    return out


class Sandbox(abc.ABC):
    """One started sandbox. Thread-safe for `run` from several threads; `close` ends everything.

    workdir: the workspace as commands see it (the initial directory of every command; the spec's
        `workdir` where it has one).
    home: HOME as commands see it.
    host_workdir: the same workspace on the host (read it only while no command runs).
    host_home: the private home on the host.
    enforced: limit name -> how it is enforced here (e.g. {"memory": "cgroup v2 memory", "user": "uid 61000 via setpriv"});
        a limit absent from the dict is not enforced by this sandbox.
    """

    backend: SandboxBackend
    spec: SandboxSpec
    workdir: str
    home: str
    host_workdir: str
    host_home: str
    enforced: dict[str, str]
    # Set by SandboxPool so that `arun` never competes for the small default executor.
    executor: Executor | None = None

    def __init__(self, backend: SandboxBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self._closed = False
        # Guards `_closed` and what the sandbox tracks of its runs in flight.
        self._lock = threading.Lock()
        # Clear while `SandboxBackend.create` runs `start`: a `close` from another thread (the
        # backend's) waits for it, so that it finds every resource the start made.
        self._start_done = threading.Event()
        self._start_done.set()

    @abc.abstractmethod
    def start(self) -> None:
        """Make the new sandbox ready for commands. `SandboxBackend.create` calls it once and closes
        the sandbox if it raises."""

    def run(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> RunResult:
        """Run `cmd` (argv, no shell) in `workdir`. Raises SandboxError if the sandbox failed,
        ValueError on a bad command or a timeout that is not > 0 (None: the spec's default)."""
        argv = check_command(cmd)
        timeout = self.spec.default_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        return self._run_command(argv, env, timeout, stdin)

    @abc.abstractmethod
    def _run_command(
        self, argv: list[str], env: Mapping[str, str] | None, timeout: float, stdin: bytes | None
    ) -> RunResult:
        """`run` after its arguments were checked: the backend's way of running one command."""

    async def arun(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> RunResult:
        """`run` in an executor thread (the pool's, if this sandbox came from a pool)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, lambda: self.run(cmd, env=env, timeout=timeout, stdin=stdin)
        )

    def read_file(self, path: str, *, max_bytes: int = 256 * MiB) -> bytes:
        """A workspace file by relative path (no symlinks followed); ValueError if it holds more than
        `max_bytes` (its size as fstat gives it: a sparse file counts in full)."""
        return read_file(self.host_workdir, path, max_bytes)

    def read_files(self, paths: Sequence[str] | None = None, *, max_total_bytes: int = 256 * MiB) -> dict[str, bytes]:
        """The given workspace files (missing ones omitted), or every regular file when `paths` is None;
        ValueError if together they hold more than `max_total_bytes`."""
        if paths is None:
            return read_tree(self.host_workdir, max_total_bytes)
        out = {}
        left = max_total_bytes
        for path in paths:
            try:
                # What is left of the budget: the ValueError names the file that ran past it.
                data = read_file(self.host_workdir, path, left)
            except FileNotFoundError:
                continue
            out[path] = data
            left -= len(data)
        return out

    def provision(self, spec: SandboxSpec) -> None:
        """Add `spec`'s source_dir, files and home_files to this (empty, idle) sandbox and adopt `spec`.
        Only for a sandbox made from a spec equal to `spec` but for those fields (the warm pool)."""
        if warm_key(spec) != warm_key(self.spec):
            raise ValueError("provision: the spec differs in more than files/source_dir/home_files/name")
        populate(self.host_workdir, spec.source_dir, spec.files)
        populate(self.host_home, None, spec.home_files)
        self.spec = spec

    def write_files(self, files: Mapping[str, bytes | str]) -> None:
        """Add or overwrite workspace files (e.g. a verifier's tests after the harness ran)."""
        write_files(self.host_workdir, files)

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    def close(self) -> None:
        """Kill everything still running, remove every temporary file. Idempotent; waits for a start
        in progress (`SandboxBackend.close` during a `create`). Raises OSError only
        when something could not be removed (a cgroup whose processes would not die, a container the
        engine would not delete); a command still running in another thread gets SandboxError."""
        # A start in progress makes its resources one by one: they are all there, or its own failure
        # closed them, once it returned (bounded: a start's commands have timeouts).
        self._start_done.wait()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = self._in_flight()
        try:
            self._stop(in_flight)
        finally:
            self._remove()
            self.backend.forget(self)

    def _in_flight(self) -> list:
        """The runs `close` must end, taken under the lock in the step that marks the sandbox closed,
        so that no run can start unseen between the two. Nothing by default."""
        return []

    @abc.abstractmethod
    def _stop(self, in_flight: list) -> None:
        """End `in_flight` (what `_in_flight` returned) and whatever else of the sandbox runs; OSError
        when something would not end."""

    @abc.abstractmethod
    def _remove(self) -> None:
        """Remove the sandbox's files on the host; runs even when `_stop` raised."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SandboxBackend(abc.ABC):
    """Creates sandboxes of one kind. `close()` releases backend-wide resources (forwarder thread,
    Docker client) and closes sandboxes still open.

    sandbox_type: the backend's `Sandbox` class, made as `sandbox_type(backend, spec)` by `create`."""

    name: str
    sandbox_type: type[Sandbox]

    def __init__(self) -> None:
        # The sandboxes created and not yet closed, so that `close()` can close them.
        self._live: set[Sandbox] = set()
        self._lock = threading.Lock()
        self._closed = False

    def create(self, spec: SandboxSpec) -> Sandbox:
        """Provision and start a sandbox; SandboxError if it cannot start, ValueError on a bad spec."""
        spec.validate()
        if self._closed:
            raise SandboxError("backend is closed")
        self._check_spec(spec)
        sandbox = self.sandbox_type(self, spec)
        with self._lock:
            # Checked again under the lock `close` takes its list of live sandboxes under: a sandbox
            # added after that would be started, and never closed, by a closed backend.
            if self._closed:
                raise SandboxError("backend is closed")
            self._live.add(sandbox)
        sandbox._start_done.clear()
        try:
            sandbox.start()
        except BaseException:
            sandbox._start_done.set()
            sandbox.close()
            raise
        sandbox._start_done.set()
        if sandbox.closed:
            raise SandboxError("backend was closed while the sandbox started")
        return sandbox

    def _check_spec(self, spec: SandboxSpec) -> None:
        """Refuse a valid spec this backend cannot serve: ValueError for what it cannot do at all,
        SandboxError for what this host lacks. Accepts every spec by default."""

    def forget(self, sandbox: Sandbox) -> None:
        """Called by a sandbox's `close()`: it is no longer live."""
        with self._lock:
            self._live.discard(sandbox)

    def close(self) -> None:
        """Close the sandboxes still open, then `_release` what the backend holds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live)
        # Each is closed even when one before it raised; the first error is raised at the end.
        errors = []
        for sandbox in live:
            try:
                sandbox.close()
            except OSError as exc:
                errors.append(exc)
        self._release()
        if errors:
            raise errors[0]

    @abc.abstractmethod
    def _release(self) -> None:
        """Release the backend-wide resources (temporary directory, forwarder thread, Docker client),
        once its sandboxes are closed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

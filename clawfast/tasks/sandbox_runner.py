"""`SandboxRunner`: the `CommandRunner` that runs each verifier command in a fresh clawfast sandbox.

Each call stages ``workspace/`` (the final workspace copy) and the verifier files side by side (in
a folder whose name the agent cannot know, `clawfast.tasks.verify.hidden_dir_name`: a link it
planted cannot lead a check there), starts a new sandbox from that directory, runs ``bash -c
command`` inside ``workspace/`` with ``$VERIFIER_DIR`` pointing at that sibling, and destroys the
sandbox. The staging costs one more copy of the workspace, but it works the same on every backend:
the local backend ignores read-only binds, so binding the verifier files would not be portable.

Isolation is the backend's (bwrap by default: no network, a minimal read-only root, an unprivileged
user, the sandbox's own
PID namespace killed whole at the timeout); the verifier can change its copies freely. A sandbox that
fails to start raises `SandboxError` (an infrastructure fault, not a score): callers mark the rollout
``sandbox_error``. Everything the command does is a `CommandResult`, which `run_verifier` turns into
a score or a ``verifier_error``. Unlike `SubprocessRunner`, which keeps the end of the output, the
sandbox keeps the first `Limits.max_output_bytes` (1 MiB here) of stdout: a verifier that prints
more than that gets ``verifier_error`` (`CommandResult.stdout_lost`), whatever it printed last, since
the line kept last is then not its score line.

With `workdir` (a task whose workspace has a fixed absolute path), the staged workspace is the
sandbox's workspace at that path and the command starts there; the verifier files, if any, are bound
read-only at ``/run/<that name>`` (``$VERIFIER_DIR``). The local backend cannot place a workspace, so it
refuses such a sandbox.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Mapping

from clawfast.sandbox import Limits, SandboxBackend, SandboxSpec, create_backend
from clawfast.sandbox.workspace import copy_workspace
from clawfast.tasks.verify import STDERR_TAIL_BYTES, STDOUT_TAIL_BYTES, CommandResult

# Verifiers are small programs over small workspaces; 1 GiB leaves room for a test suite.
VERIFIER_LIMITS = Limits(memory_bytes=1 << 30, max_processes=256, max_file_bytes=256 << 20,
                         max_output_bytes=1 << 20)
_SCRIPT = 'cd workspace && exec bash -c "$0"'


def _tail(data: bytes, limit: int) -> str:
    return data[-limit:].decode("utf-8", errors="replace")


class SandboxRunner:
    """Runs commands in fresh sandboxes of `backend` (default: a bwrap backend this runner owns and
    closes in `close()`; it skips bwrap's start-up probe, since a sandbox that cannot start fails the
    command itself with `SandboxError` anyway). Usable as a context manager."""

    def __init__(self, backend: SandboxBackend | None = None, *, limits: Limits = VERIFIER_LIMITS):
        self._owned = backend is None
        self.backend = backend if backend is not None else create_backend("bwrap", probe=False)
        self.limits = limits

    def __call__(self, command: str, workspace: Path, *, verifier_dir: Path | None, timeout: float,
                 workdir: str | None = None, env: Mapping[str, str] | None = None) -> CommandResult:
        base_env = {"LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        with tempfile.TemporaryDirectory(prefix="clawfast-stage-") as stage:
            copy_workspace(workspace, Path(stage) / "workspace")
            hidden = verifier_dir.name if verifier_dir is not None else None  # `hidden_dir_name`: unguessable
            if verifier_dir is not None:
                shutil.copytree(verifier_dir, Path(stage) / hidden, symlinks=True)
            if workdir is None:
                spec = SandboxSpec(source_dir=stage, limits=self.limits, default_timeout=timeout, env=base_env,
                                   name="verifier")
                argv = ["bash", "-c", _SCRIPT, command]
            else:
                binds = {str(Path(stage) / hidden): f"/run/{hidden}"} if verifier_dir is not None else {}
                spec = SandboxSpec(source_dir=str(Path(stage) / "workspace"), workdir=workdir, ro_binds=binds,
                                   limits=self.limits, default_timeout=timeout, env=base_env, name="verifier")
                argv = ["bash", "-c", command]
            with self.backend.create(spec) as sandbox:
                run_env = dict(env or {})
                if verifier_dir is not None:
                    run_env["VERIFIER_DIR"] = f"/run/{hidden}" if workdir else f"{sandbox.workdir}/{hidden}"
                res = sandbox.run(argv, env=run_env, timeout=timeout)
        # The sandbox keeps the head of stdout: past the cap, the last line kept is some line from the
        # middle (perhaps a workspace file the verifier printed), never the score line.
        lost = (f"verifier stdout exceeded {self.limits.max_output_bytes} bytes; its end, with the score line, "
                f"was dropped") if res.stdout_truncated else None
        return CommandResult(
            returncode=None if res.timed_out else res.exit_code,
            stdout=_tail(res.stdout, STDOUT_TAIL_BYTES),
            stderr=_tail(res.stderr, STDERR_TAIL_BYTES),
            timed_out=res.timed_out,
            duration_s=res.duration_s,
            stdout_lost=lost,
        )

    def close(self) -> None:
        if self._owned:
            self.backend.close()

    def __enter__(self) -> SandboxRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

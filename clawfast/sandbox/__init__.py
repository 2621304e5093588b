"""Sandboxes for rollouts: one isolated workspace per rollout whose only network peer is the proxy.

Backends: `bwrap` (the default; bubblewrap namespaces, see `clawfast.sandbox.bwrap`), `docker` (one
container per sandbox, see `clawfast.sandbox.docker_backend`) and `local` (no isolation, debugging only,
needs `allow_unsafe=True`). The contract is in `clawfast.sandbox.base`, what a sandbox starts from in
`clawfast.sandbox.spec`; the pool in `clawfast.sandbox.pool`.
"""

from __future__ import annotations

from clawfast.sandbox.base import Sandbox, SandboxBackend, SandboxError
from clawfast.sandbox.pool import PoolStats, SandboxPool
from clawfast.sandbox.result import RunResult
from clawfast.sandbox.spec import HOMEDIR, WORKDIR, Limits, SandboxSpec

BACKENDS = ("bwrap", "docker", "local")


def create_backend(name: str, **options) -> SandboxBackend:
    """A backend by name; `options` go to its constructor (see each backend's docstring)."""
    if name == "bwrap":
        from clawfast.sandbox.bwrap import BwrapBackend

        return BwrapBackend(**options)
    if name == "docker":
        from clawfast.sandbox.docker_backend import DockerBackend

        return DockerBackend(**options)
    if name == "local":
        from clawfast.sandbox.local import LocalBackend

        return LocalBackend(**options)
    raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "HOMEDIR",
    "WORKDIR",
    "Limits",
    "PoolStats",
    "RunResult",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxPool",
    "SandboxSpec",
    "create_backend",
]

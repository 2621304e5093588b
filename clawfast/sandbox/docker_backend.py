"""The `docker` backend: one container per sandbox, same contract as bwrap.

Needs the `docker` Python package and a Docker engine on this host (the workspace, home and proxy
sockets are host directories bind-mounted into the container, so a remote engine cannot work). The
image is the caller's: it must provide /bin/sh and `sleep`, and `socat` on PATH when ports are allowed
(checked at start: a missing one is a SandboxError); harness installs come in through `ro_binds`.

Each container runs `sleep infinity` under docker's init with: `network_mode="none"` (loopback only),
a read-only root filesystem, tmpfs /tmp and /run, the workspace at /run/ws or `SandboxSpec.workdir`
(the working directory of every command) and home at /run/home (read-write binds), the proxy sockets
at /run/proxy and `ro_binds` read-only, all capabilities dropped, `no-new-privileges`. Commands are
`docker exec`s of the same start script bwrap uses (rlimits, in-container socat forwarders, readiness
marker).

Limits: memory = `mem_limit` and `memswap_limit` (cgroup, by the engine); processes = `pids_limit`;
file size = RLIMIT_FSIZE (`ulimit -f` in the start script); address space = RLIMIT_AS if set; wall
time = on timeout the container is killed (every process in it, the command's whole tree included)
and started again, so the sandbox stays usable for the next command.
Not guaranteed: anything about images (pulling is the caller's business: nothing is pulled here).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping

from clawfast.sandbox.base import (
    HOMEDIR,
    PROXYDIR,
    WORKDIR,
    RunResult,
    Sandbox,
    SandboxError,
    SandboxSpec,
    capped_result,
    rlimit_enforced,
)
from clawfast.sandbox.hostdir import (
    ForwardingBackend,
    HostDir,
    merge_env,
    split_ready,
    start_script,
)

LABEL = "clawfast.sandbox.owner"
IO_DIR = "/run/io"


def connect(timeout: float = 5.0):
    """A Docker client that has answered a ping; SandboxError (with the reason) otherwise."""
    try:
        import docker
    except ImportError as exc:
        raise SandboxError("the docker backend needs the docker package (pip install docker)") from exc
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # the SDK raises DockerException, requests errors, FileNotFoundError...
        raise SandboxError(f"no Docker engine answers: {exc}") from exc
    return client


class DockerBackend(ForwardingBackend):
    """Options: image (must exist locally), base_dir (host dir for workspaces), probe (run `true`
    in each new container so `create` fails rather than the first command)."""

    name = "docker"

    def __init__(self, *, image: str = "debian:bookworm-slim", base_dir: str | None = None, probe: bool = True) -> None:
        self.client = connect()
        self.image = image
        self.probe = probe
        self.base_dir = tempfile.mkdtemp(prefix=f"clawfast-docker-{os.getpid()}-", dir=base_dir)
        super().__init__()

    def create(self, spec: SandboxSpec) -> DockerSandbox:
        self._check_can_create(spec)
        sandbox = DockerSandbox(self, spec)
        self._start_tracked(sandbox, sandbox.start)
        return sandbox

    def close(self) -> None:
        if not self._close_live():
            return
        self._close_forwarder()
        shutil.rmtree(self.base_dir, ignore_errors=True)
        self.client.close()


class DockerSandbox(Sandbox):
    def __init__(self, backend: DockerBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.workdir = spec.workdir or WORKDIR
        self.home = HOMEDIR
        self.hostdir: HostDir | None = None
        self.container = None
        self.enforced = {"wall": "container kill at the timeout", "processes": "docker pids_limit"}
        if spec.limits.memory_bytes is not None:
            self.enforced["memory"] = "docker mem_limit"
        self.enforced.update(rlimit_enforced(spec.limits))
        if spec.limits.max_processes is None:
            del self.enforced["processes"]
        self._closed = False
        self._lock = threading.Lock()
        self._counter = 0

    def start(self) -> None:
        from docker.errors import DockerException
        from docker.types import Mount

        self.hostdir = HostDir(self.spec, self.backend.base_dir, self.backend.forwarder, io_dir=True)
        self.host_workdir = self.hostdir.workspace
        self.host_home = self.hostdir.home
        mounts = [
            Mount(self.workdir, self.hostdir.workspace, type="bind"),
            Mount(HOMEDIR, self.hostdir.home, type="bind"),
            Mount(IO_DIR, self.hostdir.io, type="bind", read_only=True),
        ]
        if self.spec.allow_ports:
            mounts.append(Mount(PROXYDIR, self.hostdir.proxy, type="bind", read_only=True))
        for host_path, target in self.spec.ro_binds.items():
            mounts.append(Mount(target, os.path.abspath(host_path), type="bind", read_only=True))
        limits = self.spec.limits
        try:
            self.container = self.backend.client.containers.create(
                self.backend.image,
                command=["sleep", "infinity"],
                name=f"clawfast-{os.path.basename(self.hostdir.dir)}",
                labels={LABEL: str(os.getpid())},
                init=True,
                network_mode="none",
                read_only=True,
                tmpfs={"/tmp": "", "/run": ""},
                mounts=mounts,
                working_dir=self.workdir,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                mem_limit=limits.memory_bytes,
                memswap_limit=limits.memory_bytes,
                pids_limit=limits.max_processes,
                hostname="sandbox",
            )
            self.container.start()
        except DockerException as exc:
            raise SandboxError(f"cannot start a container from {self.backend.image!r}: {exc}") from exc
        if self.backend.probe:
            result = self.run(["true"], timeout=30)
            if result.exit_code != 0:
                raise SandboxError(f"sandbox probe failed: {result}")

    @property
    def closed(self) -> bool:
        return self._closed

    def _run_command(
        self, argv: list[str], env: Mapping[str, str] | None, timeout: float, stdin: bytes | None
    ) -> RunResult:
        from docker.errors import DockerException

        full_env = merge_env(self.spec, env)
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            self._counter += 1
            n = self._counter
        script = start_script(self.spec, "socat")
        if stdin is not None:
            with open(os.path.join(self.hostdir.io, f"{n}.in"), "wb") as f:
                f.write(stdin)
            script = script.replace('exec "$@"', f'exec "$@" < {IO_DIR}/{n}.in')
        else:
            script = script.replace('exec "$@"', 'exec "$@" < /dev/null')
        cap = self.spec.limits.max_output_bytes
        chunks = {"out": bytearray(), "err": bytearray()}
        failure: list[BaseException] = []
        api = self.backend.client.api
        t0 = time.monotonic()
        try:
            exec_id = api.exec_create(
                self.container.id, ["/bin/sh", "-c", script, "sh", *argv], environment=full_env, workdir=self.workdir
            )["Id"]

            def pump() -> None:
                try:
                    for out, err in api.exec_start(exec_id, stream=True, demux=True):
                        # Keep a little more than the cap of each (the marker, truncation detection).
                        if out and len(chunks["out"]) <= cap:
                            chunks["out"] += out
                        if err and len(chunks["err"]) <= cap + 64:
                            chunks["err"] += err
                except BaseException as exc:  # reported by the caller thread
                    failure.append(exc)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = reader.is_alive()
            if timed_out:
                # Killing the container ends every process in it; start it again for later commands.
                self.container.kill()
                reader.join(30)
                self.container.start()
            duration = time.monotonic() - t0
            exit_code = None if timed_out else api.exec_inspect(exec_id)["ExitCode"]
            self.container.reload()
            state = self.container.status
        except DockerException as exc:
            raise SandboxError(f"docker failed while running a command: {exc}") from exc
        finally:
            try:
                os.unlink(os.path.join(self.hostdir.io, f"{n}.in"))
            except FileNotFoundError:
                pass
        if failure and not timed_out:
            raise SandboxError(f"lost the command's output stream: {failure[0]}")
        if state != "running":
            raise SandboxError(f"container is {state} after the command")
        ready, stderr = split_ready(bytes(chunks["err"]))
        if not ready and not timed_out:
            raise SandboxError(f"sandbox failed to start (exit {exit_code}): {stderr[-2000:].decode(errors='replace')}")
        return capped_result(
            exit_code, bytes(chunks["out"]), stderr, cap, timed_out=timed_out, duration_s=duration
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self.container is not None:
                from docker.errors import DockerException, NotFound

                try:
                    self.container.remove(force=True)
                except NotFound:
                    pass
                except DockerException as exc:
                    raise OSError(f"cannot remove container {self.container.name}: {exc}") from exc
        finally:
            if self.hostdir is not None:
                self.hostdir.close()
            self.backend.forget(self)

"""The `docker` backend: one container per sandbox, same contract as bwrap.

Needs the `docker` Python package and a Docker engine on this host (the workspace, home and proxy
sockets are host directories bind-mounted into the container, so a remote engine cannot work). The
image is the caller's: it must provide /bin/sh and `sleep`, and `socat` on PATH when ports are allowed
(checked at start: a missing one is a SandboxError); harness installs come in through `ro_binds`.

Each container runs `sleep infinity` under docker's init with: `network_mode="none"` (loopback only),
a read-only root filesystem (the image is the whole view: nothing of the host but what is bound), tmpfs
/tmp and /run, the workspace at /run/ws or `SandboxSpec.workdir` (the working directory of every
command) and home at /run/home (read-write binds), the proxy sockets at /run/proxy and `ro_binds`
read-only, generated /etc/passwd and /etc/group (as bwrap's, `clawfast.sandbox.view`), all
capabilities dropped, `no-new-privileges`, and an unprivileged user: `uid` (default `SANDBOX_UID`)
when this process is root, else the calling user. Commands are `docker exec`s of the same start script
bwrap uses (rlimits, in-container socat forwarders, readiness marker).

Limits: memory = `mem_limit` and `memswap_limit` (cgroup, by the engine); processes = `pids_limit`;
CPU = `nano_cpus`; disk = the workspace and home on the host's sized tmpfs (as bwrap's, root only),
/tmp a tmpfs and /dev/shm `shm_size` of `Limits.disk_bytes`; file size = RLIMIT_FSIZE (`ulimit -f` in
the start script); address space = RLIMIT_AS if set; wall time = on timeout every process of the
sandbox's user in the container is killed from the host (the container's init and keeper run as root
without capabilities, out of that user's reach), or, when other commands run beside it, the
container is killed and started again. What a command leaves running when it exits (a daemon) is
killed the same way once no other command runs, so `run` returns with nothing of it left, as in bwrap.
Containers, directories and quota mounts left by an owner killed before `close()` are removed by the
next `DockerBackend` made on the host (container labels and directory names carry the owner's pid).
Not guaranteed: anything about images (pulling is the caller's business: nothing is pulled here).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Mapping

from clawfast.sandbox.base import SANDBOX_UID, Sandbox, SandboxError
from clawfast.sandbox.hostdir import (
    ForwardingBackend,
    HostDir,
    log,
    merge_env,
    split_ready,
    start_script,
    sweep_stale_dirs,
)
from clawfast.sandbox.result import RunResult, capped_result
from clawfast.sandbox.spec import HOMEDIR, PROXYDIR, WORKDIR, SandboxSpec, rlimit_enforced
from clawfast.sandbox.view import ancestors, identity_files

LABEL = "clawfast.sandbox.owner"
IO_DIR = "/run/io"
KILL_GRACE_S = 5.0


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


class DockerSandbox(Sandbox):
    def __init__(self, backend: DockerBackend, spec: SandboxSpec) -> None:
        super().__init__(backend, spec)
        self.workdir = spec.workdir or WORKDIR
        self.home = HOMEDIR
        self.hostdir: HostDir | None = None
        self.container = None
        self.enforced = {"wall": "container kill at the timeout", "processes": "docker pids_limit"}
        self.enforced["user"] = f"uid {backend.user[0]} (docker user)"
        if spec.limits.memory_bytes is not None:
            self.enforced["memory"] = "docker mem_limit"
        if spec.limits.cpus is not None:
            self.enforced["cpu"] = "docker nano_cpus"
        self.enforced.update(rlimit_enforced(spec.limits))
        if spec.limits.max_processes is None:
            del self.enforced["processes"]
        self._counter = 0
        self._active = 0  # commands running now
        self._init_pid = 0  # the container's init, as the host sees it

    def start(self) -> None:
        from docker.errors import DockerException
        from docker.types import Mount

        backend = self.backend
        self.hostdir = HostDir(self.spec, backend.base_dir, backend.forwarder, io_dir=True, owner=backend.owner)
        self.host_workdir = self.hostdir.workspace
        self.host_home = self.hostdir.home
        if self.hostdir.quota is not None:
            self.enforced["disk"] = f"tmpfs of {self.hostdir.quota} bytes (workspace and home; /tmp, /dev/shm each)"
        mounts = [
            Mount(self.workdir, self.hostdir.workspace, type="bind"),
            Mount(HOMEDIR, self.hostdir.home, type="bind"),
            Mount(IO_DIR, self.hostdir.io, type="bind", read_only=True),
            Mount("/etc/passwd", backend.passwd, type="bind", read_only=True),
            Mount("/etc/group", backend.group, type="bind", read_only=True),
        ]
        if self.spec.allow_ports:
            mounts.append(Mount(PROXYDIR, self.hostdir.proxy, type="bind", read_only=True))
        for host_path, target in self.spec.ro_binds.items():
            mounts.append(Mount(target, os.path.abspath(host_path), type="bind", read_only=True))
        limits = self.spec.limits
        sized = "" if limits.disk_bytes is None else f",size={limits.disk_bytes}"
        tmpfs = {"/tmp": f"mode=1777{sized}", "/run": ""}
        # An empty root-owned 0755 host directory over each: a tmpfs would take the image
        # directory's mode. Writable for the engine, which makes the mount points below in it.
        for i, closed in enumerate(backend.closed_dirs((self.workdir, *self.spec.ro_binds.values()))):
            cover = os.path.join(self.hostdir.dir, f"cover{i}")
            os.mkdir(cover)
            os.chmod(cover, 0o755)
            mounts.append(Mount(closed, cover, type="bind"))
        try:
            self.container = self.backend.client.containers.create(
                self.backend.image,
                command=["sleep", "infinity"],
                name=f"clawfast-{os.path.basename(self.hostdir.dir)}",
                labels={LABEL: str(os.getpid())},
                init=True,
                network_mode="none",
                read_only=True,
                tmpfs=tmpfs,
                shm_size=limits.disk_bytes,
                # The keeper and init: root without capabilities, so that the user cannot end them.
                user="0:0",
                nano_cpus=None if limits.cpus is None else round(limits.cpus * 1e9),
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
            self._note_init()
        except DockerException as exc:
            raise SandboxError(f"cannot start a container from {self.backend.image!r}: {exc}") from exc
        if self.backend.probe:
            result = self.run(["true"], timeout=30)
            if result.exit_code != 0:
                raise SandboxError(f"sandbox probe failed: {result}")

    def _note_init(self) -> None:
        self.container.reload()
        self._init_pid = self.container.attrs["State"]["Pid"]

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
            self._active += 1
        try:
            self.hostdir.hand_over()
        except OSError as exc:
            with self._lock:
                self._active -= 1
            raise SandboxError(f"cannot hand the workspace to the sandbox user: {exc}") from exc
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
                self.container.id, ["/bin/sh", "-c", script, "sh", *argv], environment=full_env,
                workdir=self.workdir, user=self.backend.user_spec,
            )["Id"]  # fmt: skip

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
            deadline = t0 + timeout
            timed_out = False
            # The stream ends when every holder of the command's stdout/stderr is gone: at once, or
            # once the command exited and what it left running (a daemon keeping the output open) is
            # killed.
            while reader.is_alive():
                reader.join(min(0.1, max(0.0, deadline - time.monotonic())))
                if not reader.is_alive():
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                if not api.exec_inspect(exec_id)["Running"] and self._kill_leftovers():
                    reader.join(KILL_GRACE_S)
            if timed_out and not self._kill_leftovers():
                # Others run beside it: kill the container (them too) and start it again.
                self.container.kill()
                self.container.start()
                self._note_init()
            reader.join(KILL_GRACE_S)
            duration = time.monotonic() - t0
            exit_code = None if timed_out else api.exec_inspect(exec_id)["ExitCode"]
            # What the command left running (a double-forked daemon) dies with it, as in bwrap.
            self._kill_leftovers()
            self.container.reload()
            state = self.container.status
        except DockerException as exc:
            raise SandboxError(f"docker failed while running a command: {exc}") from exc
        finally:
            with self._lock:
                self._active -= 1
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

    def _kill_leftovers(self) -> bool:
        """SIGKILL every process of the sandbox's user in the container, when no other command runs
        (False otherwise: they are theirs too). Found from the host (the container's PID namespace,
        the user's uid); the container's init and keeper run as root, so the container stays up."""
        with self._lock:
            if self._active > 1:
                return False
        deadline = time.monotonic() + KILL_GRACE_S
        while (pids := self._user_pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        return True

    def _user_pids(self) -> list[int]:
        """Host pids of the live (not zombie) processes of the sandbox's user in the container."""
        try:
            namespace = os.readlink(f"/proc/{self._init_pid}/ns/pid")
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state != "Z" and os.stat(f"/proc/{entry}").st_uid == self.backend.user[0]:
                    found.append(int(entry))
            except (OSError, IndexError):
                continue  # gone meanwhile
        return found

    def _stop(self, in_flight: list) -> None:
        # Removing the container ends every command in it: `in_flight` is nothing here.
        if self.container is not None:
            from docker.errors import DockerException, NotFound

            try:
                self.container.remove(force=True)
            except NotFound:
                pass
            except DockerException as exc:
                raise OSError(f"cannot remove container {self.container.name}: {exc}") from exc

    def _remove(self) -> None:
        if self.hostdir is not None:
            self.hostdir.close()


class DockerBackend(ForwardingBackend):
    """Options: image (must exist locally), base_dir (host dir for workspaces), probe (run `true`
    in each new container so `create` fails rather than the first command), uid (the uid and gid
    commands run as when this process is root)."""

    name = "docker"
    sandbox_type = DockerSandbox

    def __init__(
        self, *, image: str = "debian:bookworm-slim", base_dir: str | None = None, probe: bool = True,
        uid: int = SANDBOX_UID,
    ) -> None:  # fmt: skip
        if not isinstance(uid, int) or isinstance(uid, bool) or not 0 < uid < 2**32 - 1:
            raise ValueError(f"uid must be a non-zero host uid, got {uid!r}")
        self.client = connect()
        # What an owner killed before close() left: its containers (the label names its pid) first,
        # then its directories and quota mounts.
        _remove_stale_containers(self.client)
        sweep_stale_dirs(base_dir, "clawfast-docker-")
        self.image = image
        self.probe = probe
        as_root = os.geteuid() == 0
        if not as_root:
            log.warning("clawfast docker backend: disk quota NOT enforced (mounting a sized tmpfs needs root)")
        self.user = (uid, uid) if as_root else (os.getuid(), os.getgid())
        self.user_spec = f"{self.user[0]}:{self.user[1]}"
        # Who to hand the workspace to (nothing to hand over when commands run as this user).
        self.owner = self.user if as_root else None
        # Absolute: a relative one would name another directory once the process changed directory.
        self.base_dir = os.path.abspath(tempfile.mkdtemp(prefix=f"clawfast-docker-{os.getpid()}-", dir=base_dir))
        view = os.path.join(self.base_dir, "view")
        os.mkdir(view)
        self.passwd, self.group = identity_files(view, *self.user)
        self._closed_dirs: dict[tuple[str, ...], list[str]] = {}
        super().__init__()

    def closed_dirs(self, targets: tuple[str, ...]) -> list[str]:
        """The outermost directories of the image, among the ancestors of `targets` (the workspace's
        and ro_binds' mount points), that the sandbox's user cannot enter (e.g. /root, mode 0700).
        Each is covered by an empty directory it can enter, so that what is mounted below is reachable;
        nothing the user could reach is lost. Asked of the image once per set of targets (a short
        container)."""
        from docker.errors import DockerException

        if targets not in self._closed_dirs:
            # /tmp and /run are the container's own tmpfs, open to all.
            parents = sorted({a for t in targets for a in ancestors(os.path.dirname(t)) if a.split("/")[1] not in ("tmp", "run")})
            if not parents:
                self._closed_dirs[targets] = []
                return []
            script = 'for p in "$@"; do [ ! -e "$p" ] || [ -x "$p" ] || echo "$p"; done'
            try:
                out = self.client.containers.run(
                    self.image, ["/bin/sh", "-c", script, "sh", *parents], user=self.user_spec,
                    network_mode="none", remove=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                )  # fmt: skip
            except DockerException as exc:
                raise SandboxError(f"cannot inspect {self.image!r} for the mount points {targets}: {exc}") from exc
            closed: list[str] = []
            for path in out.decode().split():
                if not any(path.startswith(c + "/") for c in closed):
                    closed.append(path)
            self._closed_dirs[targets] = closed
        return self._closed_dirs[targets]

    def _release(self) -> None:
        super()._release()
        self.client.close()


def _remove_stale_containers(client) -> None:
    from docker.errors import DockerException

    for container in client.containers.list(all=True, filters={"label": LABEL}):
        owner = container.labels.get(LABEL, "")
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            try:
                container.remove(force=True)
            except DockerException:
                pass  # removed meanwhile by another backend's sweep

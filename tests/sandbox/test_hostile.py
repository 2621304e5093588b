"""A hostile agent, for real: what a misbehaving policy does inside its sandbox, run in real sandboxes
of each isolating backend (bwrap and docker, the `any_backend` fixture).

Each test is one attack and checks four things: the attempt fails for the agent; the host, the other
rollouts (a second sandbox alive at the same time) and the trainer (this process, its files) are
untouched; the command's `RunResult` tells the truth (exit code, `timed_out`); and nothing is left
behind (processes, mounts, cgroups, directories for bwrap; the base directory and every labelled
container for docker). Host files an attack aims at are made world-readable (or world-connectable)
where that is possible, so that what stops the attack is the sandbox's isolation, not file modes.

The docker half runs on a local engine with the image CLAWFAST_TEST_DOCKER_IMAGE names (default
`clawfast-sandbox:bookworm`, which scripts/docker_engine.sh builds: debootstrap minbase bookworm with
socat, bash, python3). A missing engine or image FAILS it; nothing skips it. Cases that are moot for docker (the project checkout is not in the image) still
run there: they must fail there too.
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from clawfast.sandbox import Limits, RunResult, SandboxError, SandboxSpec
from clawfast.sandbox import base as sandbox_base

from .host_servers import UnixServer

PY = "/usr/bin/python3"  # in the host's /usr (bwrap) and in the image (docker)
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
DOCKER_IMAGE_VAR = "CLAWFAST_TEST_DOCKER_IMAGE"
# getattr: the suite also runs against code from before the unprivileged user existed, where this
# constant is missing and the uid checks are what fails.
SANDBOX_UID = getattr(sandbox_base, "SANDBOX_UID", 61000)
# The uid sandboxed processes run as on the host: the sandbox user when clawfast runs as root.
AGENT_UID = SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
# What the bwrap sandbox's / may hold (the workspace /run/ws, home and proxy live under /run).
MINIMAL_ROOT = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "run", "tmp", "dev", "proc"}
# Top-level names of any Debian root; a host entry outside these is the host's own (/work, ...).
FHS_ROOT = MINIMAL_ROOT | {"boot", "home", "media", "mnt", "opt", "root", "srv", "sys", "var", "lost+found"}
# ... and what a container's root has of its own (this host may itself be a container).
CONTAINER_ROOT = {".dockerenv"}
# Dotfiles every Debian home starts with (an image's /root has them too): not the trainer's.
GENERIC_DOTFILES = {".bashrc", ".profile", ".bash_logout"}


# -- fixtures -----------------------------------------------------------------------------------


def _docker_backend():
    image = os.environ.get(DOCKER_IMAGE_VAR) or "clawfast-sandbox:bookworm"
    from clawfast.sandbox.docker_backend import DockerBackend, connect

    try:
        client = connect()
    except SandboxError as exc:
        pytest.fail(f"the docker backend is required but no Docker engine answers: {exc}", pytrace=False)
    try:
        client.images.get(image)
    except Exception as exc:
        pytest.fail(f"the docker backend is required but the engine has no image {image}: {exc}", pytrace=False)
    finally:
        client.close()
    return DockerBackend(image=image)


def _docker_leak_check(backend, host) -> None:
    """The docker backend left nothing: its base directory is gone and no container it labelled (or
    whose mounts come from its base directory) exists, running or not."""
    import docker

    from clawfast.sandbox.docker_backend import LABEL

    assert not os.path.exists(backend.base_dir), f"temp directory left behind: {backend.base_dir}"
    client = docker.from_env()
    try:
        left = [
            c.name
            for c in client.containers.list(all=True, filters={"label": LABEL})
            if c.labels.get(LABEL) == str(os.getpid())
            or any(m.get("Source", "").startswith(backend.base_dir + "/") for m in c.attrs.get("Mounts", []))
        ]
    finally:
        client.close()
    assert left == [], f"containers left behind: {left}"
    assert host.children() == [], "child processes left behind"


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def any_backend(request, host, leak_check):
    """A real backend of each kind, checked for leftovers after the test."""
    if request.param == "bwrap":
        from clawfast.sandbox.bwrap import BwrapBackend

        b = BwrapBackend()
        try:
            yield b
        finally:
            b.close()
        leak_check(base_dirs=[b.base_dir])
    else:
        b = _docker_backend()
        try:
            yield b
        finally:
            b.close()
        _docker_leak_check(b, host)


class Bystander:
    """Another rollout's sandbox, alive during the attack. `check()`: it still runs commands, and its
    workspace holds exactly what it held."""

    def __init__(self, backend, limits: Limits | None = None) -> None:
        self.token = f"bystander-{uuid.uuid4().hex}"
        self.sb = backend.create(SandboxSpec(name="bystander", files={"keep.txt": self.token}, limits=limits or Limits()))

    def check(self) -> None:
        r = self.sb.run(["cat", "keep.txt"], timeout=30)
        assert (r.exit_code, r.stdout, r.timed_out) == (0, self.token.encode(), False), r
        assert self.sb.read_files() == {"keep.txt": self.token.encode()}


@pytest.fixture
def bystander(any_backend):
    b = Bystander(any_backend)
    yield b
    b.sb.close()


# -- helpers ------------------------------------------------------------------------------------


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def assert_refused(r: RunResult, secret: bytes | None = None) -> None:
    """A read that must not succeed: the command ended by itself (no timeout), either failing with a
    message or reading nothing, and never printing `secret`."""
    assert not r.timed_out and r.exit_code is not None, r
    assert r.exit_code != 0 or r.stdout == b"", r
    if r.exit_code != 0:
        assert r.stderr, f"failed without saying why: {r}"  # exit code and message agree
    if secret:
        assert secret not in r.stdout, "secret leaked"


def listed(r: RunResult) -> set[str]:
    return {n for n in r.stdout.decode(errors="replace").splitlines() if n}


def world_readable_tree(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o644)


# A search of everything the sandbox can see for strings given in env halves ($S1$S2, $C1$C2), so
# that no file and no environment inside holds a whole one (only grep's argv, under /proc, which is
# left out). Likely leak places first; /usr (5+ GB of system files, bound read-only from the host or
# the image) and /proc, /sys are skipped; `timeout` bounds it where a leaking root is huge.
SEARCH = r"""
set -- /run /tmp /dev/shm /var /home /root /srv /mnt /media /opt /etc
for d in /* /.[!.]*; do
  [ -L "$d" ] && continue
  [ -e "$d" ] || continue
  case "$d" in /proc|/sys|/usr|/dev|/run|/tmp|/var|/home|/root|/srv|/mnt|/media|/opt|/etc) continue;; esac
  set -- "$@" "$d"
done
timeout 8 grep -rsIoF -D skip --line-buffered -e "$S1$S2" -e "$C1$C2" "$@"
echo "grep-exit=$?"
"""


def halves(s: str) -> tuple[str, str]:
    return s[: len(s) // 2], s[len(s) // 2 :]


def search_env(secret: str, control: str) -> dict[str, str]:
    s1, s2 = halves(secret)
    c1, c2 = halves(control)
    return {"S1": s1, "S2": s2, "C1": c1, "C2": c2}


def with_marker(marker: str, script: str) -> list[str]:
    """`sh -c script` with $M set to `marker`, assembled inside so that bwrap's own host command line
    (which holds the script) never matches it: only processes that put $M in their argv carry it."""
    return sh(f'M={marker[:4]}; M="${{M}}{marker[4:]}"\n' + script)


class Watcher:
    """Samples how many host processes carry `marker`, from a thread, until stopped."""

    def __init__(self, host, marker: str) -> None:
        self.host, self.marker = host, marker
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(len(self.host.pids_with(self.marker)))
            time.sleep(0.05)

    def wait_for(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.seen and self.seen[-1] >= n:
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return max(self.seen, default=0)


# -- 1. secrets of the host's /etc --------------------------------------------------------------


def test_etc_secrets_cannot_be_read(any_backend):
    """Attack: read the host's password hashes and SSH host private keys (/etc/shadow, /etc/gshadow,
    /etc/ssh/ssh_host_*_key). Nothing of their content may come out."""
    paths = ["/etc/shadow", "/etc/gshadow", *sorted(glob.glob("/etc/ssh/ssh_host_*_key"))]
    paths = [p for p in paths if os.path.isfile(p)]
    assert paths, "this host has neither /etc/shadow nor /etc/gshadow: nothing to attack"
    with any_backend.create(SandboxSpec()) as sb:
        for path in paths:
            with open(path, "rb") as f:
                real = f.read()
            r = sb.run(["cat", path], timeout=10)
            assert_refused(r, real if real.strip() else None)
            # A password hash or key line on its own must not leak either (a filtered copy).
            for line in real.splitlines():
                fields = line.split(b":")
                if path.endswith("_key") and len(line) > 20 or len(fields) > 1 and len(fields[1]) > 2:
                    assert line not in r.stdout, f"a line of {path} leaked"


ETC_READ = r"""
import json, os, sys
out = {}
for path in json.loads(sys.stdin.read()):
    try:
        if os.path.isdir(path):
            out[path] = sorted(os.listdir(path))
        else:
            with open(path, "rb") as f:
                out[path] = f.read().hex()
    except OSError as e:
        out[path] = e.errno
print(json.dumps(out))
"""


def host_etc_unreadable() -> list[tuple[str, bool]]:
    """(path, is_dir) of every /etc entry that others may not read on the host (not below one)."""
    found = []
    for dirpath, dirnames, filenames in os.walk("/etc"):
        keep = []
        for name in dirnames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            (found.append((p, True)) if st.st_mode & 0o005 != 0o005 else keep.append(name))
        dirnames[:] = keep
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                found.append((p, False))
    return sorted(found)


def test_etc_entries_others_cannot_read_stay_unreadable(any_backend):
    """Attack: read every /etc entry that the host keeps from other users (private keys, credentials
    of services, /etc/ssl/private, sudoers, ...). bwrap covers each; in docker the image's /etc is
    not the host's. Either way no host content comes out."""
    entries = host_etc_unreadable()
    assert entries, "no unreadable /etc entry on this host: nothing to attack"
    with any_backend.create(SandboxSpec()) as sb:
        r = sb.run(py(ETC_READ), stdin=json.dumps([p for p, _ in entries]).encode(), timeout=20)
    assert r.exit_code == 0, r
    seen = json.loads(r.stdout)
    for path, is_dir in entries:
        got = seen[path]
        if isinstance(got, int):  # an errno: refused or absent
            continue
        if is_dir:
            host_names = set(os.listdir(path))
            assert not set(got) & host_names, f"{path}: host entries listed: {sorted(set(got) & host_names)}"
        else:
            with open(path, "rb") as f:
                real = f.read()
            assert not real or bytes.fromhex(got) != real, f"{path}: the host's content was read"
            if any_backend.name == "bwrap":
                assert got == "", f"{path}: readable inside ({len(got) // 2} bytes)"


def test_etc_passwd_names_no_host_user(any_backend):
    """Attack: enumerate the host's accounts from /etc/passwd and /etc/group. bwrap generates them
    (root, nobody, the sandbox user `agent`); no host account with a login uid (1000..65533) is seen
    by either backend."""
    with open("/etc/passwd") as f:
        host_users = {line.split(":")[0] for line in f if line.count(":") >= 6 and 1000 <= int(line.split(":")[2]) < 65534}
    with any_backend.create(SandboxSpec()) as sb:
        r = sb.run(["cat", "/etc/passwd"], timeout=10)
        g = sb.run(["cat", "/etc/group"], timeout=10)
    assert (r.exit_code, g.exit_code) == (0, 0), (r, g)
    entries = [line.split(":") for line in r.stdout.decode().splitlines() if line]
    names = {e[0] for e in entries}
    assert not names & host_users, f"host accounts visible: {names & host_users}"
    if any_backend.name == "bwrap":
        assert names == {"root", "nobody", "agent"}, r.stdout
        assert {e[0]: int(e[2]) for e in entries}["agent"] == AGENT_UID
        groups = {line.split(":")[0] for line in g.stdout.decode().splitlines() if line}
        assert groups <= {"root", "nogroup", "nobody", "agent"}, g.stdout


# -- 2. the project checkout, the trainer's home, /home -----------------------------------------


def project_checkouts() -> list[Path]:
    """This test file's checkout, the one clawfast is imported from, and, when either is a git
    worktree, the main checkout it belongs to (all on the trainer's machine)."""
    import clawfast

    out = [REPO, Path(clawfast.__file__).resolve().parents[1]]
    for repo in list(out):
        git = repo / ".git"
        if git.is_file():  # a worktree: "gitdir: <main>/.git/worktrees/<name>"
            gitdir = Path(git.read_text().split(":", 1)[1].strip())
            if gitdir.parent.name == "worktrees":
                out.append(gitdir.parent.parent.parent)
    return sorted({p for p in out if (p / "pyproject.toml").is_file()})


def test_project_checkout_and_trainer_home_are_invisible(any_backend):
    """Attack: read the project checkout (its README.md by absolute host path), list it, list the
    trainer's home (~), the clawfast cache ($CLAWFAST_HOME or ~/.cache/clawfast: models, harness
    installs) and /home. Nothing of the host's may be seen."""
    home = os.path.expanduser("~")
    cache = os.environ.get("CLAWFAST_HOME") or os.path.join(home, ".cache", "clawfast")
    checkouts = project_checkouts()
    with any_backend.create(SandboxSpec()) as sb:
        for repo in checkouts:
            readme = repo / "README.md"
            r = sb.run(["cat", str(readme)], timeout=10)
            assert_refused(r, readme.read_bytes()[:400])
            r = sb.run(["cat", str(repo / "pyproject.toml")], timeout=10)
            assert_refused(r, b"clawfast")
        for d in [*map(str, checkouts), home, cache, "/home"]:
            host_entries = set(os.listdir(d)) if os.path.isdir(d) else set()
            r = sb.run(["ls", "-A", d], timeout=10)
            assert not r.timed_out and r.exit_code is not None
            assert (r.exit_code == 0) == (r.stderr == b""), r  # ls fails only with a message
            leaked = (listed(r) & host_entries) - GENERIC_DOTFILES
            assert not leaked, f"{d}: host entries visible: {sorted(leaked)[:10]}"


def test_only_a_minimal_root_is_visible(any_backend):
    """Attack: look around / for anything of the host's own (/work, caches, /sys, host-only top-level
    entries). bwrap shows only the minimal root; docker shows its image, which has none of them."""
    host_only = set(os.listdir("/")) - FHS_ROOT - CONTAINER_ROOT
    with any_backend.create(SandboxSpec()) as sb:
        r = sb.run(["ls", "-A", "/"], timeout=10)
        assert r.exit_code == 0, r
        top = listed(r)
        assert not top & host_only, f"host-only top-level entries visible: {sorted(top & host_only)}"
        if any_backend.name == "bwrap":
            assert top <= MINIMAL_ROOT, f"beyond the minimal root: {sorted(top - MINIMAL_ROOT)}"
            r = sb.run(["ls", "-A", "/sys"], timeout=10)
            assert r.exit_code != 0 or r.stdout == b"", "the host's /sys is visible"


# -- 3. another rollout's workspace -------------------------------------------------------------


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run `fn` in a thread; the list gets its result or the exception it raised."""
    out: list = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # reported by the test that reads `out`
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def run_until_stopped(sb, marker: str, script: str = "") -> tuple[threading.Thread, list]:
    """Start, in a thread, a command in `sb` that runs `script` and then waits (a process carrying
    `marker`) until the host writes `stop` into its workspace: a rollout busy mid-episode."""
    wait = "import os, time\nwhile not os.path.exists('stop'): time.sleep(0.02)"
    return in_thread(lambda: sb.run(with_marker(marker, script + f'\nexec {PY} -c "$CODE" "$M"'), env={"CODE": wait}, timeout=60))


def wait_started(host, marker: str) -> list[int]:
    deadline = time.monotonic() + 15
    while not host.pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = host.pids_with(marker)
    assert pids, "the busy command did not start"
    return pids


def stop(sb, thread: threading.Thread, result: list) -> RunResult:
    sb.write_files({"stop": ""})
    thread.join(60)
    assert result, "the busy command did not return"
    assert isinstance(result[0], RunResult), f"the busy command failed: {result[0]!r}"
    assert (result[0].exit_code, result[0].timed_out) == (0, False), result[0]
    return result[0]


def test_other_rollouts_workspace_is_unreachable(any_backend, marker, host):
    """Attack: two rollouts at once; A reads B's workspace and home by their host paths, lists the
    backend's base directory, and searches everything it can see for B's secret, which B, busy, also
    keeps in its /tmp and /dev/shm. Its own canary is found by the same search (the search works);
    B's secret is not, and B is untouched."""
    secret = f"cfsecret-{uuid.uuid4().hex}"
    canary = f"cfcanary-{uuid.uuid4().hex}"
    with any_backend.create(SandboxSpec(name="victim", files={"secret.txt": secret}, home_files={".secret": secret})) as b, \
            any_backend.create(SandboxSpec(name="attacker", files={"own.txt": canary})) as a:
        busy = run_until_stopped(b, marker, "cp secret.txt /tmp/secret && cp secret.txt /dev/shm/secret || exit 9")
        try:
            wait_started(host, marker)
            attack_other_rollout(a, b, any_backend, secret, canary)
        finally:
            stop(b, *busy)
        r = b.run(["cat", "secret.txt", f"{b.home}/.secret"], timeout=10)
        assert (r.exit_code, r.stdout) == (0, 2 * secret.encode())
        assert b.read_files() == {"secret.txt": secret.encode(), "stop": b""}


def attack_other_rollout(a, b, any_backend, secret: str, canary: str) -> None:
    for path in (os.path.join(b.host_workdir, "secret.txt"), os.path.join(b.host_home, ".secret")):
        assert_refused(a.run(["cat", path], timeout=10), secret.encode())
    # B's host directories, from its workspace's parent up to the backend's base directory.
    d, dirs = os.path.dirname(b.host_workdir), []
    while len(d) >= len(any_backend.base_dir):
        dirs.append(d)
        d = os.path.dirname(d)
    assert dirs[-1] == any_backend.base_dir, dirs
    for d in dirs:
        r = a.run(["ls", "-A", d], timeout=10)
        leaked = listed(r) & set(os.listdir(d))
        assert not leaked, f"{d}: entries of the host's visible: {sorted(leaked)}"
    r = a.run(sh(SEARCH), env=search_env(secret, canary), timeout=30)
    assert not r.timed_out and b"grep-exit=" in r.stdout, r
    assert secret.encode() not in r.stdout, f"B's secret found by A: {r.stdout[-2000:]!r}"
    assert canary.encode() in r.stdout, f"the search did not even find A's own file: {r}"


# -- 4. the verifier's files of its own task ----------------------------------------------------


def test_verifier_files_of_its_own_task_are_hidden(any_backend, outside_dir):
    """Attack: read the answer of its own task's verifier (and another task's) from the suite folder
    on the host, which the worker passes as `hide_paths` (task.private_dirs). The folder lies where the
    old backend showed the host (/var/tmp), not under /tmp or /run."""
    suite = outside_dir / "suite"
    answers = {}
    for task in ("task-1", "task-2"):
        (suite / task / "verifier").mkdir(parents=True)
        answers[task] = f"answer-{task}-{uuid.uuid4().hex}"
        (suite / task / "verifier" / "answer.txt").write_text(answers[task])
        (suite / task / "instruction.md").write_text("solve it")
    world_readable_tree(outside_dir)
    spec = SandboxSpec(files={"instruction.md": "solve it"}, hide_paths=(str(suite),))
    with any_backend.create(spec) as sb:
        for task, answer in answers.items():
            assert_refused(sb.run(["cat", str(suite / task / "verifier" / "answer.txt")], timeout=10), answer.encode())
        for d in (suite, suite / "task-1", suite / "task-1" / "verifier"):
            r = sb.run(["ls", "-A", str(d)], timeout=10)
            leaked = listed(r) & set(os.listdir(d))
            assert not leaked, f"{d}: visible: {sorted(leaked)}"
        r = sb.run(sh(SEARCH), env=search_env(answers["task-1"], "solve it"), timeout=30)
        assert not r.timed_out and b"grep-exit=" in r.stdout, r
        assert answers["task-1"].encode() not in r.stdout
        assert b"/instruction.md:solve it" in r.stdout  # its own copy in the workspace: the search works
    assert (suite / "task-1" / "verifier" / "answer.txt").read_text() == answers["task-1"]


# -- 5. host Unix sockets -----------------------------------------------------------------------


UNIX_CONNECT = r"""
import socket, sys
bad = []
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    try:
        s.connect("\0" + path[1:] if path.startswith("@") else path)  # @name: an abstract socket
    except OSError as e:
        print("refused", path, e.errno)
    else:
        bad.append(path)
        print("CONNECTED", path)
    finally:
        s.close()
sys.exit(3 if bad else 0)
"""


def host_listening_unix_sockets(exclude: list[str]) -> list[str]:
    """Filesystem paths of the host's listening Unix sockets (/proc/net/unix), without those under
    `exclude` (other test runs' own sockets: connecting to them would disturb them)."""
    out = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/") and int(fields[3], 16) & 0x10000:
                path = fields[7]
                if not any(path.startswith(e.rstrip("/") + "/") for e in exclude) and os.path.exists(path):
                    out.add(path)
    return sorted(out)[:40]


def test_host_unix_sockets_are_unreachable(any_backend, outside_dir):
    """Attack: connect to a host Unix socket that lies outside /tmp and /run (a world-connectable one
    in a world-readable directory under /var/tmp), to a host abstract-namespace socket, and to every
    listening Unix socket of the host (the Docker engine's, ...). A read-only mount does not stop
    connect(): only not seeing them (and another network namespace, for abstract names) does."""
    abstract = f"clawfast-hostile-{uuid.uuid4().hex}"
    servers = [UnixServer(str(outside_dir / "s.sock")), UnixServer("\0" + abstract)]
    try:
        for server in servers:  # the host can connect: the refusals below mean something
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(server.path)
                assert s.recv(100) == b"host-socket"
        others = host_listening_unix_sockets(exclude=[tempfile.gettempdir(), any_backend.base_dir, str(outside_dir)])
        targets = [servers[0].path, "@" + abstract, *others]
        with any_backend.create(SandboxSpec()) as sb:
            r = sb.run(py(UNIX_CONNECT) + targets, timeout=30)
        assert not r.timed_out
        assert b"CONNECTED" not in r.stdout and r.exit_code == 0, r
        assert r.stdout.count(b"refused") == len(targets)
        assert [server.connections for server in servers] == [1, 1]  # only the host's own checks
    finally:
        for server in servers:
            server.close()


# -- 6. host loopback TCP ports -----------------------------------------------------------------


TCP_CONNECT = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(b"ping"); print(s.recv(100).decode())
except OSError as e:
    print("ERR", e.errno); sys.exit(1)
"""


def test_only_the_allowed_loopback_port_is_reachable(any_backend, echo_server):
    """Attack: reach a host loopback service other than the allowed one (the proxy), at 127.0.0.1
    and other loopback addresses; the allowed port works, the other is refused and never sees a
    connection."""
    other = type(echo_server)()
    try:
        with any_backend.create(SandboxSpec(allow_ports=(echo_server.port,))) as sb:
            r = sb.run(py(TCP_CONNECT) + ["127.0.0.1", str(echo_server.port)], timeout=20)
            assert (r.exit_code, r.stdout) == (0, b"echo:ping\n"), r
            for address in ("127.0.0.1", "127.0.0.2", "localhost"):
                r = sb.run(py(TCP_CONNECT) + [address, str(other.port)], timeout=20)
                assert (r.exit_code, r.timed_out) == (1, False), r
                assert r.stdout.startswith(b"ERR"), r
            r = sb.run(py(TCP_CONNECT) + ["127.0.0.1", str(echo_server.port)], timeout=20)
            assert r.stdout == b"echo:ping\n"  # still works after the refusals
        assert other.connections == 0
        assert echo_server.connections == 2
    finally:
        other.close()


# -- 7. the proxy with another rollout's key ----------------------------------------------------


@pytest.fixture
def live_proxy(renderer, tmp_path):
    """The real proxy (HTTP server, rollout registry, scripted engine) on a host loopback port."""
    from clawfast.proxy import (
        ProxyApp,
        ProxyConfig,
        ProxyCore,
        ProxyServer,
        RolloutRegistry,
    )

    from clawfast.engines.scripted import ScriptedEngine

    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id)
    registry = RolloutRegistry(tmp_path / "records")
    server = ProxyServer(ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=0.05)), registry)).start()
    yield server, engine, registry
    server.stop()


CHAT_POST = r"""
import json, os, sys, urllib.error, urllib.request
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{os.environ['PORT']}/v1/chat/completions", data=body,
                             headers={"Authorization": "Bearer " + os.environ["KEY"], "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=20) as resp:
        print(resp.status, json.loads(resp.read())["choices"][0]["message"]["content"])
except urllib.error.HTTPError as e:
    print(e.code)
"""

PROC_SCAN = r"""
import glob, os
key = os.environ["K1"] + os.environ["K2"]
hits = []
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        with open(path, "rb") as f:
            if key.encode() in f.read():
                hits.append(path)
    except OSError:
        pass
print("procs", len(glob.glob("/proc/[0-9]*")), "hits", hits)
"""


def test_proxy_refuses_forged_keys_and_other_rollouts_keys_stay_out_of_reach(any_backend, live_proxy, marker, host):
    """Attack: two rollouts on the real proxy. From A: (a) a request with a forged key gets 401 and
    nothing is recorded for anyone; (b) B's key, which B holds in its environment, its harness config
    and a running process, appears nowhere A can read (its filesystem, its environment, /proc). A's
    own key works (the forwarder and the proxy are really reachable)."""
    server, engine, registry = live_proxy
    ra, rb = registry.open("a", harness="test"), registry.open("b", harness="test")
    port = server.port
    k1, k2 = halves(rb.key)
    spec_b = SandboxSpec(
        name="rollout-b", allow_ports=(port,), env={"OPENAI_API_KEY": rb.key, "ANTHROPIC_API_KEY": rb.key},
        home_files={".codex/auth.json": json.dumps({"OPENAI_API_KEY": rb.key})},
    )
    spec_a = SandboxSpec(
        name="rollout-a", allow_ports=(port,), env={"OPENAI_API_KEY": ra.key},
        home_files={".codex/auth.json": json.dumps({"OPENAI_API_KEY": ra.key})},
    )
    with any_backend.create(spec_b) as sb_b, any_backend.create(spec_a) as sb_a:
        # B is mid-episode: a process holding its key runs while A looks around (until told to stop).
        busy = run_until_stopped(sb_b, marker)
        try:
            wait_started(host, marker)

            forged = f"cf-{secrets.token_urlsafe(24)}"
            r = sb_a.run(py(CHAT_POST), env={"PORT": str(port), "KEY": forged}, timeout=30)
            assert (r.exit_code, r.stdout) == (0, b"401\n"), r
            assert registry.records("a") == [] and registry.records("b") == []

            r = sb_a.run(sh('env; echo "env-exit=$?"'), timeout=10)
            assert b"env-exit=0" in r.stdout and rb.key.encode() not in r.stdout
            r = sb_a.run(py(PROC_SCAN), env={"K1": k1, "K2": k2}, timeout=10)
            assert r.exit_code == 0 and b"hits []" in r.stdout, r
            r = sb_a.run(sh(SEARCH), env=search_env(rb.key, ra.key), timeout=30)
            assert not r.timed_out and b"grep-exit=" in r.stdout, r
            assert rb.key.encode() not in r.stdout, f"B's key found by A: {r.stdout[-2000:]!r}"
            assert ra.key.encode() in r.stdout, f"the search did not find A's own key in its home: {r}"

            engine.push("hello from the policy")
            r = sb_a.run(py(CHAT_POST), env={"PORT": str(port), "KEY": ra.key}, timeout=30)
            assert (r.exit_code, r.stdout) == (0, b"200 hello from the policy\n"), r
        finally:
            stop(sb_b, *busy)
        assert host.pids_with(marker) == []
    result_a, result_b = registry.close("a"), registry.close("b")
    assert len(result_a.calls) == 1 and "refusals" not in result_a.info
    assert len(result_b.calls) == 0 and "refusals" not in result_b.info


# -- 8. fork bomb -------------------------------------------------------------------------------


FORK_BOMB = r"""
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.005)
"""

FORK_SOME = r"""
import os, sys, time
pids = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        time.sleep(0.2); os._exit(0)
    pids.append(pid)
print(sum(os.waitpid(p, 0)[1] == 0 for p in pids))
"""


def test_fork_bomb_is_contained(any_backend, marker, host):
    """Attack: a fork bomb under Limits(max_processes=64). The number of its processes on the host
    stays at the limit, the host and another rollout (same limit, same sandbox uid) can still fork
    while it rages, the run ends at its timeout with every process gone, and a sandbox created
    afterwards works."""
    other = Bystander(any_backend, Limits(max_processes=64))
    try:
        with any_backend.create(SandboxSpec(limits=Limits(max_processes=64))) as sb:
            watcher = Watcher(host, marker)
            t0 = time.monotonic()
            attack, result = in_thread(
                lambda: sb.run(with_marker(marker, f'exec {PY} -c "$BOMB" "$M"'), env={"BOMB": FORK_BOMB}, timeout=3))
            try:
                assert watcher.wait_for(32, 3), f"the bomb never grew: {watcher.seen[-5:]}"
                assert subprocess.run(["true"], timeout=10, check=False).returncode == 0  # the host still forks
                r = other.sb.run(py(FORK_SOME), timeout=20)  # another rollout, same uid, still forks
                assert (r.exit_code, r.stdout) == (0, b"8\n"), r
            finally:
                attack.join(60)
                peak = watcher.stop()
            elapsed = time.monotonic() - t0
            assert result and isinstance(result[0], RunResult), f"run did not return a result: {result!r}"
            r = result[0]
            assert r.timed_out and r.exit_code is None, r
            assert elapsed < 3 + 15, elapsed
            assert peak <= 64, f"{peak} bomb processes on the host at once"
            assert host.pids_with(marker) == [], "bomb processes survived the run"
            assert sb.run(["echo", "ok"], timeout=20).stdout == b"ok\n"
        with any_backend.create(SandboxSpec(limits=Limits(max_processes=64))) as fresh:
            assert fresh.run(py(FORK_SOME), timeout=20).stdout == b"8\n"
        other.check()
    finally:
        other.sb.close()


# -- 9. memory ----------------------------------------------------------------------------------


def test_memory_hog_is_killed(any_backend, bystander):
    """Attack: allocate 512 MiB under Limits(memory_bytes=64 MiB). The limit is enforced (listed in
    `enforced`), the hog is killed (exit 137, no timeout), a small allocation still works, and the
    sandbox and another rollout carry on."""
    with any_backend.create(SandboxSpec(limits=Limits(memory_bytes=64 * MiB))) as sb:
        assert "memory" in sb.enforced, sb.enforced
        assert sb.run(py("b = bytearray(16 << 20); print(len(b))"), timeout=20).stdout == b"16777216\n"
        r = sb.run(py("b = bytearray(512 << 20); print('allocated')"), timeout=30)
        assert (r.exit_code, r.timed_out) == (128 + signal.SIGKILL, False), r
        assert b"allocated" not in r.stdout
        assert sb.run(["echo", "ok"], timeout=20).stdout == b"ok\n"
    bystander.check()


# -- 10. disk -----------------------------------------------------------------------------------


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_disk_filler_hits_its_own_quota(any_backend, bystander):
    """Attack: fill the disk under Limits(disk_bytes=16 MiB) by writing 64 MiB into the workspace,
    then into /tmp and /dev/shm. Each write stops with ENOSPC at about the quota (/tmp and /dev/shm
    have their own, so they still take data with the workspace full), the host's free space where the
    sandboxes live does not move, and the sandbox still runs commands afterwards."""
    quota = 16 * MiB
    with any_backend.create(SandboxSpec(limits=Limits(disk_bytes=quota))) as sb:
        assert "disk" in sb.enforced, sb.enforced
        before = free_bytes(any_backend.base_dir)
        r = sb.run(["dd", "if=/dev/zero", "of=fill", "bs=1M", "count=64"], timeout=30)
        assert (r.exit_code, r.timed_out) == (1, False), r
        assert b"No space left on device" in r.stderr, r
        size = os.path.getsize(os.path.join(sb.host_workdir, "fill"))
        assert quota // 2 <= size <= quota, size
        for place in ("/tmp", "/dev/shm"):
            r = sb.run(sh(f"dd if=/dev/zero of={place}/fill bs=1M count=64; echo rc=$?; stat -c %s {place}/fill"), timeout=30)
            assert b"No space left on device" in r.stderr, (place, r)
            rc, got = r.stdout.decode().split()
            assert rc == "rc=1", (place, r)
            assert quota // 2 <= int(got) <= quota, (place, got)
        after = free_bytes(any_backend.base_dir)
        assert before - after < 8 * MiB, f"the host lost {(before - after) / MiB:.1f} MiB of free space"
        r = sb.run(["echo", "ok"], timeout=20)
        assert (r.exit_code, r.stdout) == (0, b"ok\n"), r
        assert len(sb.read_file("fill")) == size
    bystander.check()


def test_output_flood_does_not_fill_the_host_disk(any_backend, bystander):
    """Attack: fill the host's disk through the output capture instead of the workspace: print 64 MiB
    under Limits(max_output_bytes=1 MiB). The result carries the first 1 MiB and says it was
    truncated, and the free space where the sandboxes live never drops by the flood (sampled while
    the command runs, before any capture file is removed)."""
    limits = Limits(max_output_bytes=MiB)
    with any_backend.create(SandboxSpec(limits=limits)) as sb:
        before = free_bytes(any_backend.base_dir)
        lowest = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                lowest[0] = min(lowest[0], free_bytes(any_backend.base_dir))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            r = sb.run(sh("head -c 67108864 /dev/zero; echo rc=$? >&2; sleep 0.5"), timeout=60)
        finally:
            done.set()
            sampler.join(5)
        assert not r.timed_out and r.exit_code == 0, r
        assert len(r.stdout) == MiB and r.stdout_truncated, (len(r.stdout), r.stdout_truncated)
        assert before - lowest[0] < 16 * MiB, f"the host lost {(before - lowest[0]) / MiB:.1f} MiB to captured output"
        assert sb.run(["echo", "ok"], timeout=20).stdout == b"ok\n"
    bystander.check()


# -- 11. the harness install --------------------------------------------------------------------


def tree_state(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, "."]:
            p = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(p)
            data = Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else b""
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, data)
    return out


def test_harness_install_cannot_be_modified(any_backend, outside_dir, bystander):
    """Attack: tamper with the harness install, which the worker binds read-only at its own host path
    (as `ro_binds`): overwrite, truncate, delete, rename, chmod, add files and links. Every attempt
    fails, the harness still runs, and the host's files are unchanged (bytes, modes, times)."""
    h = outside_dir / "harness"
    (h / "bin").mkdir(parents=True)
    (h / "lib").mkdir()
    (h / "bin" / "tool.sh").write_text("echo tool-ok\n")
    (h / "lib" / "data.txt").write_text("original\n")
    world_readable_tree(outside_dir)
    os.chmod(h / "bin" / "tool.sh", 0o755)
    before = tree_state(h)
    attempts = {
        "overwrite": f"echo pwned > {h}/lib/data.txt",
        "append": f"echo pwned >> {h}/bin/tool.sh",
        "truncate": f": > {h}/lib/data.txt",
        "delete": f"rm -f {h}/lib/data.txt",
        "rename": f"mv {h}/lib/data.txt {h}/lib/moved",
        "chmod": f"chmod 777 {h}/lib/data.txt",
        "chmod_dir": f"chmod 777 {h}/bin",
        "create": f"touch {h}/new",
        "mkdir": f"mkdir {h}/d",
        "symlink": f"ln -s /etc {h}/link",
        "rmdir": f"rm -rf {h}/lib",
    }
    script = "".join(f"( {cmd} ) 2>/dev/null; echo {name}=$?\n" for name, cmd in attempts.items())
    with any_backend.create(SandboxSpec(ro_binds={str(h): str(h)})) as sb:
        r = sb.run(sh(script), timeout=20)
        assert r.exit_code == 0, r
        codes = dict(line.split("=") for line in r.stdout.decode().split())
        assert set(codes) == set(attempts), r
        assert {n: c for n, c in codes.items() if c == "0"} == {}, f"succeeded: {codes}"
        r = sb.run(["sh", f"{h}/bin/tool.sh"], timeout=10)
        assert (r.exit_code, r.stdout) == (0, b"tool-ok\n"), r
    assert tree_state(h) == before
    bystander.check()


# -- 12. daemons that outlive their command -----------------------------------------------------


# A double-forked daemon in its own session, its stdio detached (it holds nothing of the command's),
# that writes `late` into the workspace 1.5 s after it started.
DAEMON = (
    f'(setsid sh -c \'{PY} -c "import time; time.sleep(1.5)" "$0"; echo late > "$1"\' "$M" "$PWD/late"'
    " </dev/null >/dev/null 2>&1 &)\n"
)


def assert_daemon_gone(sb, host, marker: str, peak: int) -> None:
    """The daemon ran (`peak`: the most of its processes the watcher saw), none of it is left now,
    and the file it meant to write 1.5 s later never appears."""
    assert peak >= 1, "the daemon never ran"
    assert host.pids_with(marker) == [], "the daemon outlived its command"
    time.sleep(2)  # past the daemon's 1.5 s
    assert not os.path.exists(os.path.join(sb.host_workdir, "late"))
    assert sb.run(["ls", "-A"], timeout=10).stdout == b""


def test_daemon_does_not_survive_a_timeout(any_backend, marker, host):
    """Attack: a double-forked daemon in its own session, meant to write a file after the command
    was killed for running past its timeout. When `run` returns (timed_out) no process of it is left
    on the host, and the file never appears."""
    with any_backend.create(SandboxSpec()) as sb:
        watcher = Watcher(host, marker)
        r = sb.run(with_marker(marker, DAEMON + 'exec sleep 30'), timeout=1)
        peak = watcher.stop()
        assert r.timed_out and r.exit_code is None, r
        assert_daemon_gone(sb, host, marker, peak)


def test_daemon_does_not_survive_a_command_that_exits(any_backend, marker, host):
    """Attack: a command that exits 0 at once but leaves a double-forked daemon behind to write a
    file later. The daemon is gone when `run` returns (exit 0, not timed out), and the file never
    appears."""
    with any_backend.create(SandboxSpec()) as sb:
        watcher = Watcher(host, marker)
        r = sb.run(with_marker(marker, DAEMON + 'sleep 0.3; echo started'), timeout=20)
        peak = watcher.stop()
        assert (r.exit_code, r.timed_out, r.stdout) == (0, False, b"started\n"), r
        assert_daemon_gone(sb, host, marker, peak)


def test_daemon_holding_the_output_does_not_hold_the_run(any_backend, marker, host):
    """Attack: a command that exits 0 at once but leaves a daemon that keeps its stdout open and
    sleeps. `run` reports what the command did (exit 0, not timed out) when the command exits, not
    when the daemon lets go of the output (or at the timeout), and the daemon is gone."""
    hold = f'(setsid {PY} -c "import time; time.sleep(30)" "$M" &)\necho started'
    with any_backend.create(SandboxSpec()) as sb:
        t0 = time.monotonic()
        r = sb.run(with_marker(marker, hold), timeout=10)
        elapsed = time.monotonic() - t0
        assert (r.exit_code, r.timed_out, r.stdout) == (0, False, b"started\n"), r
        assert elapsed < 5, f"run returned {elapsed:.1f} s after a command that exited at once"
        assert host.pids_with(marker) == [], "the daemon outlived its command"


# -- 13. privileges -----------------------------------------------------------------------------


PRIV_SCRIPT = r"""
echo "uid=$(id -u) gid=$(id -g)"
grep -E '^(CapInh|CapPrm|CapEff|CapAmb):' /proc/self/status
echo "suid=$(/run/suid/id -u 2>&1)"
echo "su=$(su -c 'id -u' root </dev/null 2>/dev/null)"
echo "sudo=$(sudo -n id -u </dev/null 2>/dev/null)"
for d in / /usr /usr/bin /etc /bin; do
  ( touch "$d/cfprobe-$N" ) 2>/dev/null && echo "WROTE $d"
done
touch owned && echo owned-ok
"""


def test_no_privilege_to_gain(any_backend, outside_dir):
    """Attack: find or gain root: `id`, capabilities, a setuid-root binary (a copy of `id` bound in),
    `su` and `sudo`, writes to /, /usr, /etc. The sandbox runs as the unprivileged sandbox uid when
    the host runs as root (files it makes are owned by that uid on the host), has no capabilities,
    gains nothing from setuid, and cannot write the system directories."""
    suid_dir = outside_dir / "suid"
    suid_dir.mkdir()
    suid_dir.chmod(0o755)
    shutil.copy("/usr/bin/id", suid_dir / "id")
    if os.geteuid() == 0:
        os.chown(suid_dir / "id", 0, 0)
        os.chmod(suid_dir / "id", 0o4755)
    probe = uuid.uuid4().hex[:8]
    with any_backend.create(SandboxSpec(ro_binds={str(suid_dir): "/run/suid"})) as sb:
        enforced = dict(sb.enforced)
        r = sb.run(sh(PRIV_SCRIPT), env={"N": probe}, timeout=20)
        owner = os.stat(os.path.join(sb.host_workdir, "owned")).st_uid if os.path.exists(os.path.join(sb.host_workdir, "owned")) else None
    out = r.stdout.decode()
    assert r.exit_code == 0 and not r.timed_out, r
    lines = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("uid", "suid", "su", "sudo"):
            lines[key] = value
    assert lines["uid"] == f"{AGENT_UID} gid={AGENT_UID}" and AGENT_UID != 0, out
    if os.geteuid() == 0:
        assert "user" in enforced, enforced
    caps = {line.split(":")[0]: int(line.split(":")[1], 16) for line in out.splitlines() if line.startswith("Cap")}
    assert caps == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapAmb": 0}, caps
    assert lines["suid"] == str(AGENT_UID), f"the setuid-root binary ran as {lines['suid']!r}"
    assert lines["su"] != "0" and lines["sudo"] != "0", out
    assert "WROTE" not in out, out
    assert "owned-ok" in out and owner == AGENT_UID, (out, owner)
    for d in ("/", "/usr", "/usr/bin", "/etc", "/bin"):
        assert not os.path.exists(os.path.join(d, f"cfprobe-{probe}"))


# -- 14. CPU ------------------------------------------------------------------------------------


def test_cpu_hog_gets_only_its_quota(any_backend):
    """Attack: spin every core for 2 s under Limits(cpus=0.5). The limit is enforced (`enforced`
    lists it) and the hog gets at most about half a CPU of time."""
    spin = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(os.cpu_count() or 2):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        end = time.time() + 2\n"
        "        while time.time() < end: pass\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "for p in pids: os.waitpid(p, 0)\n"
        "t = os.times()\n"
        "print(round(t.children_user + t.children_system, 3))\n"
    )
    with any_backend.create(SandboxSpec(limits=Limits(cpus=0.5))) as sb:
        assert "cpu" in sb.enforced, sb.enforced
        r = sb.run(py(spin), timeout=30)
    assert r.exit_code == 0 and not r.timed_out, r
    used = float(r.stdout)
    # 0.5 CPU for ~2 s of wall time is ~1 s; unthrottled it is 2 s per core.
    assert used < 1.5, f"the hog used {used} s of CPU in ~2 s under a 0.5-CPU quota"


# -- 15. signals --------------------------------------------------------------------------------


def test_signals_cannot_reach_the_trainer_or_other_rollouts(any_backend, marker, host):
    """Attack: SIGKILL the trainer (this process), its other children (B's sandbox processes) and
    another rollout's running command by their host pids. None is reached: the trainer lives, B's
    command runs on and ends normally."""
    with any_backend.create(SandboxSpec(name="victim")) as b, any_backend.create(SandboxSpec(name="attacker")) as a:
        busy = run_until_stopped(b, marker)
        try:
            victims = sorted({os.getpid(), *wait_started(host, marker), *host.children()})
            inside = a.run(["sh", "-c", "ls /proc | grep -E '^[0-9]+$'"], timeout=10)
            own = {int(p) for p in inside.stdout.split()}
            victims = [p for p in victims if p not in own and p > 1]  # a pid A has of its own is not a victim
            assert os.getpid() in victims
            r = a.run(sh('for p in $VICTIMS; do kill -KILL "$p" 2>/dev/null && echo "KILLED $p"; done; echo done'),
                      env={"VICTIMS": " ".join(map(str, victims))}, timeout=10)
            assert (r.exit_code, r.stdout) == (0, b"done\n"), r
            assert len(host.pids_with(marker)) >= 1, "B's command was killed"
        finally:
            stop(b, *busy)


# -- 16. links swapped under the host's feet ----------------------------------------------------


def test_concurrent_commands_in_one_sandbox_do_not_kill_each_other(any_backend, marker, host):
    """What the attack below needs, and `Sandbox` promises ("thread-safe for `run` from several
    threads"): a command that ends while another one of the same sandbox runs leaves that one alone;
    the long one ends by itself with its own exit code."""
    with any_backend.create(SandboxSpec()) as sb:
        busy = run_until_stopped(sb, marker)
        wait_started(host, marker)
        for _ in range(3):
            assert sb.run(["true"], timeout=20).exit_code == 0
        assert host.pids_with(marker), "the first command was killed when the second one ended"
        stop(sb, *busy)



SWAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
os.symlink(sys.argv[1], "l")
end, n = time.time() + float(sys.argv[2]), 0
while time.time() < end:
    if libc.renameat2(AT_FDCWD, b"d", AT_FDCWD, b"l", RENAME_EXCHANGE) != 0:
        print("renameat2 errno", ctypes.get_errno()); sys.exit(2)
    n += 1
print("swaps", n)
"""


def test_swapped_links_never_hand_host_files_over(any_backend, outside_dir):
    """Attack: while the host prepares further commands (it hands the workspace to the sandbox user
    before each: a chown of every entry, as root), the agent swaps a directory of its workspace with
    a link to a host directory that holds an entry of the same name, atomically and again and again,
    so that a walk which checked "a directory, not a link" then follows the link. No host file may
    change owner, mode or content."""
    victim = outside_dir / "victim"
    victim.mkdir()
    (victim / "x").write_text("host file\n")
    world_readable_tree(outside_dir)
    before = tree_state(victim)
    with any_backend.create(SandboxSpec(files={"d/x": "agent file\n"})) as sb:
        swapper, result = in_thread(lambda: sb.run(py(SWAPPER) + [str(victim), "2"], timeout=30))
        runs = 0
        try:
            while swapper.is_alive():
                r = sb.run(["true"], timeout=30)  # each one hands the workspace over first
                assert r.exit_code == 0, r
                runs += 1
        finally:
            swapper.join(30)
        assert result and isinstance(result[0], RunResult), f"the swapper failed: {result!r}"
        assert result[0].exit_code == 0 and result[0].stdout.startswith(b"swaps "), result[0]
        assert runs >= 5, runs
    after = tree_state(victim)
    changed = {k: (before.get(k, ())[:3], after.get(k, ())[:3]) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert not changed, f"host files handed over through a swapped link ((mode, uid, gid) before, after): {changed}"


# -- 17. a user namespace of its own ------------------------------------------------------------


USERNS = r"""
unshare -rm sh -c '
  echo "inner-uid=$(id -u)"
  umount /etc/shadow 2>/dev/null && echo "UNDID the cover of /etc/shadow"
  umount -l /etc 2>/dev/null && echo "UNDID /etc"
  head -c 64 /etc/shadow 2>/dev/null | grep -q . && echo "READ /etc/shadow"
  mount -o remount,rw /usr 2>/dev/null && echo "REMOUNTED /usr"
  mount -o remount,bind,rw /etc 2>/dev/null && echo "REMOUNTED /etc"
  touch /usr/cfprobe-$N /etc/cfprobe-$N 2>/dev/null && echo "WROTE system dirs"
  mount -t proc proc /proc 2>/dev/null; ls /proc | grep -cE "^[0-9]+$" | sed "s/^/inner-procs=/"
' 2>&1
echo "unshare-exit=$?"
"""


def test_own_user_namespace_gains_nothing(any_backend):
    """Attack: make a user namespace of its own (`unshare -rm`: root inside it) and use that root to
    undo what hides the host: unmount the cover of /etc/shadow, remount /usr and /etc read-write,
    write there, mount a /proc to see more processes. Where the host allows user namespaces at all,
    every mount in it is locked to the sandbox's: none of this works."""
    probe = uuid.uuid4().hex[:8]
    with any_backend.create(SandboxSpec()) as sb:
        r = sb.run(sh(USERNS), env={"N": probe}, timeout=20)
    out = r.stdout.decode()
    assert r.exit_code == 0 and not r.timed_out and "unshare-exit=" in out, r
    for what in ("UNDID", "READ", "REMOUNTED", "WROTE"):
        assert what not in out, out
    procs = re.search(r"inner-procs=(\d+)", out)
    assert procs is None or int(procs.group(1)) < 20, out  # at most the sandbox's own few processes
    for d in ("/usr", "/etc"):
        assert not os.path.exists(f"{d}/cfprobe-{probe}")

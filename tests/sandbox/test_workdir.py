"""`SandboxSpec.workdir`: the workspace mounted at an absolute path of the task's choosing, against the
real kernel. bwrap must make the mount point without changing the host or the rest of the sandbox's
minimal view; the spec refuses paths that would cover what the sandbox mounts itself; the local backend,
which cannot place a workspace at all, refuses it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import uuid

import pytest

from clawfast.sandbox import SandboxSpec, create_backend
from clawfast.sandbox.bwrap import BwrapBackend

PY = "/usr/bin/python3"  # the host's system Python, visible in the minimal root (/usr)

# The entries of a directory with what identifies them (mode, and a symlink's target): the same code
# runs on the host and inside, so the two views can be compared.
LIST_CODE = (
    "import json, os, sys\n"
    "d = sys.argv[1]\n"
    "def entry(n):\n"
    "    p = os.path.join(d, n)\n"
    "    return [n, os.lstat(p).st_mode, os.readlink(p) if os.path.islink(p) else None]\n"
    "print(json.dumps({'mode': os.stat(d).st_mode, 'entries': sorted(entry(n) for n in os.listdir(d))}))\n"
)


def host_listing(directory: str) -> dict:
    return json.loads(subprocess.run([PY, "-c", LIST_CODE, directory], capture_output=True, check=True).stdout)


def without(view: dict, name: str) -> dict:
    return {"mode": view["mode"], "entries": [e for e in view["entries"] if e[0] != name]}


@pytest.fixture
def name() -> str:
    """A directory name that exists nowhere on the host."""
    return f"clawfast-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def var_tmp_dir():
    """A fresh host directory outside /tmp (which every sandbox replaces with its own), open to all
    like a system directory (the sandbox's user could not enter mkdtemp's 0700)."""
    path = tempfile.mkdtemp(prefix="clawfast-test-", dir="/var/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def workspace_source(tmp_path) -> str:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "from_source.txt").write_text("S")
    return str(src)


# -- bwrap: where the mount point is made -------------------------------------------------------


def test_workdir_under_a_directory_the_sandbox_does_not_see(backend, name, tmp_path):
    """/root is not part of the minimal root: the workspace's parents are made in the sandbox's own
    read-only root, and nothing of the host's /root shows."""
    assert os.path.isdir("/root") and not os.path.lexists(f"/root/{name}")
    workdir = f"/root/{name}/workspace"
    spec = SandboxSpec(workdir=workdir, source_dir=workspace_source(tmp_path), files={"a.txt": "A"})
    with backend.create(spec) as sb:
        assert sb.workdir == workdir
        r = sb.run(["sh", "-c", "pwd; cat a.txt sub/from_source.txt; echo; echo made > out.txt"])
        assert r.stdout == f"{workdir}\nAS\n".encode(), r
        assert sb.read_file("out.txt") == b"made\n"
        inside = json.loads(sb.run([PY, "-c", LIST_CODE, "/root"]).stdout)
        assert [e[0] for e in inside["entries"]] == [name]
        # ... and stays read-only: only the workspace is writable.
        r = sb.run(["sh", "-c", f"echo x > /root/probe; echo x > /root/{name}/probe; mkdir /root/{name}/d"])
        assert r.exit_code != 0 and r.stderr.count(b"Read-only file system") == 3, r
    assert not os.path.lexists(f"/root/{name}") and not os.path.lexists("/root/probe")


def test_workdir_as_a_new_top_level_directory(backend, name):
    workdir = f"/{name}"
    with backend.create(SandboxSpec(workdir=workdir, files={"a.txt": "A"})) as sb:
        script = "pwd; cat a.txt; echo; python3 -c 'print(1)'; ls /usr/bin/env"
        r = sb.run(["sh", "-c", script + "; grep -q ^root: /etc/passwd && echo etc-ok"])
        assert r.stdout == f"{workdir}\nA\n1\n/usr/bin/env\netc-ok\n".encode(), r
        inside = json.loads(sb.run([PY, "-c", LIST_CODE, "/"]).stdout)
        # The view's system paths (links kept as links: /bin -> usr/bin on merged-/usr hosts), the
        # sandbox's own mounts, the workspace; nothing else of the host's /.
        system = [p[1:] for p in backend.view.system_paths]
        assert sorted(e[0] for e in inside["entries"]) == sorted(system + ["proc", "dev", "tmp", "run", name])
        for entry in inside["entries"]:
            if entry[2] is not None:
                assert os.readlink("/" + entry[0]) == entry[2]
        r = sb.run(["sh", "-c", "echo x > /probe; echo x > /tmp/p && echo tmp-ok; echo x > w && echo ws-ok"])
        assert r.stdout == b"tmp-ok\nws-ok\n" and b"Read-only file system" in r.stderr, r
        assert sb.read_files() == {"a.txt": b"A", "w": b"x\n"}
    assert not os.path.lexists(workdir) and not os.path.lexists("/probe")


def test_workdir_under_tmp(backend, name):
    workdir = f"/tmp/{name}/ws"
    with backend.create(SandboxSpec(workdir=workdir, files={"a.txt": "A"})) as sb:
        r = sb.run(["sh", "-c", "pwd; cat a.txt; echo; echo w > w; ls -A /tmp"])
        assert r.stdout == f"{workdir}\nA\n{name}\n".encode(), r
        assert sb.read_file("w") == b"w\n"
    assert not os.path.lexists(f"/tmp/{name}")


@pytest.fixture
def view_backend(var_tmp_dir, leak_check):
    """A bwrap backend whose read-only view also shows `var_tmp_dir`, as it shows /usr."""
    from clawfast.sandbox.view import SYSTEM_PATHS

    b = BwrapBackend(system_paths=SYSTEM_PATHS + (var_tmp_dir,))
    yield b
    b.close()
    leak_check(base_dirs=[b.base_dir])


def test_workdir_on_an_existing_host_directory_covers_it(view_backend, var_tmp_dir):
    with open(os.path.join(var_tmp_dir, "host_marker"), "w") as f:
        f.write("host")
    with view_backend.create(SandboxSpec(workdir=var_tmp_dir, files={"a.txt": "A"})) as sb:
        r = sb.run(["sh", "-c", "pwd; ls -A; echo new > b.txt"])
        assert r.stdout == f"{var_tmp_dir}\na.txt\n".encode(), r
        assert sb.read_files() == {"a.txt": b"A", "b.txt": b"new\n"}
    assert os.listdir(var_tmp_dir) == ["host_marker"]


@pytest.mark.parametrize("below", ["file", "file/ws", "link", "link/ws"])
def test_workdir_that_is_not_a_directory_on_the_host_is_refused(view_backend, var_tmp_dir, host, below):
    # In a directory the view shows: a file, or a symlink to a directory (bwrap would follow it).
    with open(os.path.join(var_tmp_dir, "file"), "w"):
        pass
    os.mkdir(os.path.join(var_tmp_dir, "dir"))
    os.symlink("dir", os.path.join(var_tmp_dir, "link"))
    with pytest.raises(ValueError, match="exists on the host and is not a directory"):
        view_backend.create(SandboxSpec(workdir=f"{var_tmp_dir}/{below}"))
    assert os.listdir(view_backend.base_dir) == ["view"] and host.own_cgroups() == []
    assert sorted(os.listdir(var_tmp_dir)) == ["dir", "file", "link"]
    assert os.listdir(os.path.join(var_tmp_dir, "dir")) == []


def test_workdir_below_a_linked_system_path_is_refused(var_tmp_dir, leak_check):
    """A system path that is a link (/bin -> usr/bin on merged-/usr hosts) is a link inside too."""
    from clawfast.sandbox.view import SYSTEM_PATHS

    link = os.path.join(var_tmp_dir, "bin")
    os.symlink("/usr/bin", link)
    with BwrapBackend(system_paths=SYSTEM_PATHS + (link,)) as b:
        with pytest.raises(ValueError, match="is a symbolic link in the sandbox"):
            b.create(SandboxSpec(workdir=f"{link}/ws"))
    leak_check(base_dirs=[b.base_dir])


@pytest.mark.parametrize("top_level", [False, True])
def test_hides_and_ro_binds_still_apply_in_a_rebuilt_directory(var_tmp_dir, name, tmp_path, leak_check, top_level):
    """In a directory the view shows, the pool directory and `hide_paths` stay hidden and `ro_binds`
    land, also on a mount point that a rebuilt directory makes possible."""
    from clawfast.sandbox.view import SYSTEM_PATHS

    hidden = os.path.join(var_tmp_dir, "hidden")
    os.mkdir(hidden)
    with open(os.path.join(hidden, "s.txt"), "w") as f:
        f.write("no")
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "bin.sh").write_text("echo from-harness")
    # Rebuilt: var_tmp_dir, which holds the pool directory and the hidden one, and the ro_binds target
    # missing on the host. Top level: both in the sandbox's own root, var_tmp_dir shown as it is.
    if top_level:
        workdir, ro_target = f"/{name}", f"/{name}-harness"
    else:
        workdir, ro_target = f"{var_tmp_dir}/{name}/ws", f"{var_tmp_dir}/harness"
    with BwrapBackend(base_dir=var_tmp_dir, hide_paths=[hidden], system_paths=SYSTEM_PATHS + (var_tmp_dir,)) as b:
        spec = SandboxSpec(workdir=workdir, ro_binds={str(harness): ro_target})
        with b.create(SandboxSpec(files={"secret.txt": "answer"})) as other, b.create(spec) as sb:
            script = f"pwd; ls -A {b.base_dir} {hidden}; cat {other.host_workdir}/secret.txt"
            r = sb.run(["sh", "-c", script + f"; sh {ro_target}/bin.sh; stat -c %a {var_tmp_dir}"])
        mode = f"{os.stat(var_tmp_dir).st_mode & 0o7777:o}"
        assert r.stdout == f"{workdir}\n{b.base_dir}:\n\n{hidden}:\nfrom-harness\n{mode}\n".encode(), r
    assert sorted(os.listdir(var_tmp_dir)) == ["hidden"]
    leak_check(base_dirs=[b.base_dir])


def test_allowed_port_and_defaults_with_a_workdir(backend, echo_server, name):
    workdir = f"/root/{name}/workspace"
    connect = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {echo_server.port}), timeout=5)\n"
        "s.sendall(b'ping'); print(s.recv(100).decode())\n"
    )
    spec = SandboxSpec(workdir=workdir, allow_ports=(echo_server.port,), home_files={".rc": "R"})
    with backend.create(spec) as sb:
        assert sb.home == "/run/home"
        assert sb.run([PY, "-c", connect]).stdout == b"echo:ping\n"
        r = sb.run(["sh", "-c", 'echo "$HOME $TMPDIR $PATH"; cat "$HOME/.rc"'])
        assert r.stdout == b"/run/home /tmp /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nR", r
    assert not os.path.lexists(f"/root/{name}")


# -- the spec and the other backends ------------------------------------------------------------


@pytest.mark.parametrize(
    "workdir, message",
    [
        ("ws", "normalised absolute path"),
        ("/root/", "normalised absolute path"),
        ("/root/../etc", "normalised absolute path"),
        ("/root/./ws", "normalised absolute path"),
        ("//root", "normalised absolute path"),
        ("/", "whole filesystem"),
        ("/tmp", "private tmpfs"),
        ("/run", "private tmpfs"),
        ("/proc", "/proc"),
        ("/proc/x", "/proc"),
        ("/dev/shm/ws", "/dev"),
        ("/sys/ws", "/sys"),
        ("/run/home", "/run/home"),
        ("/run/home/ws", "/run/home"),
        ("/run/proxy", "/run/proxy"),
        ("/opt/harness/ws", "ro_binds target '/opt/harness'"),
        ("/opt/harness", "ro_binds target '/opt/harness'"),
        ("/opt", "ro_binds target '/opt/harness'"),
        (b"/ws", "must be a str"),
    ],
)
def test_bad_workdir_is_a_value_error(workdir, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SandboxSpec(workdir=workdir, ro_binds={"/usr": "/opt/harness/"}).validate()


@pytest.mark.parametrize(
    "workdir", ["/run/ws", "/run/task", "/tmp/ws", "/root/.openclaw/workspace", "/workspace", "/opt/h"]
)
def test_good_workdir_is_accepted(workdir):
    SandboxSpec(workdir=workdir, ro_binds={"/usr": "/opt/harness"}).validate()


def test_local_backend_refuses_a_workdir(leak_check):
    with create_backend("local", allow_unsafe=True) as backend:
        with pytest.raises(ValueError, match="cannot put the workspace at workdir '/root/.openclaw/workspace'"):
            backend.create(SandboxSpec(workdir="/root/.openclaw/workspace"))
        assert os.listdir(backend.base_dir) == []
    leak_check(base_dirs=[backend.base_dir])


def test_bwrap_refuses_a_bad_workdir_before_making_anything(backend, host):
    with pytest.raises(ValueError, match="whole filesystem"):
        backend.create(SandboxSpec(workdir="/"))
    assert os.listdir(backend.base_dir) == ["view"] and host.own_cgroups() == []

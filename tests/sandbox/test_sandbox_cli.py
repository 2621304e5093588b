"""`clawfast sandbox run` end to end, through the real `clawfast` entry point."""

from __future__ import annotations

import subprocess
import sys

CLI = [sys.executable, "-m", "clawfast.cli", "sandbox", "run"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, timeout=timeout)


def test_exit_code_and_output_pass_through(tmp_path):
    (tmp_path / "in.txt").write_text("hello")
    r = cli("--workspace", str(tmp_path), "--", "sh", "-c", "cat in.txt; echo err >&2; exit 3")
    assert r.returncode == 3 and r.stdout == b"hello" and r.stderr == b"err\n"


def test_allowed_port_reachable_other_refused(echo_server):
    other = type(echo_server)()
    try:
        code = (
            "import socket, sys\n"
            "for port in (%d, %d):\n"
            "    try:\n"
            "        s = socket.create_connection(('127.0.0.1', port), timeout=5); s.sendall(b'hi'); print(s.recv(99))\n"
            "    except ConnectionRefusedError:\n"
            "        print('refused')\n"
        ) % (echo_server.port, other.port)
        r = cli("--allow-port", str(echo_server.port), "--", "/usr/bin/python3", "-c", code)
        assert r.returncode == 0 and r.stdout == b"b'echo:hi'\nrefused\n", r
    finally:
        other.close()


def test_timeout_and_keep(tmp_path):
    r = cli("--timeout", "0.5", "--", "sleep", "30")
    assert r.returncode == 124 and b"timed out" in r.stderr
    keep = tmp_path / "kept"
    r = cli("--keep", str(keep), "--", "sh", "-c", "echo made > out.txt")
    assert r.returncode == 0 and (keep / "out.txt").read_text() == "made\n"


def test_a_limit_is_named():
    r = cli("--memory-mb", "64", "--", "python3", "-c", "b = bytearray(256 << 20)")
    assert r.returncode == 137
    assert b"clawfast sandbox run: the command was killed by the sandbox's memory limit (64 MiB)" in r.stderr


def test_bad_usage():
    assert cli().returncode == 2  # no command
    assert cli("--backend", "local", "--", "true").returncode == 2  # local needs --unsafe
    assert cli("--backend", "local", "--unsafe", "--", "true").returncode == 0
    assert cli("--ro-bind", "nocolon", "--", "true").returncode == 2

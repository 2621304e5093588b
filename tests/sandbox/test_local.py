"""The local (no isolation) backend: opt-in only, same RunResult contract, process-group kill."""

from __future__ import annotations

import os

import pytest

from clawfast.sandbox import Limits, SandboxSpec, create_backend


def test_requires_explicit_opt_in():
    with pytest.raises(ValueError, match="allow_unsafe"):
        create_backend("local")


def test_runs_in_a_temp_workspace(leak_check, monkeypatch):
    monkeypatch.setenv("CLAWFAST_SECRET_TOKEN", "s3cret")
    backend = create_backend("local", allow_unsafe=True)
    with backend:
        with backend.create(SandboxSpec(files={"a.txt": "A"}, home_files={".rc": "R"})) as sb:
            r = sb.run(["sh", "-c", 'cat a.txt "$HOME/.rc"; pwd; env; echo new > b.txt; exit 4'])
            assert r.exit_code == 4
            assert r.stdout.startswith(b"AR" + sb.workdir.encode() + b"\n")
            assert b"s3cret" not in r.stdout
            assert sb.read_files() == {"a.txt": b"A", "b.txt": b"new\n"}
            assert sb.run(["cat"], stdin=b"in").stdout == b"in"
            assert sb.run(["sh", "-c", "kill -KILL $$"]).exit_code == 137
        assert not os.path.exists(sb.dir)
    leak_check(base_dirs=[backend.base_dir])


def test_timeout_and_exit_kill_the_process_group(marker, host):
    backend = create_backend("local", allow_unsafe=True)
    head = f'M={marker[:4]}; M="${{M}}{marker[4:]}"; '
    sleeper = "/usr/bin/python3 -c 'import time; time.sleep(300)' \"$M\""
    with backend, backend.create(SandboxSpec(limits=Limits(max_file_bytes=4096))) as sb:
        r = sb.run(["sh", "-c", head + f"{sleeper} & exec {sleeper}"], timeout=0.5)
        assert r.timed_out and r.exit_code is None
        assert host.pids_with(marker) == []
        r = sb.run(["sh", "-c", head + f"{sleeper} & sleep 0.3; echo done"])
        assert r.stdout == b"done\n" and host.pids_with(marker) == []
        assert sb.run(["sh", "-c", "head -c 10000 /dev/zero > big"]).exit_code != 0

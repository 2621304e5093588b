"""SandboxPool over the real bwrap backend: concurrency cap, start retries, async use, and the cleanup
guarantee under injected faults (timeout, killed command, killed sandbox, failed starts)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from clawfast.sandbox import SandboxError, SandboxPool, SandboxSpec
from clawfast.sandbox.bwrap import BwrapBackend

PY = "/usr/bin/python3"


class FailingStarts(BwrapBackend):
    """Fault injection around the real backend: the first `failures` creates fail like a sandbox that
    cannot start (a real bwrap start failure: a directory bound onto a file), later ones are normal."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.attempts = 0

    def create(self, spec):
        self.attempts += 1
        if self.attempts <= self.failures:
            spec = SandboxSpec(ro_binds={"/etc": "/etc/hostname"})
        return super().create(spec)


def test_concurrency_cap_is_respected():
    cap = 2
    inside = []
    lock = threading.Lock()
    now = [0]
    with SandboxPool("bwrap", max_concurrency=cap) as pool:
        def worker():
            with pool.sandbox(SandboxSpec()) as sb:
                with lock:
                    now[0] += 1
                    inside.append(now[0])
                sb.run(["sleep", "0.3"])
                with lock:
                    now[0] -= 1

        threads = [threading.Thread(target=worker) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert max(inside) == cap and pool.stats.peak_active == cap
        assert pool.stats.created == 5 and pool.stats.closed == 5 and pool.stats.active == 0


def test_wait_timeout_when_full():
    with SandboxPool("bwrap", max_concurrency=1) as pool:
        with pool.sandbox(SandboxSpec()):
            with pytest.raises(TimeoutError):
                with pool.sandbox(SandboxSpec(), wait_timeout=0.1):
                    pass


def test_failed_starts_are_retried_within_the_bound(leak_check):
    backend = FailingStarts(failures=2)
    with SandboxPool(backend, start_retries=2, retry_delay_s=0.01) as pool:
        with pool.sandbox(SandboxSpec()) as sb:
            assert sb.run(["true"]).ok
        assert backend.attempts == 3 and pool.stats.start_failures == 2
    leak_check(base_dirs=[backend.base_dir])


def test_retries_exhausted_raise_and_free_the_slot(leak_check):
    backend = FailingStarts(failures=10)
    with SandboxPool(backend, max_concurrency=1, start_retries=1, retry_delay_s=0.01) as pool:
        with pytest.raises(SandboxError), pool.sandbox(SandboxSpec()):
            pass
        assert backend.attempts == 2
        backend.failures = 0
        with pool.sandbox(SandboxSpec(), wait_timeout=1) as sb:  # the slot was given back
            assert sb.run(["true"]).ok
    leak_check(base_dirs=[backend.base_dir])


def test_async_use_shares_the_cap():
    async def main(pool):
        async def one(i):
            async with pool.asandbox(SandboxSpec(files={"i": str(i)})) as sb:
                r = await sb.arun(["sh", "-c", "sleep 0.2; cat i"])
                return r.stdout

        return await asyncio.gather(*(one(i) for i in range(6)))

    with SandboxPool("bwrap", max_concurrency=3) as pool:
        outs = asyncio.run(main(pool))
        assert outs == [str(i).encode() for i in range(6)]
        assert pool.stats.peak_active <= 3 and pool.stats.active == 0


def test_close_with_faults_leaves_nothing(leak_check, marker, host):
    """Several sandboxes at once: one times out, one has its command killed, one has its bwrap killed,
    one is still running when the pool closes. Afterwards nothing of any of them remains."""
    pool = SandboxPool("bwrap", max_concurrency=4)
    base_dir = pool.backend.base_dir
    results: dict[str, object] = {}
    sleeper = f"M={marker[:4]}; M=\"${{M}}{marker[4:]}\"; exec {PY} -c 'import time; time.sleep(300)' \"$M\" "

    def job(name, timeout):
        try:
            with pool.sandbox(SandboxSpec(name=name)) as sb:
                results[name] = sb.run(["sh", "-c", sleeper + name], timeout=timeout)
        except SandboxError as exc:
            results[name] = exc

    threads = {
        name: threading.Thread(target=job, args=(name, timeout))
        for name, timeout in (("timeout", 1.0), ("cmdkill", 60), ("boxkill", 60), ("open", 120))
    }
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + 20
    while len(host.pids_with(marker)) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(host.pids_with(marker)) == 4
    for pid in host.pids_with(marker + "\0cmdkill"):  # the sleeper's argv: ... marker, name
        os.kill(pid, signal.SIGKILL)
    for pid in host.children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"boxkill" in f.read():
                    os.kill(pid, signal.SIGKILL)  # the bwrap process itself
        except FileNotFoundError:
            pass  # a process of another job that just ended
    for name in ("timeout", "cmdkill", "boxkill"):
        threads[name].join(30)
    pool.close()  # "open" is still running: close kills it
    threads["open"].join(30)
    assert results["timeout"].timed_out
    assert results["cmdkill"].exit_code == 128 + signal.SIGKILL
    assert isinstance(results["boxkill"], SandboxError)
    assert isinstance(results["open"], SandboxError)
    leak_check(base_dirs=[base_dir], markers=[marker])


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError):
        SandboxPool("bwrap", max_concurrency=0)
    with pytest.raises(ValueError):
        SandboxPool("nonesuch")
    with pytest.raises(ValueError):
        SandboxPool("local")  # no allow_unsafe=True


def test_warm_sandboxes_are_provisioned_per_request(leak_check, echo_server, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "from_dir.txt").write_text("d")
    template = SandboxSpec(allow_ports=(echo_server.port,))
    pool = SandboxPool("bwrap", max_concurrency=2, warm=2, warm_spec=template)
    base_dir = pool.backend.base_dir
    deadline = time.monotonic() + 30
    while pool.warm_ready < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.warm_ready == 2
    code = "import socket; s = socket.create_connection(('127.0.0.1', %d)); s.sendall(b'w'); print(s.recv(9).decode())"
    for i in range(3):  # the third comes after the refill thread replaced the first two
        spec = SandboxSpec(
            allow_ports=(echo_server.port,), files={"task.txt": f"t{i}"}, source_dir=str(src),
            home_files={".rc": "r"}, name=f"job{i}",
        )
        with pool.sandbox(spec) as sb:
            assert sb.spec is spec
            r = sb.run(["sh", "-c", "cat task.txt from_dir.txt $HOME/.rc; ls | wc -l"])
            assert r.stdout == f"t{i}dr2\n".encode()
            assert sb.run([PY, "-c", code % echo_server.port]).stdout == b"echo:w\n"
        if i == 1:
            deadline = time.monotonic() + 30
            while pool.warm_ready < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
    assert pool.stats.warm_hits == 3
    # A spec that differs in more than files (here: the allowed ports) never gets a warm sandbox.
    with pool.sandbox(SandboxSpec(files={"x": "y"})) as sb:
        assert sb.read_files() == {"x": b"y"}
    assert pool.stats.warm_hits == 3 and pool.stats.created == 4
    pool.close()
    leak_check(base_dirs=[base_dir])


def test_async_cancellation_during_start_leaks_nothing(leak_check):
    pool = SandboxPool("bwrap", max_concurrency=2)
    base_dir = pool.backend.base_dir

    async def use():
        async with pool.asandbox(SandboxSpec()) as sb:
            await sb.arun(["sleep", "30"])

    async def main():
        for delay in (0.0, 0.002, 0.01, 0.05):  # some cancel during the start, some during the run
            task = asyncio.create_task(use())
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        deadline = time.monotonic() + 10
        while pool.stats.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert pool.stats.active == 0 and pool.stats.closed == pool.stats.created
    pool.close()
    leak_check(base_dirs=[base_dir])

"""The sandbox's only way out: Unix sockets on the host that forward to loopback TCP ports.

A sandbox with its own network namespace has nothing but its own loopback. For each allowed port the
host listens on a Unix socket (`<dir>/<port>.sock`), bind-mounted into the sandbox, and forwards each
connection to `127.0.0.1:<port>` of the host (the proxy). Inside, a forwarder listening on the
sandbox's `127.0.0.1:<port>` connects to that socket (see `inner_forwarders_script`), so the harness
talks to `http://127.0.0.1:<port>` as if the proxy were local.

`HostForwarder` runs every host-side socket of a backend on one asyncio loop in one daemon thread:
no process per sandbox, nothing to reap. Guaranteed: after `remove(handle)` returns, the socket file
is gone and every connection it accepted is closed; after `close()`, the thread has ended.
Not guaranteed: throughput beyond what one Python thread moves (ample for model calls, which are
small and latency-bound next to generation).
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field

from clawfast.sandbox.base import SandboxError

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_UNIX_PATH = 107
_CHUNK = 1 << 16


@dataclass
class _Server:
    server: asyncio.AbstractServer
    path: str
    port: int
    tasks: set = field(default_factory=set)


class HostForwarder:
    """Unix socket -> host 127.0.0.1:port forwarders on a shared background event loop."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawfast-forwarder", daemon=True)
        self._thread.start()
        self._closed = False

    def add(self, socket_path: str, port: int, timeout: float = 5.0) -> _Server:
        """Listen on `socket_path` (must not exist) and forward to 127.0.0.1:`port`."""
        if len(os.fsencode(socket_path)) > MAX_UNIX_PATH:
            raise SandboxError(f"socket path too long for a Unix socket ({len(socket_path)} > {MAX_UNIX_PATH}): {socket_path}")
        if self._closed:
            raise SandboxError("forwarder is closed")
        fut = asyncio.run_coroutine_threadsafe(self._add(socket_path, port), self._loop)
        try:
            return fut.result(timeout)
        except OSError as exc:
            raise SandboxError(f"cannot listen on {socket_path}: {exc}") from exc
        except TimeoutError as exc:
            fut.cancel()
            raise SandboxError(f"forwarder did not start listening on {socket_path} within {timeout}s") from exc

    def remove(self, handle: _Server, timeout: float = 5.0) -> None:
        if self._closed or not self._thread.is_alive():
            _unlink(handle.path)
            return
        asyncio.run_coroutine_threadsafe(self._remove(handle), self._loop).result(timeout)

    def close(self) -> None:
        """Stop the loop thread. Servers still registered are closed first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _add(self, socket_path: str, port: int) -> _Server:
        holder: dict = {}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            holder["srv"].tasks.add(task)
            try:
                await _serve(reader, writer, port)
            finally:
                holder["srv"].tasks.discard(task)

        server = await asyncio.start_unix_server(handle, path=socket_path)
        srv = _Server(server=server, path=socket_path, port=port)
        holder["srv"] = srv
        return srv

    async def _remove(self, srv: _Server) -> None:
        srv.server.close()
        for task in list(srv.tasks):
            task.cancel()
        if srv.tasks:
            await asyncio.wait(list(srv.tasks), timeout=2.0)
        await srv.server.wait_closed()
        _unlink(srv.path)


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
    await relay(reader, writer, "127.0.0.1", port)


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int) -> None:
    """Splice one accepted connection to a new TCP connection to (host, port), both ways, until
    both sides are done (half-closes pass through)."""
    try:
        up_reader, up_writer = await asyncio.open_connection(host, port)
    except OSError:
        # The target is not listening: the client sees its connection closed, as it would a refusal.
        writer.close()
        return
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        for w in (writer, up_writer):
            w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: HTTP clients may wait for the reply after sending EOF
    except (ConnectionError, OSError):
        writer.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def inner_forwarders_script(socat: str, ports: tuple[int, ...], sock_dir: str) -> str:
    """A POSIX sh fragment that starts one socat per port on the sandbox's 127.0.0.1 and returns only
    once every one listens (it polls /proc/net/tcp with shell builtins, no forks). On failure it exits
    with status 125 before the command starts; the caller sees no readiness marker: a sandbox error."""
    fail = "echo 'clawfast-sandbox: proxy forwarder did not start' >&2; exit 125"
    lines = [socat_check(socat)]
    lines.append(
        "_cf_listening() { while read -r _ _l _ _s _; do [ \"$_l\" = \"$1\" ] && [ \"$_s\" = 0A ] && return 0; "
        "done < /proc/net/tcp; return 1; }"
    )
    lines.append("_cf_pids=")
    for port in ports:
        # Only where none listens yet: a docker container keeps the forwarders of its earlier commands.
        # -t 600: after the client half-closes, wait for the reply (socat's default gives up after
        # 0.5 s of silence, which lost a reply that took 1.5 s in tests/sandbox/test_bwrap.py).
        lines.append(
            f"_cf_listening 0100007F:{port:04X} || {{ {socat} -t 600 TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"
            f" UNIX-CONNECT:{sock_dir}/{port}.sock & _cf_pids=\"$_cf_pids $!\"; }}"
        )
    want = " ".join(f"0100007F:{port:04X}" for port in ports)
    lines.append("_cf_missing() { for _w in " + want + "; do _cf_listening $_w || return 0; done; return 1; }")
    # socat binds within a few ms: scan with builtins first (a scan is ~10 us), then yield the CPU
    # with short sleeps (a loaded machine may need them); fail at once if a socat died (port taken,
    # bad socket), and give up after about 10 s.
    lines.append(
        "_cf_i=0; while _cf_missing; do _cf_i=$((_cf_i+1)); "
        "for _p in $_cf_pids; do kill -0 $_p 2>/dev/null || { " + fail + "; }; done; "
        "[ $_cf_i -gt 300 ] && sleep 0.01; "
        "if [ $_cf_i -gt 1300 ]; then " + fail + "; fi; done"
    )
    return "\n".join(lines)


def socat_check(socat: str) -> str:
    """sh that fails the start (status 125, no readiness marker) when socat is missing inside."""
    return f"command -v {socat} >/dev/null 2>&1 || {{ echo 'clawfast-sandbox: {socat} not found' >&2; exit 125; }}"

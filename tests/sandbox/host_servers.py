"""Throw-away servers on the host that the sandbox tests try to reach: each listens on its socket,
answers every connection from a thread, and counts the connections it got."""

from __future__ import annotations

import os
import socket
import threading
from typing import Callable


class HostServer:
    """Serves `sock` (bound, not yet listening): each connection is counted and answered by
    `answer(connection)`."""

    def __init__(self, sock: socket.socket, answer: Callable[[socket.socket], None]) -> None:
        self.sock = sock
        self.answer = answer
        self.sock.listen(16)
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                self.answer(conn)

    def close(self) -> None:
        # shutdown wakes the accept() of the serving thread; close alone may not.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(2)


class EchoServer(HostServer):
    """A TCP server on a host loopback port that answers each connection with b"echo:" + first read."""

    def __init__(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        super().__init__(sock, lambda conn: conn.sendall(b"echo:" + conn.recv(1024)))


class UnixServer(HostServer):
    """A world-connectable Unix socket server on the host (a path, or "\\0name": an abstract name)
    that answers b"host-socket"."""

    def __init__(self, path: str) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        if not path.startswith("\0"):  # an abstract name has no file
            os.chmod(path, 0o777)
        super().__init__(sock, lambda conn: conn.sendall(b"host-socket"))

"""A peer on 127.0.0.1 that answers every connection with the same raw bytes, HTTP or not: a port taken over by
another process (a ZeroMQ socket answers with its greeting), or a broken server."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def raw_peer(answer: bytes) -> Iterator[str]:
    """Its base URL (``http://127.0.0.1:PORT``) while it answers; closed on exit."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join(10)
        server.close()


NOT_HTTP = [b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", b"HTTP/1.1 abc\r\n\r\n", b"",
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"records\": ["]
"""Answers that are not a whole HTTP response: a ZeroMQ greeting, a malformed status line, nothing, a body cut
short."""

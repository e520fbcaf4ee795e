"""Serve an ASGI application with uvicorn (uvloop + httptools) inside the caller's event loop."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.abc
import uvicorn

from kvemu.errors import KvemuError

__all__ = ["HttpServer", "ListenError", "check_listen", "parse_listen", "SERVERS"]

log = logging.getLogger("kvemu.http")


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (port 0 picks a free one) → (host, port); ``ValueError`` naming what is wrong."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--http {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    try:
        n = int(port)
    except ValueError:
        raise ValueError(f"--http {listen!r}: the port {port!r} is not a number") from None
    if not 0 <= n <= 65535:
        raise ValueError(f"--http {listen!r}: the port must be in 0..65535")
    return host.strip("[]"), n


class ListenError(KvemuError, OSError):
    """``--http HOST:PORT`` cannot be listened on (in use, or not an address of this machine); says what to do."""


def _bind(listen: str) -> socket.socket:
    """A socket bound to ``listen`` as the server binds it (``SO_REUSEADDR``); ``ListenError`` if it cannot be."""
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"--http {listen}: the address is in use (another server listens there): stop it, or "
                              "pick another port (port 0 picks a free one)") from None
        raise ListenError(f"--http {listen}: cannot listen there ({exc.strerror or exc}): give an address of this "
                          "machine, e.g. 127.0.0.1:8000") from None
    return sock


def check_listen(listen: str) -> None:
    """Raise ``ListenError`` now if a server could not listen on ``listen`` (before starting processes)."""
    _bind(listen).close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process that embeds us owns its signals


SERVERS = ("uvicorn", "granian")
"""HTTP servers that can run the app: uvicorn (uvloop + httptools, the default) or granian (Rust HTTP
handling, ``pip install 'kvemu[granian]'``)."""


class HttpServer:
    """One listening address serving ``app``; ``serve`` runs until cancelled, then closes connections."""

    def __init__(self, app: Any, listen: str, server: str = "uvicorn") -> None:
        if server not in SERVERS:
            raise ValueError(f"--http-server {server!r}: one of {', '.join(SERVERS)}")
        sock = _bind(listen)
        host = parse_listen(listen)[0]
        family = sock.family
        sock.listen(2048)
        sock.setblocking(False)
        self.sock = sock
        self.host = host
        self.port = sock.getsockname()[1]
        self.url = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{self.port}"
        """Where clients reach it (the port is the real one when 0 was asked for)."""
        if not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
            log.warning("HTTP on %s: reachable from other machines and without authentication; anyone who can "
                        "reach it can send requests and read the metrics", self.url)
        self.server = server
        self._app = app
        if server == "uvicorn":
            config = uvicorn.Config(app, http="httptools", lifespan="off", access_log=False, log_level="warning",
                                    timeout_keep_alive=30, timeout_graceful_shutdown=1, server_header=False)
            self._server = _Server(config)

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; with ``TaskGroup.start`` it returns once clients can connect."""
        if self.server == "granian":
            await self._serve_granian(task_status)
            return
        task_status.started()  # the socket listens already: early clients wait in its backlog
        try:
            await self._server.serve(sockets=[self.sock])
        finally:
            self.sock.close()

    async def _serve_granian(self, task_status: anyio.abc.TaskStatus) -> None:
        try:
            from granian.constants import Interfaces
            from granian.server.embed import Server
        except ImportError:
            raise RuntimeError("--http-server granian needs granian: pip install 'kvemu[granian]'") from None
        self.sock.close()  # granian binds the address itself (the port was reserved until now)
        server = Server(self._app, address=self.host, port=self.port, interface=Interfaces.ASGI, log_enabled=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            with anyio.fail_after(30):
                while True:
                    try:
                        stream = await anyio.connect_tcp(self.host, self.port)
                    except OSError:
                        await anyio.sleep(0.02)
                        continue
                    await stream.aclose()
                    break
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                server.stop()

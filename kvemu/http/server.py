"""Serve an ASGI application with uvicorn (uvloop + httptools) inside the caller's event loop."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["HttpServer", "parse_listen"]

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


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process that embeds us owns its signals


class HttpServer:
    """One listening socket serving ``app``; ``serve`` runs until cancelled, then closes connections."""

    def __init__(self, app: Any, listen: str) -> None:
        host, port = parse_listen(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"--http {listen}: cannot listen there: {exc}") from None
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
        config = uvicorn.Config(app, http="httptools", lifespan="off", access_log=False, log_level="warning",
                                timeout_keep_alive=30, timeout_graceful_shutdown=1, server_header=False)
        self._server = _Server(config)

    async def serve(self) -> None:
        """Serve until cancelled."""
        try:
            await self._server.serve(sockets=[self.sock])
        finally:
            self.sock.close()

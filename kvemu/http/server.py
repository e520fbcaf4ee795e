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
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvemu.errors import KvemuError

__all__ = ["HttpServer", "ListenError", "check_listen", "parse_listen", "SERVERS", "MAX_HEAD_BYTES",
           "REQUEST_TIMEOUT_S", "DRAIN_S"]

MAX_HEAD_BYTES = 64 << 10
"""The most bytes of a request line and headers together; more is refused with 431 and the connection closed."""
REQUEST_TIMEOUT_S = 30.0
"""How long a connection may take to send a whole request (line, headers and body), counted from when the
server starts waiting for it (the connection opened, or the previous response ended); then it is closed."""

DRAIN_S = 1.0
"""How long a connection answered before its request finished arriving (431, 413) goes on being read, and what
comes dropped, before it is closed."""

log = logging.getLogger("kvemu.http")


class _FewInvalidRequests(logging.Filter):
    """uvicorn logs a warning for every request httptools cannot parse (each gets its 400): a router's probe or a
    scanner sent dozens. Logged are the first and then every 1,000th, each with the count so far."""

    MESSAGE = "Invalid HTTP request received."

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.logged = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE:
            return True
        self.count += 1
        if self.count != 1 and self.count % 1000:
            return False
        record.msg = f"{self.MESSAGE[:-1]} (answered 400; {self.count} so far, logged: the first, then every 1,000th)"
        self.logged += 1
        return True


INVALID_REQUESTS = _FewInvalidRequests()
logging.getLogger("uvicorn.error").addFilter(INVALID_REQUESTS)


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


def _refusal(status: int, reason: bytes, message: bytes) -> bytes:
    return (b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(message), message))


class _BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds httptools lacks: ``max_head_bytes`` for a request's line and
    headers (httptools buffers a header of any size, re-copying it as it grows: 100 MB took 13 s and 285 MB),
    and ``request_timeout_s`` to receive a whole request (uvicorn times out only idle keep-alive connections
    after a response, and any byte cancels that: a slow client held its connection forever)."""

    max_head_bytes = MAX_HEAD_BYTES
    request_timeout_s = REQUEST_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:
        self._head_bytes = 0
        """Bytes of the request head read so far (its line and headers, up to the blank line)."""
        self._tail = b""
        """The last bytes of an unfinished head: its blank line may straddle two reads."""
        self._in_head = True
        """No request line and headers complete since the last request ended (or the connection opened)."""
        self._received = 0
        self._answered = 0
        self._deadline: Any = None
        self._refused = False
        """Answered and closing: what the client still sends is read and dropped (``_drain``)."""
        self._raw = transport
        super().connection_made(_DrainingTransport(transport, self))  # type: ignore[arg-type]  # duck-typed
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes:  # a request started and never finished its headers
            self.transport.write(_refusal(408, b"Request Timeout", b"the request took too long to arrive"))
        self._raw.close()  # an app still reading a body sees the client leave

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what the client still sends after its refusal is dropped unparsed
        if self._in_head:  # measured before parsing: one read may hold a head and a whole body after it
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            size = self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._tail))
            if size > self.max_head_bytes:
                self._refuse()
                return
            self._head_bytes, self._tail = (size, bytes(seen[-3:])) if end < 0 else (0, b"")
        super().data_received(data)

    def _refuse(self) -> None:
        """Answer 431 and close (``_drain``)."""
        self._raw.write(_refusal(431, b"Request Header Fields Too Large",
                                 b"the request line and headers are larger than %d bytes" % self.max_head_bytes))
        self._drain()

    def _body_unread(self) -> bool:
        """A request's headers came and the rest of its body has not (the app answered before reading it all)."""
        return not self._in_head and not self._raw.is_closing()

    def _drain(self) -> None:
        """Close after an answer sent while the client may still be sending: end our side, then read and drop what
        comes for up to ``DRAIN_S``, so the answer is not lost to the reset a close with unread data sends."""
        if self._refused:
            return
        self._disarm()
        self._refused = True
        if self._raw.can_write_eof():
            self._raw.write_eof()
        self._raw.resume_reading()  # uvicorn paused reading while the app had not taken the body
        self._deadline = self.loop.call_later(DRAIN_S, self._raw.close)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes, self._tail = 0, b""
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        self._received += 1
        if self._received > self._answered:
            self._disarm()  # the whole request is here: answering it may take any time
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._answered += 1
        super().on_response_complete()
        if self._answered >= self._received and not self.transport.is_closing():
            self._arm()  # waiting for the client's next request


class _DrainingTransport:
    """A connection's transport as uvicorn sees it, except that its close of a connection whose request body is
    still arriving (a 413 before the body was read, any answer sent early with ``connection: close``) drains
    first (``_BoundedProtocol._drain``): closing at once reset the connection, and the client never saw its 413."""

    def __init__(self, transport: Any, protocol: _BoundedProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        if self._protocol._body_unread():
            self._protocol._drain()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol._refused or bool(self._transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _bounded(max_head_bytes: int, request_timeout_s: float) -> type[_BoundedProtocol]:
    return type("BoundedHttpToolsProtocol", (_BoundedProtocol,),
                {"max_head_bytes": max_head_bytes, "request_timeout_s": request_timeout_s})


SERVERS = ("uvicorn", "granian")
"""HTTP servers that can run the app: uvicorn (uvloop + httptools, the default) or granian (Rust HTTP
handling, ``pip install 'kvemu[granian]'``)."""


class HttpServer:
    """One listening address serving ``app``; ``serve`` runs until cancelled, then closes connections."""

    def __init__(self, app: Any, listen: str, server: str = "uvicorn", *, max_head_bytes: int = MAX_HEAD_BYTES,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
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
        self.max_head_bytes = max_head_bytes
        self.request_timeout_s = request_timeout_s
        if server == "uvicorn":
            # uvicorn annotates timeout_keep_alive as int but only passes it to loop.call_later: a float works
            config = uvicorn.Config(app, http=_bounded(max_head_bytes, request_timeout_s), lifespan="off",
                                    access_log=False, log_level="warning",
                                    timeout_keep_alive=request_timeout_s,  # type: ignore[arg-type]
                                    timeout_graceful_shutdown=1, server_header=False)
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
            # cancelled, uvicorn leaves its listening socket accepting and its connections open, their requests
            # waiting: close and drop them, as a process that died would (a client or router in front sees
            # connections refused and dropped, not a minute of silence)
            for listener in getattr(self._server, "servers", ()):
                listener.close()
            for conn in list(self._server.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            self.sock.close()

    async def _serve_granian(self, task_status: anyio.abc.TaskStatus) -> None:
        try:
            from granian.constants import Interfaces
            from granian.server.embed import Server
        except ImportError:
            raise RuntimeError("--http-server granian needs granian: pip install 'kvemu[granian]'") from None
        self.sock.close()  # granian binds the address itself (the port was reserved until now)
        from granian.http import HTTP1Settings

        # granian (hyper) bounds what it buffers of a request head and the time to receive it; the body's
        # size and time are bounded by the app
        http1 = HTTP1Settings(header_read_timeout=max(1, int(self.request_timeout_s * 1000)),
                              max_buffer_size=max(8192, self.max_head_bytes))
        server = Server(self._app, address=self.host, port=self.port, interface=Interfaces.ASGI, log_enabled=False,
                        http1_settings=http1)
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

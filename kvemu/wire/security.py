"""Optional authentication and encryption of every kvemu socket: ZeroMQ CURVE keyed by one shared secret.

Off by default. With ``KVEMU_SECRET`` set in the environment of the router, the workers and the clients,
every socket kvemu binds is a CURVE server whose key pair is derived from the secret, and every socket it
connects is a CURVE client that needs that server key: a peer without the secret cannot complete the
handshake, so it can neither send (register, submit, control) nor read (replies, KV events carrying
prompt token ids), and the traffic is encrypted. Binding a non-loopback address without a secret logs a
warning, since anyone who reaches it can do all of that.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re

import zmq
from zmq.utils import z85

from kvemu.errors import InvalidArgument

__all__ = ["SECRET_ENV", "secret", "serve_securely", "bind_securely", "connect_securely", "exposure_warning"]

log = logging.getLogger("kvemu.security")

SECRET_ENV = "KVEMU_SECRET"
"""The environment variable holding the shared secret (empty or unset: no authentication)."""
_LOOPBACK = re.compile(r"(tcp://(127(\.\d{1,3}){3}|localhost|\[::1\])(:\d+|:\*)?|ipc://.*|inproc://.*)")


def secret() -> str | None:
    """The shared secret of this process (None when authentication is off)."""
    return os.environ.get(SECRET_ENV) or None


def _server_keys(shared: str) -> tuple[bytes, bytes]:
    secret_key = z85.encode(hashlib.sha256(b"kvemu-curve-server\0" + shared.encode()).digest())
    return zmq.curve_public(secret_key), secret_key


_ENV = object()


def serve_securely(sock: zmq.Socket, endpoint: str, shared: str | None | object = _ENV) -> None:
    """Make a socket about to bind ``endpoint`` a CURVE server when there is a secret (``shared``, or this
    process's); warn when it would be reachable beyond this machine without one."""
    if shared is _ENV:
        shared = secret()
    if not shared:
        warning = exposure_warning(endpoint)
        if warning:
            log.warning("%s", warning)
        return
    public, secret_key = _server_keys(shared)  # type: ignore[arg-type]
    sock.curve_secretkey = secret_key
    sock.curve_publickey = public
    sock.curve_server = True


def bind_securely(sock: zmq.Socket, endpoint: str) -> str:
    """``serve_securely`` then bind ``endpoint``; returns the bound endpoint (its real port for port 0). A busy or
    foreign address closes the socket and raises ``InvalidArgument`` saying what to do, not a ZeroMQ traceback."""
    serve_securely(sock, endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        why = (exc.strerror or str(exc)).split(" (addr=")[0]
        raise InvalidArgument(f"{endpoint}: cannot listen there ({why}): stop what listens there, or pick another "
                              "port (port 0 picks a free one)") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_securely(sock: zmq.Socket, shared: str | None | object = _ENV) -> None:
    """Make a socket about to connect a CURVE client of the secret's server key (``shared``, or this
    process's secret; nothing without one)."""
    if shared is _ENV:
        shared = secret()
    if not shared:
        return
    public, secret_key = zmq.curve_keypair()
    sock.curve_serverkey = _server_keys(shared)[0]  # type: ignore[arg-type]
    sock.curve_publickey = public
    sock.curve_secretkey = secret_key


def exposure_warning(endpoint: str) -> str | None:
    """Why binding ``endpoint`` without a secret exposes the cluster (None for loopback and ipc addresses)."""
    if _LOOPBACK.fullmatch(endpoint):
        return None
    return (f"binding {endpoint} without {SECRET_ENV}: anyone who reaches it can register workers, send "
            "requests and read KV events (which carry prompt token ids); set the same secret in "
            f"{SECRET_ENV} for the router, the workers and the clients")

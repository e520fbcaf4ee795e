"""Optional authentication and encryption of every kvemu socket: ZeroMQ CURVE keyed by one shared secret.

Off by default. With ``KVEMU_SECRET`` set in the environment of the router, the workers and the clients,
every socket kvemu binds is a CURVE server whose key pair is derived from the secret, and every socket it
connects is a CURVE client that needs that server key: a peer without the secret cannot complete the
handshake, so it can neither send (register, submit, control) nor read (replies, KV events carrying
prompt token ids), and the traffic is encrypted. Every listener opened without a secret says so in one line
when it starts (``exposure_warning``): on 127.0.0.1 any local process can do all of that, beyond it anyone who
reaches the port. ``kvemu up`` and ``kvemu serve`` generate a secret per run (``ensure_secret``) and hand it to
their own children in the environment, so by default nothing else on the machine talks to their sockets.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import re
import secrets
from typing import Final, Literal

import zmq
from zmq.utils import z85

from kvemu.errors import InvalidArgument

__all__ = ["SECRET_ENV", "HANDOFF_SECRET_ENV", "secret", "ensure_secret", "serve_securely", "bind_securely", "connect_securely",
           "exposure_warning"]

log = logging.getLogger("kvemu.security")

SECRET_ENV = "KVEMU_SECRET"
"""The environment variable holding the shared secret (empty or unset: no authentication)."""
HANDOFF_SECRET_ENV = "KVEMU_HANDOFF_SECRET"
"""The secret a fleet's prefill and decode workers prove their KV handoff answers with
(``harness.procs.kv_handoff``); never used for a ZeroMQ socket, so other routers still read the KV events."""
_LOOPBACK = re.compile(r"(tcp://(127(\.\d{1,3}){3}|localhost|\[::1\])(:\d+|:\*)?|ipc://.*)")


def secret(name: str = SECRET_ENV) -> str | None:
    """The shared secret of this process (None when authentication is off); ``name``: which one."""
    return os.environ.get(name) or None


def ensure_secret(name: str = SECRET_ENV) -> bool:
    """Give this process (and so every child it starts: they inherit its environment, never its argv, which
    any local user can read in /proc) a fresh random secret unless the user set one; returns whether it made
    one. For a supervisor (``kvemu up``, ``kvemu serve``) whose sockets only it and its children use."""
    if secret(name):
        return False
    os.environ[name] = secrets.token_urlsafe(32)
    return True


def _server_keys(shared: str) -> tuple[bytes, bytes]:
    secret_key = z85.encode(hashlib.sha256(b"kvemu-curve-server\0" + shared.encode()).digest())
    return zmq.curve_public(secret_key), secret_key


class _Env(enum.Enum):
    SECRET = "the secret of this process's environment"


_ENV: Final = _Env.SECRET
"""``shared``'s default: this process's secret (``secret()``), read when the socket is secured."""


def serve_securely(sock: zmq.Socket[object], endpoint: str, shared: str | None | Literal[_Env.SECRET] = _ENV) -> bool:
    """Make a socket about to bind ``endpoint`` a CURVE server when there is a secret (``shared``, or this
    process's); without one it stays open to whoever reaches it (``bind_securely`` says so). Returns whether
    it is one."""
    if shared is _ENV:
        shared = secret()
    if not shared:
        return False
    public, secret_key = _server_keys(shared)
    sock.curve_secretkey = secret_key
    sock.curve_publickey = public
    sock.curve_server = True
    return True


def bind_securely(sock: zmq.Socket[object], endpoint: str) -> str:
    """``serve_securely`` then bind ``endpoint``; returns the bound endpoint (its real port for port 0). A busy or
    foreign address closes the socket and raises ``InvalidArgument`` saying what to do, not a ZeroMQ traceback."""
    secured = serve_securely(sock, endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        why = (exc.strerror or str(exc)).split(" (addr=")[0]
        raise InvalidArgument(f"{endpoint}: cannot listen there ({why}): stop what listens there, or pick another "
                              "port (port 0 picks a free one)") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if not secured:
        warning = exposure_warning(bound)
        if warning:
            log.warning("%s", warning)
    return bound


def connect_securely(sock: zmq.Socket[object], shared: str | None | Literal[_Env.SECRET] = _ENV) -> None:
    """Make a socket about to connect a CURVE client of the secret's server key (``shared``, or this
    process's secret; nothing without one)."""
    if shared is _ENV:
        shared = secret()
    if not shared:
        return
    public, secret_key = zmq.curve_keypair()
    sock.curve_serverkey = _server_keys(shared)[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret_key


def exposure_warning(endpoint: str) -> str | None:
    """The one line a listener on ``endpoint`` without a secret prints when it opens: who can use it (any local
    process on a loopback or ipc address, anyone who reaches the port beyond), and what to set (None for an
    ``inproc://`` address: only this process reaches it)."""
    if endpoint.startswith("inproc://"):
        return None
    who = "any local process" if _LOOPBACK.fullmatch(endpoint) else "anyone who reaches it"
    return (f"kvemu: listening on {endpoint} without a secret: {who} can register, submit and read KV events "
            f"(which carry prompt token ids); set {SECRET_ENV} to the same secret for every kvemu process")

"""Size bounds on what a peer can send over ZeroMQ.

Every kvemu socket tells ZeroMQ the largest inbound message it accepts (``MAXMSGSIZE``): a peer that sends a
larger one is disconnected by ZeroMQ before the message is buffered, so one hostile frame cannot exhaust the
router's memory. The bounds are generous for genuine traffic (a ``Dispatch`` carries a whole prompt).
"""

from __future__ import annotations

import zmq

from kvemu.limits import MAX_KV_BATCH_BYTES

__all__ = ["MAX_MESSAGE_BYTES", "MAX_KV_BATCH_BYTES", "MAX_CONTROL_BYTES", "limit_inbound"]

MAX_MESSAGE_BYTES = 64 << 20
"""Largest actor message (router, worker and client sockets): a 4M-token prompt fits."""
MAX_CONTROL_BYTES = 4096
"""Largest subscription or replay request a publisher accepts."""


def limit_inbound(sock: zmq.Socket[object], max_bytes: int) -> None:
    """Refuse (disconnect the sender of) any inbound message longer than ``max_bytes``."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)

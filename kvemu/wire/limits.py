"""Size bounds on what a peer can send over ZeroMQ.

Every kvemu socket tells ZeroMQ the largest inbound message it accepts (``MAXMSGSIZE``): a peer that sends a
larger one is disconnected by ZeroMQ before the message is buffered, so one hostile frame cannot exhaust the
router's memory. The bounds are generous for genuine traffic (a ``Dispatch`` carries a whole prompt).
"""

from __future__ import annotations

import zmq

__all__ = ["MAX_MESSAGE_BYTES", "MAX_KV_BATCH_BYTES", "MAX_CONTROL_BYTES", "MAX_PROMPT_TOKENS", "MAX_OUTPUT_TOKENS",
           "limit_inbound"]

MAX_MESSAGE_BYTES = 64 << 20
"""Largest actor message (router, worker and client sockets): a 4M-token prompt fits."""
MAX_KV_BATCH_BYTES = 64 << 20
"""Largest KV-event batch, live or replayed."""
MAX_PROMPT_TOKENS = 1 << 22
"""Most tokens in a client's prompt (the most a scenario or trace may ask for): a longer one is refused while
the message is decoded, from its array's length, before a list of it is built or any block of it hashed (a
64 MiB message holds up to 64M one-byte token ids: 0.3 s and 360 MB per 10M tokens before this bound)."""
MAX_OUTPUT_TOKENS = 1 << 22
"""Most output token ids a client may choose for a request (``ClientRequest.output_token_ids``)."""
MAX_CONTROL_BYTES = 4096
"""Largest subscription or replay request a publisher accepts."""


def limit_inbound(sock: zmq.Socket, max_bytes: int) -> None:
    """Refuse (disconnect the sender of) any inbound message longer than ``max_bytes``."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)

"""ZeroMQ endpoint rules shared by publishers and subscribers (vLLM's conventions)."""

from __future__ import annotations

import re

from kvemu.errors import InvalidArgument

__all__ = ["should_bind", "offset_endpoint", "SEQ_END"]

SEQ_END = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker: sequence number -1 as 8 signed big-endian bytes."""

_TCP = re.compile(r"^(tcp://.*:)(\d+)$")


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind on a wildcard host, ``::``, ``ipc://`` or ``inproc://``; connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint of DP rank ``dp_rank``: TCP port + rank (port 0 stays 0), ``inproc`` gets ``_dp<rank>``."""
    if dp_rank == 0:
        return endpoint
    m = _TCP.match(endpoint)
    if m:
        port = int(m.group(2))
        return endpoint if port == 0 else f"{m.group(1)}{port + dp_rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    raise InvalidArgument(f"endpoint {endpoint!r} cannot be offset for DP rank {dp_rank}: use tcp:// or inproc://")

"""Async helpers around ``SessionAffinity``: await a pending initialization; reap on wall time."""

from __future__ import annotations

import anyio

from kvemu.affinity import Hold, SessionAffinity, Wait
from kvemu.clock import NS_PER_S
from kvemu.eligibility import AffinityTarget
from kvemu.errors import InvalidArgument

__all__ = ["acquire", "run_reaper"]


async def acquire(table: SessionAffinity, session: str, requested_target: AffinityTarget | tuple | None = None) -> Hold:
    """``try_acquire`` that waits (on whatever clock the loop runs) while another request initializes."""
    while True:
        result = table.try_acquire(session, requested_target)
        if not isinstance(result, Wait):
            return result
        settled = anyio.Event()
        table.on_settled(result, settled.set)
        await settled.wait()


async def run_reaper(table: SessionAffinity) -> None:
    """Expire idle bindings every ``min(ttl, 30 s)``; for wall-clock tables only (runs until cancelled)."""
    interval = table.reaper_interval_ns
    if interval is None:
        raise InvalidArgument("a table on virtual time expires lazily; it needs no reaper")
    while True:
        await anyio.sleep(interval / NS_PER_S)
        table.expire()

"""One router socket in front of several pool routers: each worker's messages go to the router of its pool.

The router process of a disaggregated cluster hosts a prefill and a decode router on one ``--listen``
address. A ``Register`` goes to the pool of the type it declares (a type no hosted pool takes is refused
here, with a ``RegisterAck`` that names the flag to fix, and changes nothing); every other message goes to
the router its connection registered with, so a worker speaks only to its own pool's router (which checks,
as ever, that a message about a request comes from the worker the request was dispatched to). Messages of
a connection no router knows go to the first pool's router, which asks the worker to register again.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec

from kvemu.messages import Register, RegisterAck, WorkerMessage
from kvemu.runtime.router import Router
from kvemu.runtime.transport import RouterEnd, RouterHandler

__all__ = ["PoolGate", "WRONG_WORKER_TYPE"]

WRONG_WORKER_TYPE = "wrong_worker_type"
"""How a refusal for a type no hosted pool takes begins."""


class _PoolEnd:
    """One pool router's end: its handler is called for its workers' messages; sends go out on the shared socket."""

    def __init__(self, send: Callable[[bytes, msgspec.Struct], None]) -> None:
        self._send = send
        self.handler: RouterHandler | None = None
        self._closed = anyio.Event()

    async def serve(self, handler: RouterHandler) -> None:
        self.handler = handler
        try:
            await self._closed.wait()
        finally:
            if self.handler is handler:
                self.handler = None

    def send_nowait(self, peer: bytes, msg: msgspec.Struct) -> None:
        self._send(peer, msg)

    async def aclose(self) -> None:
        self._closed.set()


class PoolGate:
    """Splits a shared router end's worker traffic among pool routers (see the module doc).

    ``pools`` maps each worker type the process takes to its pool; ``routers`` returns the current router
    of each pool (a restarted router replaces its pool's entry and serves the same ``end(pool)``).
    """

    def __init__(self, shared: RouterEnd, pools: dict[str, str], routers: Callable[[], dict[str, Router]]) -> None:
        self._shared = shared
        self.pools = pools
        self._routers = routers
        send = shared.send_nowait
        self._ends = {pool: _PoolEnd(send) for pool in dict.fromkeys(pools.values())}
        self.refused = 0
        """Registrations refused here (a worker type no hosted pool takes)."""

    def end(self, pool: str) -> _PoolEnd:
        """The end a pool's router serves."""
        return self._ends[pool]

    async def serve(self) -> None:
        """Deliver the shared end's worker messages until it closes (or the caller is cancelled)."""
        await self._shared.serve(self.on_message)

    def on_message(self, peer: bytes, msg: WorkerMessage) -> None:
        """Route one worker message to its pool's router (or refuse a registration no pool takes)."""
        routers = self._routers()
        pool = next((p for p, r in routers.items() if r.serves_peer(peer)), None)
        if pool is None and type(msg) is Register:
            pool = self.pools.get(msg.worker_type)
            if pool is None:
                self.refused += 1
                self._shared.send_nowait(peer, RegisterAck(
                    worker_id=msg.worker_id, accepted=False, reason=self.refusal(msg)))
                return
        handler = self._ends[pool or next(iter(self._ends))].handler
        if handler is not None:
            handler(peer, msg)

    def refusal(self, msg: Register) -> str:
        """Why a registration of a type no hosted pool takes is refused, and what to do."""
        types = list(self.pools)
        if len(types) > 1:
            fix = "start it with " + " or ".join(f"--worker-type {t}" for t in types)
            hosted = f"the {' and '.join(types)} pools of a disaggregated cluster"
        else:
            fix = "start it with this router's scenario (and no --worker-type)"
            hosted = f"an aggregated cluster of {types[0]} workers"
        return (f"{WRONG_WORKER_TYPE}: worker {msg.worker_id} registers as a {msg.worker_type} worker, but this "
                f"router hosts {hosted}: {fix}")

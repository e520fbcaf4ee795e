"""A worker's link to several router replicas, seen by the worker as one link (``ReplicaEnds``).

Every replica is a full router that registers the worker, watches its heartbeats and dispatches to it. The
worker actor keeps talking to one ``WorkerEnd``; this end fans its messages out and routes the answers:

* ``Register``, ``Heartbeat``, ``Draining``, ``RankDown``, ``Deregister`` and ``KvBatch`` go to every replica.
* A request's messages (``DispatchAck``, ``TokenBatch``, ``Finished``, ``RequestFailed``, ``KvPulled``) go to the
  replica that dispatched it, and only that replica may abort it or release its held KV: a message about a
  request is accepted only from the replica it belongs to (others are counted in ``foreign`` and dropped).
* Registration is per replica. The actor hears the first acceptance; a replica that refuses later, or asks
  again (``Reregister``), is answered by this end alone: it sends the worker's last ``Register`` again, after
  the retry time a rate-limited refusal gives. A permanent refusal by one replica leaves the others serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from kvemu.messages import (
    Abort,
    Dispatch,
    DispatchAck,
    Finished,
    Heartbeat,
    KvPulled,
    Register,
    RegisterAck,
    Reregister,
    ReleaseKv,
    RequestFailed,
    RouterMessage,
    TokenBatch,
)
from kvemu.runtime.transport import WorkerEnd, WorkerHandler

__all__ = ["ReplicaEnds"]

log = logging.getLogger("kvemu.replica_link")

_PER_REQUEST = (DispatchAck, TokenBatch, Finished, RequestFailed, KvPulled)
_PENDING, _ACCEPTED, _REFUSED = range(3)
MAX_RETRY_S = 60.0
"""The longest a rate-limited refusal makes this end wait before registering with that replica again."""


class ReplicaEnds:
    """One ``WorkerEnd`` over one end per router replica (index = replica)."""

    def __init__(self, ends: list[WorkerEnd], now_ns: Callable[[], int] | None = None,
                 heartbeat_interval_ns: int = 0) -> None:
        if not ends:
            raise ValueError("ReplicaEnds needs at least one end")
        self.ends = ends
        self._now = now_ns
        self._beat = heartbeat_interval_ns
        self._sent = [0] * len(ends)  # when each replica last heard from this worker
        self._oldest = 0  # min(self._sent): no replica can be owed a heartbeat before _oldest + _beat
        self.owner: dict[str, int] = {}
        """Open requests: the replica that dispatched each."""
        self.held: dict[str, int] = {}
        """Prefill legs whose KV this worker holds: the replica that may release it."""
        self.foreign = 0
        """Messages about a request that came from a replica it does not belong to (dropped)."""
        self.state = [_PENDING] * len(ends)
        self._register: Register | None = None
        self._acked = False
        self._handler: WorkerHandler | None = None
        self._tg: Any = None

    # ------------------------------------------------------------------ from the worker

    def send_nowait(self, msg: msgspec.Struct) -> None:
        """Fan a worker message out, or route a request's message to the replica that dispatched it."""
        t = type(msg)
        if t in _PER_REQUEST:
            rid: str = msg.request_id  # type: ignore[attr-defined]
            i = self.owner.get(rid)
            if i is None:
                return  # (an aborted request's late words: nobody is waiting for them)
            if self._now is not None:
                self._keep_alive(i)
            if t is Finished:
                del self.owner[rid]  # (a prefill leg's KV stays held: ``held``)
            elif t is RequestFailed or (t is DispatchAck and not msg.accepted):  # type: ignore[attr-defined]
                del self.owner[rid]
                self.held.pop(rid, None)
            self.ends[i].send_nowait(msg)
            return
        if t is Register:
            self._register = msg  # type: ignore[assignment]
            for i, end in enumerate(self.ends):
                if self.state[i] != _ACCEPTED:
                    end.send_nowait(msg)
            return
        for end in self.ends:
            end.send_nowait(msg)
        if self._now is not None:
            self._sent = [self._now()] * len(self.ends)
            self._oldest = self._sent[0]

    def _keep_alive(self, i: int) -> None:
        """A busy worker sends its owner's replica request messages, which prove it alive there, and no heartbeat
        (``WorkerActor`` beats only when silent): every other replica that heard nothing for an interval gets one."""
        assert self._now is not None
        now = self._now()
        sent = self._sent
        sent[i] = now
        if not self._beat or now - self._oldest < self._beat or self._register is None:
            return
        beat = Heartbeat(worker_id=self._register.worker_id)
        for j, end in enumerate(self.ends):
            if now - sent[j] >= self._beat and self.state[j] == _ACCEPTED:
                end.send_nowait(beat)
                sent[j] = now
        self._oldest = min(sent)

    # ------------------------------------------------------------------ from the replicas

    def bind(self, handler: WorkerHandler) -> None:
        """Hand the worker's messages to ``handler`` (``serve`` does it; ``receive`` needs it)."""
        self._handler = handler

    async def serve(self, handler: WorkerHandler) -> None:
        """Serve every replica's end, handing the worker what is its business."""
        self.bind(handler)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for i, end in enumerate(self.ends):
                tg.start_soon(end.serve, self._from(i))

    def _from(self, i: int) -> WorkerHandler:
        def handle(msg: RouterMessage) -> None:
            self.receive(i, msg)

        return handle

    def receive(self, i: int, msg: RouterMessage) -> None:
        """One message from replica ``i``: keep the registration per replica, accept a request's messages only
        from its replica."""
        handler = self._handler
        assert handler is not None
        t = type(msg)
        if t is Dispatch:
            rid = msg.request_id  # type: ignore[union-attr]
            hold = msg.kv_hold  # type: ignore[union-attr]
            if rid in self.owner or (hold and rid in self.held):  # (maybe another replica's: refused here, so
                # that the refusal reaches the replica that sent it and the running request keeps its owner)
                self.ends[i].send_nowait(DispatchAck(request_id=rid, accepted=False, reason=(
                    f"duplicate_request_id: {rid!r} is already running on this worker")))
                return
            self.owner[rid] = i
            if hold:
                self.held[rid] = i
            handler(msg)
        elif t is Abort or t is ReleaseKv:
            rid = msg.request_id  # type: ignore[union-attr]
            owner = self.owner.get(rid) if t is Abort else None
            if owner is None:
                owner = self.held.get(rid)
            if owner != i:
                self.foreign += 1
                return
            if t is Abort:
                self.owner.pop(rid, None)
            self.held.pop(rid, None)
            handler(msg)
        elif t is RegisterAck:
            self._ack(i, msg)  # type: ignore[arg-type]
        elif t is Reregister:
            self.state[i] = _PENDING
            if self._register is not None:
                self.ends[i].send_nowait(self._register)
        else:
            handler(msg)

    def _ack(self, i: int, msg: RegisterAck) -> None:
        handler = self._handler
        assert handler is not None
        if msg.accepted:
            self.state[i] = _ACCEPTED
            if not self._acked:
                self._acked = True
                handler(msg)
            return
        if not self._acked:  # the worker is registered nowhere yet: its own retry (or refusal) applies
            if msg.retry_after_s is None:
                self.state[i] = _REFUSED
                if all(s == _REFUSED for s in self.state):
                    handler(msg)
            else:
                handler(msg)
            return
        if msg.retry_after_s is None:
            self.state[i] = _REFUSED
            log.warning("router replica %d refused worker %s: %s (the other replicas still route to it)", i,
                        msg.worker_id, msg.reason)
            return
        if self._tg is not None:
            self._tg.start_soon(self._retry, i, min(max(msg.retry_after_s, 0.0), MAX_RETRY_S))

    async def _retry(self, i: int, delay_s: float) -> None:
        await anyio.sleep(delay_s)
        if self.state[i] != _ACCEPTED and self._register is not None:
            self.ends[i].send_nowait(self._register)

    async def aclose(self) -> None:
        for end in self.ends:
            await end.aclose()

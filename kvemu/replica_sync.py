"""Router replicas share their bookings (``router.replica_sync``), as Dynamo's ``router_replica_sync`` does.

Each replica keeps its own prefix index (fed by the same KV events) and its own load view. With sync on, a
replica announces what changes its load view, and every other replica applies it to its own:

* ``SyncBook``: a request booked on a rank (its prompt blocks and the prefill tokens it costs there);
* ``SyncPrefillDone``: its first token arrived (its prefill no longer loads the rank);
* ``SyncFree``: it ended.

Optionally (``predictions``, off by default) a booking also carries the prompt's block hashes, and a replica that
routes without KV events (approximate index) inserts them into its index as if it had routed the prompt itself:
SGLang's gateway mesh syncs its prefix-tree inserts so; Dynamo shares no predicted entries.

As in Dynamo: output-block growth stays local; nothing of the prefix index or of session affinity is shared;
events carry no time (the receiver books at receive time); a replica skips its own; an event about a request the
receiver does not know changes nothing; there is no snapshot (a restarted replica starts with an empty view and
hears only what is announced after); a peer's booking whose ``SyncFree`` never came (its replica died) expires
after ``PEER_BOOKING_TTL_NS``. Announcements leave in batches (``SyncBatch``): the first event of a batch opens it,
and the transport delivers it, whole and in order, after the configured delay.

Sans-IO: ``SyncOutbox`` collects one replica's announcements (``RoutingCore.load_listener``), ``SyncInbox`` applies
peers' batches to one replica's load tracker, told the time.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvemu.approx import ApproxIndex
from kvemu.clock import NS_PER_S
from kvemu.index import WorkerKey
from kvemu.limits import U64, Key
from kvemu.load import LoadTracker

__all__ = ["SyncBook", "SyncPrefillDone", "SyncFree", "SyncEvent", "SyncBatch", "SyncOutbox", "SyncInbox",
           "attach_core", "frees_load", "PEER_BOOKING_TTL_NS", "MAX_SYNC_BATCH_EVENTS", "MAX_REPLICAS"]

MAX_REPLICAS = 64
"""Most router replicas one cluster runs (``router.replicas``)."""
MAX_SYNC_BATCH_EVENTS = 4096
"""Most events one batch may carry (a bigger one is refused whole at decoding)."""
MAX_PROMPT_BLOCKS = 1 << 20
"""Most blocks one booking names (a 4M-token prompt in 4-token blocks)."""
PEER_BOOKING_TTL_NS = 300 * NS_PER_S
"""A peer's booking is forgotten this long after it arrived if its ``SyncFree`` never came (Dynamo's default
active-request expiry)."""

_Id = Key
_Int = Annotated[int, Meta(ge=0, le=1 << 31)]
_U64 = U64


class SyncBook(msgspec.Struct, tag="book", frozen=True, forbid_unknown_fields=True, array_like=True):
    """A replica booked a request on a rank."""

    request_id: _Id
    worker_id: _Int
    dp_rank: _Int
    blocks: Annotated[list[_U64], Meta(max_length=MAX_PROMPT_BLOCKS)]
    """The prompt blocks it holds there (the sequence hashes, or the booking's own ids without assumed reuse)."""
    prefill_tokens: _Int
    local_hashes: Annotated[list[_U64], Meta(max_length=MAX_PROMPT_BLOCKS)] = []
    """With ``predictions``: the prompt's block hashes, for the receiver's approximate prefix index."""
    seq_hashes: Annotated[list[_U64], Meta(max_length=MAX_PROMPT_BLOCKS)] = []


class SyncPrefillDone(msgspec.Struct, tag="prefill_done", frozen=True, forbid_unknown_fields=True, array_like=True):
    """The request's first token arrived."""

    request_id: _Id


class SyncFree(msgspec.Struct, tag="free", frozen=True, forbid_unknown_fields=True, array_like=True):
    """The request ended (completed, failed, or left the rank)."""

    request_id: _Id


SyncEvent = SyncBook | SyncPrefillDone | SyncFree


class SyncBatch(msgspec.Struct, tag="sync_batch", frozen=True, forbid_unknown_fields=True):
    """Announcements of one replica, in the order they happened."""

    origin: Annotated[int, Meta(ge=0, lt=MAX_REPLICAS)]
    events: Annotated[list[SyncEvent], Meta(max_length=MAX_SYNC_BATCH_EVENTS)]


class SyncOutbox:
    """One replica's announcements; the routing core tells it (``RoutingCore.load_listener``)."""

    __slots__ = ("origin", "events", "on_open", "sent", "predictions")

    def __init__(self, origin: int, predictions: bool = False) -> None:
        self.origin = origin
        self.predictions = predictions
        """Bookings carry the prompt's hashes (peers without KV events insert them into their approximate index)."""
        self.events: list[SyncEvent] = []
        self.on_open: object = None
        """Called with no argument when an event opens a new batch (the transport schedules its delivery)."""
        self.sent = 0
        """Events announced so far."""

    def _add(self, event: SyncEvent) -> None:
        events = self.events
        events.append(event)
        self.sent += 1
        if len(events) == 1 and callable(self.on_open):
            self.on_open()

    def booked(self, request_id: str, key: WorkerKey, blocks: list[int], prefill_tokens: int,
               local_hashes: list[int], seq_hashes: list[int]) -> None:
        """The core booked ``request_id`` on ``key``."""
        if self.predictions:
            self._add(SyncBook(request_id, key[0], key[1], blocks, prefill_tokens, local_hashes, seq_hashes))
        else:
            self._add(SyncBook(request_id, key[0], key[1], blocks, prefill_tokens))

    def prefill_done(self, request_id: str) -> None:
        """The core dropped the request's prefill load."""
        self._add(SyncPrefillDone(request_id))

    def freed(self, request_id: str) -> None:
        """The core freed the request's booking."""
        self._add(SyncFree(request_id))

    def take(self) -> SyncBatch | None:
        """The open batch, closed (None: nothing announced since the last)."""
        if not self.events:
            return None
        batch = SyncBatch(self.origin, self.events)
        self.events = []
        return batch


class SyncInbox:
    """Applies peers' batches to one replica's load tracker (bookings as its own, keyed apart from them)."""

    __slots__ = ("replica", "load", "approx", "applied", "ignored", "refused", "expired", "_arrivals")

    def __init__(self, replica: int, load: LoadTracker, approx: ApproxIndex | None = None) -> None:
        self.replica = replica
        self.load = load
        self.approx = approx
        """A router without KV events: where a peer's booked prompt is inserted when the booking carries it."""
        self.applied = 0
        """Events that changed this replica's view."""
        self.ignored = 0
        """Events about requests this replica does not know (their booking never arrived, or expired)."""
        self.refused = 0
        """Bookings refused (the id is booked already)."""
        self.expired = 0
        """Peer bookings forgotten after ``PEER_BOOKING_TTL_NS`` without their ``SyncFree``."""
        self._arrivals: deque[tuple[int, str]] = deque()  # (arrival, key) of peer bookings, in arrival order

    def apply(self, batch: SyncBatch, now_ns: int) -> None:
        """Apply a peer's batch now (this replica's own is skipped)."""
        if batch.origin == self.replica:
            return
        self._expire(now_ns)
        load = self.load
        prefix = f"\x00{batch.origin}\x00"  # (a request id may not start with a NUL: peers' keys stay apart)
        for ev in batch.events:
            rid = prefix + ev.request_id
            if type(ev) is SyncBook:
                if rid in load:
                    self.refused += 1
                    continue
                load.add(rid, (ev.worker_id, ev.dp_rank), ev.blocks, ev.prefill_tokens, now_ns=now_ns)
                if self.approx is not None and ev.seq_hashes and len(ev.seq_hashes) == len(ev.local_hashes):
                    self.approx.record(ev.worker_id, ev.dp_rank, ev.local_hashes, ev.seq_hashes)
                self._arrivals.append((now_ns, rid))
                self.applied += 1
            elif type(ev) is SyncPrefillDone:
                if load.mark_prefill_completed(rid):
                    self.applied += 1
                else:
                    self.ignored += 1
            elif load.free(rid) is not None:
                self.applied += 1
            else:
                self.ignored += 1

    def _expire(self, now_ns: int) -> None:
        arrivals, load = self._arrivals, self.load
        while arrivals and arrivals[0][0] + PEER_BOOKING_TTL_NS <= now_ns:
            at, rid = arrivals.popleft()
            if load.booked_ns(rid) == at:  # (a freed one is gone; a re-booked one has its own entry)
                load.free(rid)
                self.expired += 1


def attach_core(replica: int, core: Any, predictions: bool = False) -> tuple[SyncOutbox, SyncInbox]:
    """Connect a replica's routing core to sync: a new outbox, made the core's ``load_listener``, and a new inbox
    over its load view (and approximate index). A restarted replica gets new ones: it starts with an empty view."""
    outbox = SyncOutbox(replica, predictions)
    core.load_listener = outbox
    return outbox, SyncInbox(replica, core.load, core.approx)


def frees_load(batch: SyncBatch) -> bool:
    """Whether applying ``batch`` may take load off a rank (a prefill done, a free): the receiving replica's queue
    should then look again, as Dynamo's receiver wakes its queue."""
    return any(type(ev) is not SyncBook for ev in batch.events)

"""What kvemu's processes say to each other beyond the worker protocol: the client side of the router's socket.

One ROUTER socket on the router's ``--listen`` address serves both workers (2-frame messages:
identity, payload) and clients (3 frames: identity, ``b"C"``, payload). Clients send ``ClientRequest``s
and get back each request's ``kvemu.RequestRecord`` when it ends (``CancelRequest`` ends one early; after
``StreamTokens``, ``TokensReply``s as its output grows);
``StatsQuery`` returns the router's view (ranks, per-rank load and cache, KV-event and affinity counters); a
``Control`` message (``send_control``) injects a chaos event. Every process logs one JSON line when it starts
(``log_start``), with its endpoints.
"""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Any, TypeVar

import msgspec
import zmq
from msgspec import Meta

from kvemu.http import DEFAULT_MODEL
from kvemu.http.admission import AdmissionLimits
from kvemu.limits import MAX_LIST_ITEMS, MAX_REQUEST_ID_CHARS, I64, Count, Name, Rank, RequestId, TimeNs, WorkerId
from kvemu.records import RequestRecord
from kvemu.messages import MAX_OUTPUT_TOKENS, MAX_RANKS, ClientRequest, Register, encode
from kvemu.wire import security

from harness.chaos import Control, ControlReply, SyncPeers, WorkerExited
from harness.report.recorder import WorkerEvent
from harness.report.run_data import Sample
from harness.scenario import ChaosEvent


CLIENT = b"C"


_Counters = Annotated[dict[Name, I64], Meta(max_length=MAX_LIST_ITEMS)]
"""Counters by name."""
_T = TypeVar("_T")
_Many = Annotated[list[_T], Meta(max_length=MAX_RANKS * 16)]
"""A list of the router's view: one item per worker or rank at most."""


class StatsQuery(msgspec.Struct, tag=True, frozen=True):
    """Ask the router for its current view."""

    publishers: bool = False
    """Also say where the workers publish their KV events (``Stats.publishers``)."""
    settle: bool = False
    """First take in every KV batch already waiting on the router's sockets: a run's final view, asked once its
    last request ended, counts its last passes' events (a worker publishes a pass's batch before its results)."""


class Stats(msgspec.Struct, tag=True, kw_only=True):
    """The router's view: ranks, per-rank load/cache, counters (one reply to ``StatsQuery``)."""

    now_ns: TimeNs
    workers: _Many[WorkerId]
    ranks: _Many[tuple[WorkerId, Rank]]
    samples: _Many[Sample]
    kv_stats: Annotated[dict[WorkerId, _Counters], Meta(max_length=MAX_LIST_ITEMS)]
    affinity: _Counters | None = None
    counters: _Counters = {}
    worker_events: _Many[WorkerEvent] = []
    router_id: Name = ""
    """Changes when the router restarts (a new process, or chaos ``restart_router``): a client's requests
    sent before ``router_started_ns`` and never answered were lost with the old one."""
    router_started_ns: TimeNs = 0
    process_id: Name = ""
    """Changes only when the router process is replaced (its counters then start again from zero)."""
    records_held: Count = 0
    """Request records the router process still keeps (those of requests still open): a leak shows here."""
    pools: Annotated[dict[Name, _Many[WorkerId]], Meta(max_length=64)] = {}
    """The workers registered with each pool's router: ``aggregated``, or ``prefill`` and ``decode``."""
    replica: Rank = 0
    """Which router replica answered (``router.replicas``)."""
    sync: _Counters | None = None
    """Its replica sync's counters (``ZmqSyncLink.stats``), or None: sync is off."""
    feed_dropped: Count = 0
    bad_client_messages: Count = 0
    """Client messages refused while decoding (malformed, or a field past its bound): the first is logged."""
    """KV batches chaos made this replica's own feed lose (``drop_kv_events`` naming the replica)."""
    publishers: _Many[Register] = []
    """Asked for (``StatsQuery.publishers``): the registrations of the workers whose KV events the router follows
    (the aggregated pool, or the prefill pool), as they came; the load generator's truth oracle subscribes to them."""


class RecordReply(msgspec.Struct, tag=True, kw_only=True):
    """A finished request's record, as the router's hook recorder built it."""

    record: RequestRecord


class CancelRequest(msgspec.Struct, tag=True, frozen=True):
    """End one of this client's open requests now: the router frees it and tells its worker to abort it; its
    record comes back as any request's, failed with ``reason``. Unknown or ended: nothing happens."""

    request_id: RequestId
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z_]+$")] = "cancelled"


class StreamTokens(msgspec.Struct, tag=True, frozen=True):
    """From now on, tell this client whenever one of its requests has more output tokens (``TokensReply``), as an
    OpenAI front door in another process needs to stream them (``kvemu front``). Sent once per connection;
    other clients get records only."""


class TokensReply(msgspec.Struct, tag=True, frozen=True):
    """``n`` more output tokens of one of this client's open requests (only to a client that sent
    ``StreamTokens``); its ``RecordReply`` follows when it ends."""

    request_id: RequestId
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_OUTPUT_TOKENS)]


ClientMessage = ClientRequest | StatsQuery | Control | WorkerExited | CancelRequest | SyncPeers | StreamTokens
ReplyMessage = RecordReply | Stats | ControlReply | TokensReply
MAX_STREAMING_CLIENTS = 64
"""Clients a router process streams tokens to (``StreamTokens``); a new one past that replaces the oldest."""
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)


MAX_CLIENT_ID_CHARS = MAX_REQUEST_ID_CHARS
"""The longest request id a refusal of a malformed client message echoes back (a longer one is refused by
``ClientRequest``'s own bound, and echoing it would only send the client its own junk back)."""


class _Head(msgspec.Struct):
    """What a malformed client message is read for: its type and request id (every other field skipped)."""

    type: Name = ""
    request_id: RequestId = ""
    """(Longer than a ``ClientRequest`` may carry: nothing to answer, the message is dropped, counted.)"""


_head_decoder = msgspec.msgpack.Decoder(_Head)


LANE_FRAME_BYTES = 1 << 20
"""A client message this large (a prompt of ~250k+ ids) is decoded in the router's prompt lane, not at once."""


def malformed_reply(data: bytes, exc: Exception, now_ns: int) -> RecordReply | ControlReply | None:
    """The answer to a client message that did not decode, when it can be attributed: a ``ClientRequest`` whose
    ``request_id`` can be read gets its record failed with ``invalid_request`` naming what was wrong, a
    ``Control`` a refusal (control answers go back in order); anything else None (nobody to answer)."""
    try:  # only the message's type and id: the rest (a prompt past the bound, say) is skipped, not built
        head = _head_decoder.decode(data)
    except Exception:  # noqa: BLE001 - not a msgpack map with a str type and id (or nested past the depth)
        return None
    why = str(exc)[:300]
    if head.type == "ClientRequest":
        rid = head.request_id
        if 0 < len(rid) <= MAX_CLIENT_ID_CHARS:
            return RecordReply(record=RequestRecord(request_id=rid, arrival_ns=now_ns,
                                                    failure=f"invalid_request: malformed ClientRequest: {why}"))
    elif head.type in ("Control", "SyncPeers"):
        return ControlReply(ok=False, detail=f"malformed control message: {why}")
    return None


def log_start(role: str, **endpoints: Any) -> None:
    """The one structured line every process prints when it starts."""
    print(json.dumps({"event": "started", "role": role, "pid": os.getpid(), **endpoints}), flush=True)


def send_control(router: str, token: str, event: ChaosEvent | WorkerExited | SyncPeers,
                 timeout_s: float = 10.0) -> ControlReply:
    """Send one chaos event (or a worker's exit, or a replica's sync peers) to a router process's control channel
    and wait for its answer (blocking)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a router that refused the handshake (a different KVEMU_SECRET) leaves no peer to queue for: without a
    # send timeout, the send would wait for one forever
    sock.setsockopt(zmq.SNDTIMEO, max(1, round(timeout_s * 1000)))
    security.connect_securely(sock)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(router)
        msg = event if isinstance(event, (WorkerExited, SyncPeers)) else Control(token=token, event=event)
        try:
            sock.send_multipart([CLIENT, encode(msg)])
        except zmq.Again:
            return ControlReply(ok=False, detail=f"no answer from the router within {timeout_s:g} s")
        while (left := deadline - time.monotonic()) > 0 and sock.poll(round(left * 1000)):
            frames = sock.recv_multipart()
            if len(frames) == 2 and frames[0] == CLIENT:
                try:
                    reply = reply_decoder.decode(frames[1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if type(reply) is ControlReply:
                    return reply
        return ControlReply(ok=False, detail=f"no answer from the router within {timeout_s:g} s")
    finally:
        sock.close(linger=0)


def client_request_key(peer: bytes, request_id: str) -> str:
    """The router's id for a client's request: the client's connection identity, then its own id."""
    return f"{peer.hex()}/{request_id}"


class HttpOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Where a process serves HTTP, and how (``--http``, ``--tokenizer``, ``--model``)."""

    listen: str
    tokenizer: str | None = None
    model: str = DEFAULT_MODEL
    server: str = "uvicorn"
    """``uvicorn`` or ``granian`` (``--http-server``)."""
    admission: AdmissionLimits = AdmissionLimits()
    """Generation requests served and queued at once (``--max-running``, ``--max-waiting``)."""


def never_ran_record(req: ClientRequest, arrival_ns: int, failure: str | None = None) -> RequestRecord:
    """The record of a request that never ran: refused at the gateway, or never answered."""
    return RequestRecord(request_id=req.request_id, session_id=req.session_id, parent_session_id=req.parent_session_id,
                         arrival_ns=arrival_ns, isl=len(req.tokens), max_tokens=req.max_tokens, failure=failure)

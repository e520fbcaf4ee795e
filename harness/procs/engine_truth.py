"""What a worker's engines really did, per request and per rank, served at ``/kvemu/requests`` and
``/kvemu/load``.

A router's own metrics say what it *predicted*; these say what the engine found (cached tokens, the rank
that served, preemptions, queue time), so a load generator in front of any router can judge it by the
engines (``kvemu loadgen --http ... --fleet``). Times are ``CLOCK_MONOTONIC`` nanoseconds, one clock for
every process of this machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any
from urllib.parse import parse_qs

import msgspec
from msgspec import Meta

from kvemu.http.asgi import Receive, Routes, Scope, Send
from kvemu.http.errors import ApiError
from kvemu.http.reply import respond
from kvemu.limits import Count, TimeNs
from kvemu.records import EngineRecord, RequestRecord

__all__ = ["EngineTruth", "LoadSample", "TruthPage", "LoadPage"]

MAX_PAGE = 10_000
"""Most records (or samples) one answer carries; ``after`` pages on."""


class LoadSample(msgspec.Struct, array_like=True):
    """One rank's load at one instant."""

    t_ns: int
    worker_id: int
    dp_rank: int
    running: int
    waiting: int
    kv_usage: float


class TruthPage(msgspec.Struct):
    """An answer of ``/kvemu/requests``: records ``after``.. ``next`` - 1 (a client asks again from ``next``)."""

    records: Annotated[list[RequestRecord], Meta(max_length=MAX_PAGE)]
    """Each request as its engine saw it: the engine's own record without its token times (the rank that
    served, ``arrival_ns`` at this worker, its ``engine`` facts (admission, cached tokens, preemptions), a decode
    leg's ``kv_reserved_ns``/``kv_activated_ns``, its failure)."""
    next: Count
    dropped: Count
    """Records no longer kept (past ``max_records``): a client that asks too late misses them, and is told."""
    first_arrival_ns: TimeNs | None = None
    """When the first request reached this worker (None: none yet)."""


class Unsettled(msgspec.Struct):
    """An answer of ``/kvemu/unsettled``: what the worker's engines still work for now."""

    requests: Count
    """Requests unfinished, holding KV for a decode rank, or being offloaded to host memory (0: settled)."""


class LoadPage(msgspec.Struct):
    """An answer of ``/kvemu/load``."""

    samples: list[LoadSample]
    next: int
    dropped: int


class _Log:
    """A bounded log numbered from 0: the oldest entries go first, and how many went is counted.

    A ring over a list: entry ``i`` sits at ``i % bound``, so a page is at most two slices, O(page) wherever
    it starts (a deque indexes in O(distance from its ends))."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.items: list[Any] = []
        self.total = 0

    def add(self, item: Any) -> None:
        if len(self.items) < self.bound:
            self.items.append(item)
        else:
            self.items[self.total % self.bound] = item
        self.total += 1

    def page(self, after: int, limit: int) -> tuple[list[Any], int, int]:
        dropped = self.total - len(self.items)
        start = max(after, dropped)
        end = min(self.total, start + limit)
        if start >= end:
            return [], end, dropped
        lo, hi = start % self.bound, (end - 1) % self.bound + 1
        items = self.items
        return (items[lo:hi] if lo < hi else items[lo:] + items[:hi]), end, dropped


class EngineTruth:
    """Per-request facts and per-rank load samples of one worker, bounded in memory."""

    def __init__(self, worker_id: int, *, max_records: int = 1_000_000, max_samples: int = 1_000_000) -> None:
        self.worker_id = worker_id
        self._records = _Log(max_records)
        self._samples = _Log(max_samples)
        self.first_arrival_ns: int | None = None
        """When the first request reached this worker (a fleet's chaos timeline counts from the first of all)."""

    def arrived(self, now_ns: int) -> None:
        """A request reached this worker."""
        if self.first_arrival_ns is None:
            self.first_arrival_ns = now_ns

    def ended(self, rec: EngineRecord | RequestRecord, reason: str = "length") -> None:
        """A request ended on this worker's engine (the engine's record, or the router's in one process;
        ``reason``: vLLM's finish reason, ``length``, or ``abort`` for one cancelled or lost with its rank)."""
        self._records.add(RequestRecord(
            request_id=rec.request_id, arrival_ns=rec.arrival_ns, isl=rec.isl, max_tokens=rec.max_tokens,
            worker_id=self.worker_id if rec.worker_id is None else rec.worker_id, dp_rank=rec.dp_rank,
            engine=rec.engine, first_token_ns=rec.first_token_ns, output_tokens=rec.output_tokens,
            completion_ns=rec.completion_ns, kv_reserved_ns=rec.kv_reserved_ns, kv_activated_ns=rec.kv_activated_ns,
            failure=rec.failure or (None if reason != "abort" else "aborted")))

    def sample(self, now_ns: int, cores: Sequence[Any], dead: Callable[[int], bool],
               worker_id: int | None = None) -> None:
        """Each live rank's load now (running, waiting, KV usage), of this worker (or of ``worker_id``)."""
        wid = self.worker_id if worker_id is None else worker_id
        for core in cores:
            if not dead(core.dp_rank):
                self._samples.add(LoadSample(now_ns, wid, core.dp_rank, core.num_running, core.num_waiting,
                                             round(core.kv_usage, 4)))

    def records_page(self, after: int = 0, limit: int = MAX_PAGE) -> TruthPage:
        """Records from number ``after`` on."""
        return TruthPage(*self._records.page(after, limit), first_arrival_ns=self.first_arrival_ns)

    def load_page(self, after: int = 0, limit: int = MAX_PAGE) -> LoadPage:
        """Load samples from number ``after`` on."""
        return LoadPage(*self._samples.page(after, limit))

    def routes(self) -> Routes:
        """The HTTP routes serving them (``GET /kvemu/requests?after=N``, ``GET /kvemu/load?after=N``)."""

        async def requests(scope: Scope, receive: Receive, send: Send) -> None:
            await respond(send, 200, msgspec.json.encode(self.records_page(*_paging(scope))))

        async def load(scope: Scope, receive: Receive, send: Send) -> None:
            await respond(send, 200, msgspec.json.encode(self.load_page(*_paging(scope))))

        return {("GET", "/kvemu/requests"): requests, ("GET", "/kvemu/load"): load}


def _paging(scope: Scope) -> tuple[int, int]:
    """``after`` and ``limit`` from the query string (400 naming the parameter when not a small integer)."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    out = []
    for name, default in (("after", 0), ("limit", MAX_PAGE)):
        raw = query.get(name, [str(default)])[-1]
        if not raw.isdigit() or len(raw) > 12:
            raise ApiError(400, f"{name}: a non-negative integer, not {raw[:32]!r}", name)
        out.append(int(raw))
    return out[0], max(1, min(out[1], MAX_PAGE))

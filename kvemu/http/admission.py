"""Admission of generation requests to one OpenAI server: at most ``max_running`` at once, a bounded queue
behind them, and a 429 (queue full) or 503 (waited too long) with ``Retry-After`` past that, as vLLM's
``--max-num-seqs`` queue and API gateways answer.

Fairness: a request asking for more than ``long_tokens`` output tokens is *long*; long requests hold at most
``long_share`` of the running slots, so a burst of long streams always leaves slots for short requests, and a
freed slot goes to the oldest waiting short request before any long one. A short request therefore waits for
at most the short requests ahead of it, never for hundreds of long streams started at once. When the server
knows the KV cache of the engines behind it (``kv_tokens``), long requests also reserve at most ``long_share``
of it (their whole ``max_tokens``, counted up front as TGI's ``max_batch_total_tokens`` does), so long streams
never fill the engines' KV, where an admitted short request would wait in the engine's queue until one ended.
Routes other than generation (``/metrics``, ``/health``) never pass here.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Iterator
from typing import Annotated

import msgspec
from msgspec import Meta
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvemu.http.errors import ApiError

__all__ = ["AdmissionLimits", "Admission", "Refused", "QUEUE_FULL", "QUEUE_TIMEOUT"]

log = logging.getLogger("kvemu.http")

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"


class AdmissionLimits(msgspec.Struct, frozen=True, kw_only=True):
    """How many generation requests one server runs and queues (defaults keep a 2-core, 24 GiB machine
    serving: each running request holds its prompt and output plan, O(its tokens), in every process)."""

    max_running: Annotated[int, Meta(ge=1, le=65_536)] = 256
    """Generation requests served at once (each HTTP request counts once, whatever its prompts)."""
    max_waiting: Annotated[int, Meta(ge=0, le=65_536)] = 256
    """Requests waiting for a slot; one more is refused at once with 429."""
    max_wait_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    """A waiting request gets a slot within this or is refused with 503."""
    long_tokens: Annotated[int, Meta(ge=1, le=1 << 30)] = 1024
    """A request asking for more output tokens than this (its prompts together) is long."""
    long_share: Annotated[float, Meta(gt=0, le=1)] = 0.75
    """The most of ``max_running`` long requests may hold (at least one slot)."""
    max_output_tokens: Annotated[int, Meta(ge=1, le=1 << 32)] = 1 << 23
    """Output tokens the running requests may ask for together (a request alone always runs): every process
    on a request's path keeps its output plan, tens of bytes a token, so this bounds their memory whatever
    ``max_tokens`` each asks (8 Mi tokens: well under 1 GB per process)."""
    kv_tokens: Annotated[int, Meta(ge=1, le=1 << 48)] | None = None
    """The KV cache of the engines behind this server, in tokens (None: unknown): long requests together ask
    for at most ``long_share`` of it (a long request alone always runs). The front doors set it from the
    scenario's engines."""
    retry_after_s: Annotated[int, Meta(ge=1, le=3600)] = 1
    """What ``Retry-After`` says to a refused client."""

    @property
    def max_long(self) -> int:
        return max(1, int(self.max_running * self.long_share))

    @property
    def max_long_tokens(self) -> int | None:
        """The output tokens long requests may ask for together (None: no KV bound)."""
        return None if self.kv_tokens is None else max(1, int(self.kv_tokens * self.long_share))


class Refused(ApiError):
    """A request turned away by admission: its status carries a ``Retry-After``."""

    def __init__(self, status: int, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(status, message)
        self.reason = reason
        self.headers = [(b"content-type", b"application/json"), (b"retry-after", str(retry_after_s).encode())]


class Admission:
    """The slots of one server: ``enter`` before a generation runs, ``leave`` once it ended (exactly once per
    successful ``enter``). Also a Prometheus collector (running, waiting, refusals by reason)."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.running = 0
        self.long_running = 0
        self.tokens = 0
        """Output tokens the running requests asked for."""
        self.long_tokens = 0
        """Output tokens the running long requests asked for."""
        self.waiting = 0
        self.waiting_short = 0
        self._queue: list[tuple[bool, int, int, asyncio.Future[None]]] = []
        """Waiters by (long, arrival): short ones first, each class first come first served."""
        self._seq = itertools.count()
        self.refused: dict[str, int] = {QUEUE_FULL: 0, QUEUE_TIMEOUT: 0}

    def _fits(self, long: bool, tokens: int) -> bool:
        lim = self.limits
        if long and self.long_running:
            if self.long_running >= lim.max_long:
                return False
            kv = lim.max_long_tokens
            if kv is not None and self.long_tokens + tokens > kv:
                return False
        return (self.running < lim.max_running
                and (self.tokens + tokens <= lim.max_output_tokens or not self.running))

    def _take(self, long: bool, tokens: int) -> None:
        self.running += 1
        self.long_running += long
        self.tokens += tokens
        if long:
            self.long_tokens += tokens

    async def enter(self, long: bool, tokens: int, request_id: str) -> None:
        """Take a slot for a request asking ``tokens`` output tokens (waiting for one if the queue has room);
        ``Refused`` otherwise."""
        lim = self.limits
        ahead = self.waiting if long else self.waiting_short  # waiters a slot would go to first
        if not ahead and self._fits(long, tokens):
            self._take(long, tokens)
            return
        if self.waiting >= lim.max_waiting:
            raise self._refuse(429, QUEUE_FULL, request_id,
                               f"the server is at capacity: {self.running} requests running (at most "
                               f"{lim.max_running}, {lim.max_long} of them long{self._kv_note()}) and {self.waiting} "
                               f"waiting (at most "
                               f"{lim.max_waiting}); retry later")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (long, next(self._seq), tokens, fut))
        self._waiting(long, 1)
        try:
            async with asyncio.timeout(lim.max_wait_s):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():  # granted as it gave up: hand the slot on
                self.leave(long, tokens)
            else:  # (awaiting it, the timeout or the client's leaving cancelled it)
                fut.cancel()  # dropped from the queue when its turn comes
                self._waiting(long, -1)
            if isinstance(exc, TimeoutError):
                raise self._refuse(503, QUEUE_TIMEOUT, request_id,
                                   f"no slot freed within {lim.max_wait_s:g} s ({self.running} requests running, "
                                   f"{self.waiting} waiting); retry later") from None
            raise

    def _kv_note(self) -> str:
        kv = self.limits.max_long_tokens
        return "" if kv is None else f", asking for {kv} output tokens together at most, of {self.limits.kv_tokens} KV"

    def _waiting(self, long: bool, n: int) -> None:
        self.waiting += n
        if not long:
            self.waiting_short += n

    def leave(self, long: bool, tokens: int) -> None:
        """A generation ended: its slot goes to the first waiters it fits."""
        self.running -= 1
        self.long_running -= long
        self.tokens -= tokens
        if long:
            self.long_tokens -= tokens
        self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while queue and self.running < self.limits.max_running:
            long, _, tokens, fut = queue[0]
            if fut.done():  # gave up waiting
                heapq.heappop(queue)
                continue
            if not self._fits(long, tokens):  # first come first served within a class (a long waiter first
                return                        # means no short one waits)
            heapq.heappop(queue)
            self._waiting(long, -1)
            self._take(long, tokens)
            fut.set_result(None)

    def _refuse(self, status: int, reason: str, request_id: str, message: str) -> Refused:
        self.refused[reason] += 1
        n = self.refused[reason]
        if n <= 10 or n % 1000 == 0:  # a flood logs little (as the router's refused registrations); all are counted
            log.warning("refused %s (%s, %d so far): %s", request_id, reason, self.refused[reason], message)
        return Refused(status, message, reason, self.limits.retry_after_s)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Prometheus: slots in use, the queue, and refusals by reason."""
        g = GaugeMetricFamily("kvemu_admission_running", "Generation requests holding a slot", labels=["class"])
        g.add_metric(["long"], self.long_running)
        g.add_metric(["short"], self.running - self.long_running)
        yield g
        yield GaugeMetricFamily("kvemu_admission_waiting", "Generation requests waiting for a slot", value=self.waiting)
        yield GaugeMetricFamily("kvemu_admission_max_running", "Slots", value=self.limits.max_running)
        yield GaugeMetricFamily("kvemu_admission_output_tokens", "Output tokens the running requests asked for",
                                value=self.tokens)
        c = CounterMetricFamily("kvemu_admission_refused", "Generation requests refused by admission, by reason",
                                labels=["reason"])
        for reason, n in self.refused.items():
            c.add_metric([reason], n)
        yield c

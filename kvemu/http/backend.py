"""What the HTTP front end runs requests on: the router (the front door) or one worker's own engines.

A backend takes a ``ClientRequest`` with two callbacks: ``on_tokens(n)`` each time ``n`` more output tokens
exist, ``on_end(record)`` once, when the request completed or failed. ``cancel`` ends it at once (the client
went away): the router frees its load and binding and the engine its blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, overload

from kvemu.records import RequestRecord
from kvemu.hooks import HookEvent, Hooks, TokenTimes
from kvemu.messages import ClientRequest
from kvemu.replica_front import Front
from kvemu.runtime.router import Router

__all__ = ["Backend", "Handoff", "LastTokenTime", "RouterBackend", "OnTokens", "OnEnd", "keep_last_token_time"]

OnTokens = Callable[[int], None]
OnEnd = Callable[[RequestRecord], None]


class LastTokenTime(Sequence[int]):
    """The token times of a request whose client keeps none (an HTTP answer carries counts and the first and
    last times, never each token's): how many and the last, O(1) however long the stream, where a list grows
    8 to 40 bytes a token. Only the last time can be read; nothing may iterate it (a record replied to such a
    client is given an empty list first)."""

    __slots__ = ("n", "last")

    def __init__(self) -> None:
        self.n = 0
        self.last = 0

    def extend(self, times: Sequence[int]) -> None:
        if len(times):
            self.n += len(times)
            self.last = times[-1]

    def append(self, t: int) -> None:
        self.n += 1
        self.last = t

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, int) and self.n and i in (-1, self.n - 1):
            return self.last
        raise IndexError("only the last token time of this request is kept")

    def __iter__(self) -> Iterator[int]:
        raise TypeError("only the last token time of this request is kept")


def keep_last_token_time(record: RequestRecord) -> None:
    """Let ``record`` (a router's, just opened) keep only its last token time: its client keeps none."""
    if not len(record.token_times_ns):
        record.token_times_ns = LastTokenTime()  # type: ignore[assignment]


class Backend(Protocol):
    """Runs requests for the HTTP layer."""

    max_model_len: int
    """Prompt plus output tokens one request may hold."""
    block_size: int

    def submit(self, req: ClientRequest, on_tokens: OnTokens, on_end: OnEnd) -> None:
        """Start ``req``; ``on_end`` may be called before this returns (a request refused at once)."""
        ...

    def cancel(self, request_id: str, reason: str) -> None:
        """End an open request now; nothing more is reported for it."""
        ...

    def unavailable(self) -> str | None:
        """Why no request can be served now (``/health`` answers 503 with it), or None."""
        ...


class Handoff(Protocol):
    """A worker's part in disaggregated serving driven by another router over HTTP: what a leg's body
    (``kv_transfer_params``, SGLang's ``bootstrap_room``) makes of a request, and what a finished prefill leg
    answers with."""

    async def leg(self, req: ClientRequest, body: Any) -> ClientRequest:
        """``req`` as this worker runs it (a prefill leg that holds its KV, a decode leg that pulls it); an
        ``ApiError`` naming the field when the body's leg does not fit this worker."""
        ...

    def answer(self, request_id: str) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a finished prefill leg's answer carries (None: none)."""
        ...


class RouterBackend:
    """The front door: requests go through the router, tokens come back through its hooks.

    ``router`` is a callable so that a router replaced in the same process (chaos ``restart_router``) is
    the one used from then on.
    """

    def __init__(self, router: Callable[[], Router], hooks: Hooks, *, max_model_len: int, block_size: int,
                 forget: Callable[[str], None] | None = None, front: Callable[[], Front] | None = None) -> None:
        self._router = router
        self._front: Callable[[], Front] = front or router
        """Where requests go: the router, or the front door of several router replicas."""
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._forget = forget
        """Told each request id that ended, after its callback: whoever else kept state for it drops it."""
        self._streams: dict[str, OnTokens] = {}
        hooks.subscribe(self._on_tokens, "tokens")

    def _on_tokens(self, ev: HookEvent) -> None:
        cb = self._streams.get(ev.request_id)  # type: ignore[arg-type]
        if cb is not None and isinstance(ev.details, TokenTimes):
            cb(len(ev.details.times_ns))

    def submit(self, req: ClientRequest, on_tokens: OnTokens, on_end: OnEnd) -> None:
        rid = req.request_id
        streams = self._streams
        if rid in streams:  # the id of an open request: refused here, and nothing of that request is touched
            on_end(RequestRecord(request_id=rid, arrival_ns=self._router().clock.now_ns(), isl=len(req.tokens),
                                 max_tokens=req.max_tokens,
                                 failure=f"duplicate_request_id: {rid!r} is in use by a request still open"))
            return
        streams[rid] = on_tokens

        forget = self._forget

        def ended(record: RequestRecord) -> None:
            if streams.get(rid) is on_tokens:
                del streams[rid]
            on_end(record)
            if forget is not None:
                forget(rid)

        record = self._front().submit(req, ended)
        if isinstance(record, RequestRecord) and record.completion_ns is None and record.failure is None:
            keep_last_token_time(record)  # an HTTP answer needs counts, the first and the last time

    def cancel(self, request_id: str, reason: str) -> None:
        self._streams.pop(request_id, None)
        self._front().cancel(request_id, reason)

    def unavailable(self) -> str | None:
        router = self._router()
        if router.lifecycle.stopped:
            return f"the router stopped: {router.lifecycle.stopped}"
        if not router.workers:
            return "no worker is registered with the router"
        return None

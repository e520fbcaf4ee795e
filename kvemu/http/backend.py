"""What the HTTP front end runs requests on: the router (the front door) or one worker's own engines.

A backend takes a ``ClientRequest`` with two callbacks: ``on_tokens(n)`` each time ``n`` more output tokens
exist, ``on_end(record)`` once, when the request completed or failed. ``cancel`` ends it at once (the client
went away): the router frees its load and binding and the engine its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvemu.records import RequestRecord
from kvemu.hooks import HookEvent, Hooks
from kvemu.messages import ClientRequest
from kvemu.replica_front import Front
from kvemu.runtime.router import Router

__all__ = ["Backend", "Handoff", "RouterBackend", "OnTokens", "OnEnd"]

OnTokens = Callable[[int], None]
OnEnd = Callable[[RequestRecord], None]


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
        if cb is not None:
            cb(len(ev.data["times_ns"]))  # type: ignore[index]

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

        self._front().submit(req, ended)

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

"""The ASGI shapes the HTTP layer speaks: a connection's scope, the messages it receives and sends, and the handler
of one route (``OpenAIApp``'s own routes and the ``extra_routes`` a process adds)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Scope", "Message", "Receive", "Send", "Handler", "Routes"]

Scope = dict[str, Any]
"""A connection's scope as the server hands it over: its ``type``, and for ``http`` its ``method``, ``path``,
``query_string`` (bytes) and ``headers`` (byte pairs), each key's type fixed by the ASGI spec, not by one type."""
Message = dict[str, Any]
"""One ASGI message (``type`` names it; ``http.request`` carries ``body`` and ``more_body``, ``http.response.start``
``status`` and ``headers``)."""
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI application, or one route's handler."""
Routes = dict[tuple[str, str], Handler]
"""Handlers by (method, path)."""

"""The bounds of every value that crosses a process or trust boundary, declared once.

Messages over ZeroMQ, HTTP bodies, KV-event batches, replica-sync batches and trace rows build their fields
from these types, so a decoder refuses an out-of-range value (a 5,000,000-character request id, a 1 MB LoRA
name, an infinite float) before any of it reaches the router; ``tests/boundaries`` fails on a boundary field
without a bound. Bounds are generous for genuine traffic: they stop what no engine or client would send.
"""

from __future__ import annotations

import sys
from typing import Annotated

from msgspec import Meta

__all__ = [
    "INT64_MIN", "INT64_MAX", "RANK_MAX", "MAX_ID_CHARS", "MAX_REQUEST_ID_CHARS", "MAX_KEY_CHARS", "MAX_NAME_CHARS", "MAX_TEXT_CHARS",
    "MAX_ENDPOINT_CHARS", "MAX_LIST_ITEMS", "MAX_KV_BATCH_BYTES", "MAX_BODY_BYTES", "Finite", "MAX_PROMPT_TOKENS", "MAX_OUTPUT_TOKENS", "MAX_TIME_NS", "MAX_SECONDS", "MAX_TRACE_MS",
    "MAX_WEIGHT", "MAX_PATH_CHARS", "MAX_KV_GROUPS", "Weight", "FilePath",
    "I64", "Count", "U64", "WorkerId", "Rank", "TimeNs", "Seconds", "Id", "RequestId", "Key", "Name", "Text", "Endpoint",
    "U64_WIRE", "WIRE_RANGE", "WireInt",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
RANK_MAX = (1 << 31) - 1
"""The largest DP rank (and worker id a socket identity names)."""

MAX_PROMPT_TOKENS = 1 << 22
"""Most tokens in a client's prompt (the most a scenario or trace may ask for)."""
MAX_OUTPUT_TOKENS = 1 << 22
"""Most output tokens one request may produce or name."""

MAX_ID_CHARS = 256
"""A client's session ids (and parent session ids) and LoRA names: HTTP's ``MAX_ID_BYTES`` and a trace row's id
bound (as bytes there; a character is at most 4 of them)."""
MAX_REQUEST_ID_CHARS = 512
"""A client's request id over ZeroMQ: twice ``MAX_ID_CHARS``, for the ids kvemu's load generator builds from a
trace's own (a WEKA play's ``weka:<hash>:play:<trace id>:request:outer:<i>:inner:<j>`` around a 256-byte trace
id). HTTP takes 128 (``X-Request-Id``)."""
MAX_KEY_CHARS = 1024
"""Ids kvemu's own processes make from a client's (the router's ``<client identity hex>/<client id>``: a
255-byte ZeroMQ identity, 510 hex characters, and a ``MAX_REQUEST_ID_CHARS`` id fit)."""
MAX_NAME_CHARS = 128
"""Enumerated names (worker types, taints, media, cache-spec kinds, reasons' codes)."""
MAX_TEXT_CHARS = 4096
"""Free text: a refusal's or a failure's reason, a control reply's detail."""
MAX_ENDPOINT_CHARS = 1024
"""A ZeroMQ endpoint or URL a peer names."""
MAX_LIST_ITEMS = 1 << 16
"""Lists of names or endpoints (taints, a worker's ranks' endpoints, cache groups)."""
MAX_KV_BATCH_BYTES = 64 << 20
"""Largest KV-event batch, live or replayed (``kvemu.wire.limits`` gives its sockets this bound)."""
MAX_BODY_BYTES = 16 << 20
"""Largest HTTP request body the OpenAI app reads (``OpenAIApp.max_body_bytes``' default)."""
MAX_TIME_NS = INT64_MAX
"""A time or duration in ns (any int64: wall clocks in ns since the epoch fit until 2262)."""
MAX_SECONDS = 1e11
"""A time or duration in float seconds (wall time since the epoch: year 5138)."""
MAX_TRACE_MS = 3.2e11
"""A trace row's latest ``timestamp`` and longest ``delay`` (ms), and a scenario's longest time: ten years."""

MAX_WEIGHT = 1e6
"""A router's cost weight, credit, scale or temperature, or an engine's or a trace's speed-up ratio (the
defaults are 0..200; a million times the default effect is no genuine setting)."""
MAX_KV_GROUPS = 1024
"""Most KV cache groups (layer kinds) a model declares, and ``group_idx`` bound of a rank's per-group counts."""
MAX_PATH_CHARS = 4096
"""A file path (Linux's ``PATH_MAX``) or a ``module:callable`` reference an operator's file names."""

assert 2 * 255 + 1 + MAX_REQUEST_ID_CHARS <= MAX_KEY_CHARS  # (a router key always fits)

I64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
"""Any integer msgpack carries signed: an integer beyond it would be accepted and fail to encode later (#27)."""
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
"""A non-negative count or size."""
U64_WIRE = "u64: msgpack caps it at 2**64 - 1; msgspec bounds stop at int64"
"""The ``Meta.extra`` mark of an unsigned 64-bit integer (a block hash), whose upper bound is the wire's own."""
U64 = Annotated[int, Meta(ge=0, extra={"le": U64_WIRE})]
"""An unsigned 64-bit integer (a block hash); only msgpack decoders may take it (JSON has no such cap)."""
WIRE_RANGE = "msgpack's own: -2**63 .. 2**64 - 1"
"""The ``Meta.extra`` mark of an integer whose range is the msgpack wire's (checked, if at all, where it is used)."""
WireInt = Annotated[int, Meta(extra={"range": WIRE_RANGE})]
"""An item of a long list of integers in a msgpack message (a prompt's token ids, an event's block hashes): no
per-item check at decoding (it costs ~30% of a prompt's decoding), the range is the wire's own; only msgpack
decoders may take it."""
WorkerId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Rank = Annotated[int, Meta(ge=0, le=RANK_MAX)]
TimeNs = Annotated[int, Meta(ge=0, le=MAX_TIME_NS)]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""Any finite float (no ``inf``, no ``nan``): a value with no range of its own."""
Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
"""Finite: a float without an upper bound takes ``inf`` (and a JSON ``1e999``)."""
Weight = Annotated[float, Meta(ge=0, le=MAX_WEIGHT)]
"""A non-negative multiplier (``MAX_WEIGHT``)."""
Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
RequestId = Annotated[str, Meta(max_length=MAX_REQUEST_ID_CHARS)]
Key = Annotated[str, Meta(max_length=MAX_KEY_CHARS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
Endpoint = Annotated[str, Meta(max_length=MAX_ENDPOINT_CHARS)]
FilePath = Annotated[str, Meta(max_length=MAX_PATH_CHARS)]

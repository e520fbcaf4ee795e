"""The one record of what happened to a request: kept by the engine, returned by the router, written to requests.jsonl.

Two producers fill one each: an engine core keeps the engine's facts on its hot path, and the router's
lifecycle (or a disaggregated router, merging its legs) keeps the request's: that record is what
``Router.handle`` returns, what every request-level hook carries, and what the harness recorder keeps and
writes as one line of ``requests.jsonl``. Times are nanoseconds on the producer's clock (virtual or wall;
the report shifts them to scenario time).

What only the engine knows (``EngineFacts``: admission time, cached, reused and host-cached prompt tokens,
preemptions) is one struct: the engine fills it, ``kvemu.messages.Finished`` carries it, and the router's record
embeds it as ``RequestRecord.engine``; requests.jsonl keeps its flat columns (``records_jsonl``).
"""

from __future__ import annotations

import warnings
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from kvemu.limits import MAX_OUTPUT_TOKENS, MAX_TEXT_CHARS, Count, Id, Key, Name, Rank, TimeNs, WorkerId

__all__ = ["EngineFacts", "EngineRecord", "RequestRecord", "router_record", "records_jsonl", "flat_json",
           "JSONL_COLUMNS", "sequences_as_lists", "MAX_FAILURE_CHARS"]

MAX_FAILURE_CHARS = 2 * MAX_TEXT_CHARS
"""A record's failure: kvemu's own words around a peer's reason (a worker's refusal or failure, ``Text``), so a
router's record always reaches its client."""
Failure = Annotated[str, Meta(max_length=MAX_FAILURE_CHARS)]
"""A record's failure (``reason`` or ``reason: detail``)."""
TokenTimes = Annotated[list[TimeNs], Meta(max_length=MAX_OUTPUT_TOKENS)]
"""A record's output token times (ns)."""


def sequences_as_lists(obj: object) -> object:
    """msgspec ``enc_hook``: compact or lazy sequences of ints (token times in an ``array('q')``, a trace
    prompt) are encoded as the lists their fields declare."""
    if isinstance(obj, Sequence):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class EngineFacts(msgspec.Struct, kw_only=True, gc=False, forbid_unknown_fields=True):
    """What the engine alone knows of a request: filled by the engine (at admissions and preemptions), carried by
    ``Finished`` (from a peer: every field bounded, an unknown one refused), embedded unchanged in the router's
    record. Encoded under the record's requests.jsonl column names (``engine_cached_tokens``, …)."""

    admitted_ns: TimeNs | None = None
    """When the engine first scheduled it (start of that pass)."""
    cached_tokens: Count | None = msgspec.field(default=None, name="engine_cached_tokens")
    """Prompt tokens the engine actually found cached at first admission (the physical-cache check)."""
    reused_tokens: Count | None = msgspec.field(default=None, name="engine_reused_tokens")
    """Tokens the engine found cached at its last admission (a re-admission after preemption reuses what of
    it survived; the SGLang flavour: the most any of its admissions found, as the reference reports a retracted
    request): what the reference's ``prefix_cache_reused_ratio`` counts."""
    host_cached_tokens: Count | None = msgspec.field(default=None, name="engine_host_cached_tokens")
    """Host offload: the part of ``cached_tokens`` loaded from the host tier (the rest was on the GPU); None when
    the engine has no host tier."""
    preemptions: Count = 0
    """Times the engine preempted it (its blocks taken back; recomputed on re-admission)."""


class _Record(msgspec.Struct):
    """What both records (the router's and the engine's) share, no field of its own: ``done``, and the engine's
    facts under their names from before ``EngineFacts`` (read-only, deprecated for one release)."""

    if TYPE_CHECKING:
        engine: EngineFacts
        completion_ns: int | None
        failure: str | None

    @property
    def done(self) -> bool:
        """Whether the request completed: every requested token produced, no failure."""
        return self.completion_ns is not None and self.failure is None

    def _moved(self, name: str, new: str) -> EngineFacts:
        cls = type(self).__name__
        warnings.warn(f"{cls}.{name} is now {cls}.engine.{new}", DeprecationWarning, stacklevel=3)
        return self.engine

    @property
    def admitted_ns(self) -> int | None:
        """Deprecated (one release): ``engine.admitted_ns``."""
        return self._moved("admitted_ns", "admitted_ns").admitted_ns

    @property
    def engine_cached_tokens(self) -> int | None:
        """Deprecated (one release): ``engine.cached_tokens``."""
        return self._moved("engine_cached_tokens", "cached_tokens").cached_tokens

    @property
    def engine_reused_tokens(self) -> int | None:
        """Deprecated (one release): ``engine.reused_tokens``."""
        return self._moved("engine_reused_tokens", "reused_tokens").reused_tokens

    @property
    def engine_host_cached_tokens(self) -> int | None:
        """Deprecated (one release): ``engine.host_cached_tokens``."""
        return self._moved("engine_host_cached_tokens", "host_cached_tokens").host_cached_tokens

    @property
    def preemptions(self) -> int:
        """Deprecated (one release): ``engine.preemptions``."""
        return self._moved("preemptions", "preemptions").preemptions


class RequestRecord(_Record, kw_only=True, gc=False, repr_omit_defaults=True):
    """Everything known about one request's life; the field order is the column order of requests.jsonl, with
    ``engine``'s fields in its place (``JSONL_COLUMNS``).

    ``gc=False`` (not tracked by the cyclic GC: cheaper to create and to keep millions of) is safe
    because no field can refer back to a record: strings, integers, one list of integers and the engine's
    facts (integers).
    """

    request_id: Key
    session_id: Id | None = None
    parent_session_id: Id | None = None
    arrival_ns: TimeNs = 0
    """When the request arrived (at the router; at the engine for an engine's own record)."""
    isl: Count = 0
    """Input sequence length: prompt tokens."""
    max_tokens: Count = 0
    """Output tokens requested (the mock engine produces exactly this many)."""
    worker_id: WorkerId | None = None
    dp_rank: Rank | None = None
    attempts: Count = 0
    """Times the request was routed to a rank (a selection that found no rank does not count): 1 + re-routings
    after rejected dispatches or lost workers."""
    queued_ns: TimeNs | None = None
    """When it entered the router's policy queue (None: never queued)."""
    routed_ns: TimeNs | None = None
    """When the router chose the rank (arrival → routed is the routing overhead)."""
    dispatch_ns: TimeNs | None = None
    """When the worker accepted the dispatch."""
    routing_reason: Name | None = None
    predicted_overlap_blocks: Count | None = None
    """The router's overlap (device prefix depth) for the chosen rank when it routed (disaggregated: the
    prefill leg's, the leg whose engine found ``engine_cached_tokens``; the decode leg's KV comes by transfer)."""
    best_overlap_blocks: Count | None = None
    """The deepest overlap any rank had at that moment (disaggregated: in the prefill pool)."""
    truth_overlap_blocks: Count | None = None
    """Engine truth at the routing decision: the prompt's leading blocks the chosen rank really had cached (None:
    no truth probe, e.g. separate processes)."""
    truth_best_overlap_blocks: Count | None = None
    """Engine truth at the same instant: the most any eligible rank really had (lost = this - the chosen's)."""
    regret_source: Name | None = None
    """Where the lost blocks were (Dynamo's locality classes): ``peer`` (another DP rank of the chosen worker),
    ``cache_owner`` (the rank the session last ran on), ``shared`` (another rank); None: nothing was lost."""
    engine: EngineFacts = msgspec.field(default_factory=EngineFacts)
    """The engine's facts, as its ``Finished`` brought them (defaults until then, and after a retry); in
    requests.jsonl its fields are the record's own columns (``records_jsonl``)."""
    first_token_ns: TimeNs | None = None
    output_tokens: Count = 0
    """Output tokens produced so far."""
    token_times_ns: TokenTimes = []
    """Each output token's time (the end of the pass that produced it); empty if the engine does not record them.
    Any sequence of ints in process (a router's record keeps an ``array('q')``, 8 bytes a token)."""
    completion_ns: TimeNs | None = None
    """When the last token was produced (None while running and for failed requests)."""
    prefill_worker_id: WorkerId | None = None
    """Disaggregated serving: the prefill rank that computed the prompt (``worker_id`` is the decode rank)."""
    prefill_dp_rank: Rank | None = None
    prefill_done_ns: TimeNs | None = None
    """Disaggregated serving: when the prompt was computed (the prefill rank holds its KV from then)."""
    kv_reserved_ns: TimeNs | None = None
    """Disaggregated serving: when the decode rank reserved room for the prompt (its KV transfer began)."""
    kv_activated_ns: TimeNs | None = None
    """Disaggregated serving: when the request joined the decode rank's passes (the transfer was over)."""

    failure: Failure | None = None
    """Why the request failed (``reason`` or ``reason: detail``); None if it did not."""

    def add_token_times(self, times: Sequence[int]) -> None:
        """Append output token times, whatever sequence holds them (compiled callers never see its type): a list
        into the router's ``array('q')`` in one resize (``extend`` grows it an item at a time), else ``extend``."""
        held: object = self.token_times_ns  # (declared as the list it decodes to; a router's is an array)
        if type(times) is list and type(held) is array:
            held.fromlist(times)
        else:
            self.token_times_ns.extend(times)

    def last_token_ns(self) -> int | None:
        """The time of the last output token so far (None before the first)."""
        times = self.token_times_ns
        return times[-1] if len(times) else None


class EngineRecord(_Record, kw_only=True, gc=False, repr_omit_defaults=True):
    """One request's life as its engine core keeps it: the engine's part of ``RequestRecord`` under the same names
    (its facts in ``engine``, which ``Finished`` hands to the router's record). ``gc=False`` as the router's."""

    request_id: Key
    arrival_ns: TimeNs = 0
    """When the request reached the engine."""
    isl: Count = 0
    max_tokens: Count = 0
    worker_id: WorkerId | None = None
    dp_rank: Rank | None = None
    engine: EngineFacts = msgspec.field(default_factory=EngineFacts)
    first_token_ns: TimeNs | None = None
    output_tokens: Count = 0
    token_times_ns: TokenTimes = []
    """Each output token's time (the end of its pass); empty if the engine does not record them."""
    completion_ns: TimeNs | None = None
    kv_reserved_ns: TimeNs | None = None
    """A decode leg: when the engine reserved room for the prompt (its KV transfer began)."""
    kv_activated_ns: TimeNs | None = None
    """A decode leg: when it joined the engine's passes (the transfer was over)."""
    failure: Failure | None = None
    """Why the engine dropped it (aborted, its rank lost); None if it did not."""


def router_record(request_id: str, *, session_id: str | None, parent_session_id: str | None, arrival_ns: int,
                  isl: int, max_tokens: int) -> RequestRecord:
    """The record a router opens for a request it takes, its token times kept as an ``array('q')``."""
    return RequestRecord(request_id=request_id, session_id=session_id, parent_session_id=parent_session_id,
                         arrival_ns=arrival_ns, isl=isl, max_tokens=max_tokens,
                         # 8 bytes a token, not a 32-byte int object and a list slot; the field is declared as the
                         # list it decodes to (engines append and slice it as one)
                         token_times_ns=array("q"))  # type: ignore[arg-type]


JSONL_COLUMNS: tuple[str, ...] = tuple(
    name for f in msgspec.structs.fields(RequestRecord)
    for name in ([g.encode_name for g in msgspec.structs.fields(EngineFacts)] if f.name == "engine" else [f.encode_name]))
"""The columns of requests.jsonl, in order (``records_jsonl``): the record's fields, ``engine`` flattened."""

_AFTER_ENGINE = RequestRecord.__struct_encode_fields__[RequestRecord.__struct_encode_fields__.index("engine") + 1]
_OPEN = b'"engine":{'
_CLOSE, _CLOSED = f'}},"{_AFTER_ENGINE}":'.encode(), f',"{_AFTER_ENGINE}":'.encode()
"""The embedded ``EngineFacts`` object's ends in a record's JSON, found by plain search: a JSON string escapes its
quotes, so neither can occur inside one, and the facts (numbers and nulls) hold no object of their own."""


def records_jsonl(records: Sequence[RequestRecord], encoder: msgspec.json.Encoder) -> bytes:
    """The records as JSON lines with flat columns (requests.jsonl): ``engine``'s fields in its place, as
    ``admitted_ns``, ``engine_cached_tokens``, …, ``preemptions`` (the layout from before they were embedded)."""
    return encoder.encode_lines(records).replace(_OPEN, b"").replace(_CLOSE, _CLOSED)


def flat_json(record: RequestRecord, encoder: msgspec.json.Encoder) -> bytes:
    """One record as requests.jsonl's JSON object (flat columns, ``records_jsonl``), without a newline."""
    return encoder.encode(record).replace(_OPEN, b"", 1).replace(_CLOSE, _CLOSED, 1)

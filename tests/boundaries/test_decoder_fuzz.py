"""Property-based fuzzing of every decoder a peer reaches (issue #43): random bytes, random msgpack values and
valid messages with one value swapped for a hostile one either decode to a value within its bounds or raise
the decoder's own error (``msgspec.ValidationError``/``DecodeError``; ``WireDecodeError`` for KV events; a 400
for HTTP bodies), never another exception. Valid samples are built from each type's own declaration, so a
message added to a union is fuzzed with no list to update."""

from __future__ import annotations

import math
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.http.errors import ApiError
from kvemu.http.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, decode_body
from kvemu.limits import MAX_BODY_BYTES, MAX_ID_CHARS, MAX_TEXT_CHARS
from kvemu.kv_events import BlockRemoved, BlockStored, KVEventBatch
from kvemu.messages import (ClientRequest, RouterMessage, WorkerMessage, decode_client_request,
                            decode_router_message, decode_worker_message, with_packed_prompt)
from kvemu.replica_sync import SyncBatch
from kvemu.runtime import replica_sync_zmq
from kvemu.wire.codec import PROFILES, WireDecodeError, decode_batch, encode_batch

from harness.procs.protocol import ClientMessage, ReplyMessage, client_decoder, reply_decoder

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                database=None)
"""A few seconds per decoder: bounded so CI stays quick."""
MSG_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def minimal(t: mi.Type, full: bool = False) -> Any:
    """The smallest valid plain value of a type (its builtins form: what ``msgspec.convert`` takes back); ``full``:
    with every optional field of every struct set too, so that fuzzing reaches each field."""
    if isinstance(t, mi.Metadata):
        return minimal(t.type, full)
    if isinstance(t, mi.StructType):
        if t.array_like:  # [tag, fields...]: the required fields come first
            return [*([t.tag] if t.tag_field is not None else []),
                    *(minimal(f.type, full) for f in t.fields if f.required or full)]
        out = {f.encode_name: minimal(f.type, full) for f in t.fields if f.required or full}
        if t.tag_field is not None:
            out[t.tag_field] = t.tag
        return out
    if isinstance(t, mi.UnionType):
        return minimal(next((u for u in t.types if not isinstance(u, mi.NoneType)), t.types[0]), full)
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, (mi.IntType, mi.FloatType)):
        low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else 0)
        return type(low)(low) if isinstance(t, mi.IntType) else float(low) + (1.0 if t.gt is not None else 0.0)
    if isinstance(t, mi.StrType):
        return "a" * (t.min_length or 1) if t.pattern is None else "a"
    if isinstance(t, (mi.BytesType, mi.ByteArrayType)):
        return b""
    if isinstance(t, mi.DictType):
        return {minimal(t.key_type): minimal(t.value_type, full)} if full else {}
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return [minimal(t.item_type, full)] if full else []
    if isinstance(t, mi.TupleType):
        return [minimal(x, full) for x in t.item_types]
    if isinstance(t, mi.BoolType):
        return False
    return None


def samples(union: Any) -> list[bytes]:
    """Two valid encoded messages per member of ``union`` (a struct or a union of structs): its required fields
    only, and every field set."""
    members = typing.get_args(union) or (union,)
    out = []
    for cls in members:
        for full in (False, True):
            value = msgspec.convert(minimal(mi.type_info(cls), full), cls)
            out.append(msgspec.msgpack.encode(value, enc_hook=_packed))
    return out


hostile = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.integers(-3, 3),
    st.floats(), st.just(float("inf")), st.just(float("nan")),
    st.text(max_size=20), st.builds(lambda n: "x" * n, st.sampled_from([255, 256, 257, 1024, 1025, 5000])),
    st.binary(max_size=20), st.lists(st.integers(-(2**63), 2**64 - 1), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1), max_size=3),
)
plain = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                               st.text(max_size=10), st.binary(max_size=10)),
                     lambda inner: st.one_of(st.lists(inner, max_size=4),
                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=15)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a decoded msgpack value (maps and arrays)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, encoded: list[bytes]) -> bytes:
    """A valid message with one value (or one new key) replaced by a hostile one, or the message cut short."""
    raw = draw(st.sampled_from(encoded))
    how = draw(st.sampled_from(["swap", "swap", "swap", "add", "cut"]))
    if how == "cut":
        return raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    value = msgspec.msgpack.decode(raw)
    paths = _paths(value)
    if how == "add" or not paths:
        if isinstance(value, dict):
            value[draw(st.text(max_size=12))] = draw(hostile)
        return msgspec.msgpack.encode(value)
    path = draw(st.sampled_from(paths))
    node = value
    for step in path[:-1]:
        node = node[step]
    old = node[path[-1]]
    node[path[-1]] = draw(st.one_of(hostile, _hostile_like(old)) if _hostile_like(old) is not None else hostile)
    return msgspec.msgpack.encode(value)


def _hostile_like(old: Any) -> st.SearchStrategy[Any] | None:
    """Values of the same type as ``old`` at and past any sane bound (those most likely to decode)."""
    if isinstance(old, bool) or old is None:
        return None
    if isinstance(old, int):
        return st.sampled_from([-1, -(2**63), 2**63 - 1, 2**64 - 1, 2**31, 2**40])
    if isinstance(old, float):
        return st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1e308])
    if isinstance(old, str):
        return st.builds(lambda n: "x" * n, st.sampled_from([257, 1025, 4097, 100_000]))
    if isinstance(old, bytes):
        return st.builds(lambda n: b"\0" * n, st.sampled_from([3, 4097, 100_000]))
    if isinstance(old, list):
        return st.builds(lambda n: old * n if old else [0] * n, st.sampled_from([2, 1000, 70_000]))
    return None


def _fuzz_inputs(encoded: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64), plain.map(msgspec.msgpack.encode), mutated(encoded), mutated(encoded),
                     mutated(encoded))


def _redecodes(decoder: Any, value: Any, longest: int = MAX_TEXT_CHARS) -> None:
    """A decoded value is within its bounds: tame (``_tame``), and encoded again it decodes again."""
    _tame(value, longest)
    decoder(msgspec.msgpack.encode(value, enc_hook=_packed))


def _tame(value: Any, longest: int) -> None:
    """No float of ``value`` is infinite or NaN and no string is longer than ``longest`` (wherever it nests)."""
    if isinstance(value, float):
        assert math.isfinite(value), value
    elif isinstance(value, str):
        assert len(value) <= longest, len(value)
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _tame(getattr(value, name), longest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tame(item, longest)
    elif isinstance(value, dict):
        for k, v in value.items():
            _tame(k, longest)
            _tame(v, longest)


def _packed(obj: Any) -> Any:
    return obj.u32_bytes()  # a PackedTokens prompt: as kvemu's own senders send it


PENDING_REPLIES = {"router -> client"}
"""Decoders fuzzed for crashes only: their types' bounds are pending (``test_walk.PENDING``: ``RequestRecord``)."""

MSG_DECODERS = {
    "worker -> router": (decode_worker_message, WorkerMessage),
    "router -> worker": (decode_router_message, RouterMessage),
    "client -> router": (decode_client_request, ClientRequest),
    "client -> router (process)": (lambda b: with_packed_prompt(client_decoder.decode(b)), ClientMessage),
    "router -> client": (reply_decoder.decode, ReplyMessage),
    "replica sync": (replica_sync_zmq._decoder.decode, SyncBatch),
}


@pytest.mark.parametrize("name", list(MSG_DECODERS))
def test_a_message_decoder_gives_a_bounded_value_or_its_own_error(name):
    decode, union = MSG_DECODERS[name]
    encoded = samples(union)
    for raw in encoded:  # the samples themselves are valid
        decode(raw)

    @FUZZ
    @given(data=_fuzz_inputs(encoded))
    def fuzz(data: bytes) -> None:
        try:
            value = decode(data)
        except MSG_ERRORS:
            return
        if name not in PENDING_REPLIES:
            _redecodes(decode, value)

    fuzz()


def _kv_samples() -> list[bytes]:
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                    lora_name="l", extra_keys=[None, None]),
        BlockRemoved(block_hashes=[3])], data_parallel_rank=0)
    return [encode_batch(batch, p) for p in PROFILES.values()]


def test_the_kv_event_decoder_gives_a_bounded_batch_or_a_wire_decode_error():
    encoded = _kv_samples()
    typed = msgspec.msgpack.Decoder(KVEventBatch)

    @FUZZ
    @given(data=_fuzz_inputs(encoded))
    def fuzz(data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except WireDecodeError:
            return
        _tame(batch, MAX_ID_CHARS)
        typed.decode(msgspec.msgpack.encode(batch))  # (its map form: every bound checked again)

    fuzz()


HTTP_BODIES = [CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest]
json_plain = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                                    st.text(max_size=10)),
                          lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=15)

INF = "__inf__"
"""Written as ``1e999`` in the body (JSON's infinity: msgspec reads it as ``inf``)."""
json_hostile = st.one_of(st.integers(-(2**64), 2**64), st.floats(allow_nan=False, allow_infinity=False),
                         st.builds(lambda n: "x" * n, st.sampled_from([255, 256, 257, 1024, 1025, 5000])),
                         st.lists(st.integers(-(2**63), 2**64 - 1), max_size=5), st.just(INF))


@pytest.mark.parametrize("kind", HTTP_BODIES, ids=lambda k: k.__name__)
def test_an_http_body_decodes_bounded_or_is_a_400(kind):
    names = [f.encode_name for f in mi.type_info(kind).fields]
    bodies = st.one_of(
        st.binary(max_size=64),
        json_plain.map(msgspec.json.encode),
        st.dictionaries(st.sampled_from(names), st.one_of(json_plain, json_hostile), max_size=6)
        .map(lambda d: msgspec.json.encode(d).replace(f'"{INF}"'.encode(), b"1e999")),
        st.just(b'{"prompt": "x", "nvext": {"agent_hints": {"latency_sensitivity": 1e999}}}'),
    )

    @FUZZ
    @given(body=bodies)
    def fuzz(body: bytes) -> None:
        try:
            value = decode_body(body, kind)
        except ApiError as exc:
            assert exc.status == 400, exc
            return
        _tame(value, MAX_BODY_BYTES)
        decode_body(msgspec.json.encode(value), kind)

    fuzz()


def _row_lines() -> st.SearchStrategy[str]:
    valid = {"hash_ids": [1, 2, 3], "input_length": 40, "output_length": 5, "timestamp": 1.5, "session_id": "s",
             "output_token_ids": [1, 2, 3, 4, 5]}
    swapped = st.tuples(st.sampled_from([*valid, "delay"]), st.one_of(json_plain, json_hostile)).map(
        lambda kv: msgspec.json.encode({**valid, kv[0]: kv[1]}).decode().replace(f'"{INF}"', "1e999"))
    return st.one_of(st.text(max_size=40), json_plain.map(lambda v: msgspec.json.encode(v).decode()), swapped,
                     st.just(msgspec.json.encode(valid).decode()),
                     st.just(msgspec.json.encode({**valid, "session_id": "\u00e9" * 200}).decode()))


def test_a_trace_row_decodes_bounded_the_same_on_both_paths_or_names_its_field():
    """A Mooncake row: the fast path (msgspec) gives the checked path's row or steps aside (None); the checked
    path gives a bounded row or ``InvalidArgument``; the session id within what a router takes."""
    import json

    from kvemu.errors import InvalidArgument
    from harness.workload.traces.mooncake import _fast_row, mooncake_row

    @FUZZ
    @given(line=_row_lines())
    def fuzz(line: str) -> None:
        fast = _fast_row(line, 16)
        try:
            slow = mooncake_row(json.loads(line), 16)
        except (json.JSONDecodeError, RecursionError, InvalidArgument):
            assert fast is None, (line, fast)
            return
        assert fast is None or fast == slow, (line, fast, slow)
        assert slow.session_id is None or len(slow.session_id.encode()) <= MAX_ID_CHARS
        _tame(tuple(slow), MAX_ID_CHARS)

    fuzz()

"""vLLM KV-event payloads: byte-exact encoding per vLLM version, tolerant decoding of any of them.

A ``VllmProfile`` fixes what one vLLM release puts on the wire: array or map events (maps from 0.24),
the field list of each event, whether the batch carries the DP rank (from 0.10) and the shape of
replay replies (topic frame from 0.26). Encoders are msgspec structs built from those field tables,
so the bytes are what that release's own structs produce. The decoder accepts array or map batches
and events, a missing rank, extra trailing fields, signed or unsigned or bytes hashes, and Eagle
token pairs; anything else raises ``WireDecodeError`` with the bytes that failed.

Block hashes go out in one of vLLM's two forms (``ExternalBlockHash = bytes | int``, from 0.11): the default
integer (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of the digest, a msgpack uint64),
or with ``profile_for(version, "bytes")`` the raw digest (the variable at 0): 32 bytes, as vLLM's default
``sha256`` block hash is, whose last 8 bytes big-endian are kvemu's integer hash (``block_hash_digest``), so
either form decodes to the same hash and routes the same.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from types import GenericAlias
from typing import Annotated, Any, NamedTuple, TypedDict

import msgspec
from msgspec import Meta

from kvemu.errors import InvalidArgument, KvemuError
from kvemu.hashing import U64_MASK
from kvemu.kv_events import MAX_BATCH_EVENTS, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KVEventBatch, Stamp
from kvemu.limits import Rank

__all__ = [
    "VllmProfile",
    "PROFILES",
    "DEFAULT_VLLM_VERSION",
    "HASH_FORMS",
    "DEFAULT_HASH_FORM",
    "BYTES_HASHES_SINCE",
    "profile_for",
    "block_hash_digest",
    "WireDecodeError",
    "encode_batch",
    "decode_batch",
    "STORED_FIELDS",
    "REMOVED_FIELDS",
]

DEFAULT_VLLM_VERSION = "0.33"
HASH_FORMS = ("int", "bytes")
"""How block hashes go on the wire: msgpack uint64 (vLLM's default) or the digest's raw bytes."""
DEFAULT_HASH_FORM = "int"
BYTES_HASHES_SINCE = (0, 11)
"""The first release whose events can carry digest bytes (``ExternalBlockHash``; the int form is then
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its default)."""
DIGEST_BYTES = 32
"""Length of a block hash in bytes form: vLLM's default block hash is a sha256 digest."""

STORED_FIELDS: tuple[str, ...] = BlockStored.__struct_fields__
"""Every ``BlockStored`` field ever sent, in wire order (each release sends a prefix of this list); the
neutral struct in ``kv_events`` is the one definition."""
REMOVED_FIELDS: tuple[str, ...] = BlockRemoved.__struct_fields__
STORED_REQUIRED = 7  # block_hashes .. lora_name have no default (nil is still sent in map form)
REMOVED_REQUIRED = 2


class WireDecodeError(KvemuError, ValueError):
    """A payload that no vLLM version would produce; carries where it came from and its first bytes."""

    def __init__(self, reason: str, payload: bytes, *, endpoint: str | None = None, seq: int | None = None) -> None:
        self.reason = reason
        self.endpoint = endpoint
        self.seq = seq
        self.head = bytes(payload[:32])
        where = f" from {endpoint}" if endpoint else ""
        at = f" seq {seq}" if seq is not None else ""
        super().__init__(f"undecodable KV event batch{where}{at}: {reason}; first bytes {self.head.hex()}")


class VllmProfile(NamedTuple):
    """What one vLLM release sends."""

    version: tuple[int, int]
    stored_fields: int
    """How many of ``STORED_FIELDS`` it sends."""
    removed_fields: int
    map_events: bool
    has_dp_rank: bool
    replay_topic: bool
    """Replay replies carry the topic frame (``[id, "", topic, seq, payload]``), from 0.26."""
    bytes_hashes: bool = False
    """Block hashes go out as digest bytes (``block_hash_digest``) instead of integers (from 0.11, on request)."""

    @property
    def name(self) -> str:
        """``"0.33"``-style version string."""
        return f"{self.version[0]}.{self.version[1]}"


PROFILES: dict[tuple[int, int], VllmProfile] = {
    p.version: p
    for p in (
        VllmProfile((0, 9), 5, 1, False, False, False),
        VllmProfile((0, 10), 5, 1, False, True, False),
        VllmProfile((0, 11), 6, 2, False, True, False),
        VllmProfile((0, 16), 7, 2, False, True, False),
        VllmProfile((0, 20), 9, 3, False, True, False),
        VllmProfile((0, 22), 11, 3, False, True, False),
        VllmProfile((0, 24), 11, 3, True, True, False),
        VllmProfile((0, 26), 12, 4, True, True, True),
        VllmProfile((0, 30), 14, 5, True, True, True),
        VllmProfile((0, 33), 15, 5, True, True, True),
    )
}
"""The release where each wire change appeared; releases in between send what the previous one did."""


def profile_for(version: str | tuple[int, int] = DEFAULT_VLLM_VERSION,
                hash_form: str = DEFAULT_HASH_FORM) -> VllmProfile:
    """The wire profile of a vLLM version (``"0.25.1"`` → the 0.24 profile), its block hashes in ``hash_form``
    (``"int"``, or ``"bytes"`` from 0.11: ``InvalidArgument`` for an older release or another form)."""
    if hash_form not in HASH_FORMS:
        raise InvalidArgument(f"hash_form must be 'int' or 'bytes', got {hash_form!r}")
    if isinstance(version, str):
        try:
            parts = tuple(int(x) for x in version.split(".")[:2])
        except ValueError:
            raise InvalidArgument(f"vllm_version must look like '0.33', got {version!r}") from None
        key = (parts + (0,))[:2]
    else:
        key = tuple(version)[:2]
    eligible = [v for v in PROFILES if v <= key]
    if not eligible:
        raise InvalidArgument(f"vllm_version {version!r} is older than 0.9, the first release with KV events")
    profile = PROFILES[max(eligible)]
    if hash_form == "int":
        return profile
    if profile.version < BYTES_HASHES_SINCE:
        raise InvalidArgument(f"vLLM {version!r} sends block hashes as integers only; bytes hashes need vLLM "
                              f"{BYTES_HASHES_SINCE[0]}.{BYTES_HASHES_SINCE[1]} or later")
    return profile._replace(bytes_hashes=True)


def block_hash_digest(block_hash: int) -> bytes:
    """The 32 bytes a block hash goes out as in bytes form: a digest whose last 8 bytes are ``block_hash`` (as
    u64) big-endian, so that vLLM's int form of it (the digest's low 64 bits) is ``block_hash`` again. The first
    24 come from sha256 of those 8 bytes: fixed per hash (stores, removals and parents agree, in every process)
    and digest-like, as vLLM's are."""
    low = (block_hash & U64_MASK).to_bytes(8, "big")
    return hashlib.sha256(low).digest()[: DIGEST_BYTES - 8] + low


# ---------------------------------------------------------------------------------- encoding


class _StructOptions(TypedDict):
    """The ``msgspec.defstruct`` options every event struct of a profile shares."""

    tag: bool
    omit_defaults: bool
    array_like: bool
    gc: bool


_Field = tuple[str, object] | tuple[str, object, None]
"""A field of ``msgspec.defstruct``: its name and type, and its default when it has one."""


@functools.cache
def _structs(profile: VllmProfile) -> tuple[type, type, type, type]:
    """msgspec struct classes laid out exactly as that release's own ``kv_events.py`` declares them."""
    array = not profile.map_events
    opts: _StructOptions = dict(tag=True, omit_defaults=True, array_like=array, gc=False)

    def fields(names: Sequence[str], required: int) -> list[_Field]:
        return [(n, Any) if i < required else (n, Any, None) for i, n in enumerate(names)]

    stored = msgspec.defstruct(
        "BlockStored", fields(STORED_FIELDS[: profile.stored_fields], STORED_REQUIRED), **opts
    )
    removed = msgspec.defstruct(
        "BlockRemoved", fields(REMOVED_FIELDS[: profile.removed_fields], REMOVED_REQUIRED), **opts
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
    batch_fields: list[_Field] = [("ts", float), ("events", list)]
    if profile.has_dp_rank:
        batch_fields.append(("data_parallel_rank", Any, None))
    batch = msgspec.defstruct("KVEventBatch", batch_fields, array_like=True, omit_defaults=True, gc=False)
    return batch, stored, removed, cleared


_encoder = msgspec.msgpack.Encoder()
_astuple = msgspec.structs.astuple


def encode_batch(batch: KVEventBatch, profile: VllmProfile | None = None) -> bytes:
    """The msgpack payload vLLM ``profile.version`` would send for ``batch``."""
    profile = profile or profile_for()
    batch_cls, stored_cls, removed_cls, cleared_cls = _structs(profile)
    ns, nr = profile.stored_fields, profile.removed_fields
    digests = profile.bytes_hashes
    out = []
    for ev in batch.events:
        t = type(ev)
        if t is BlockStored:  # the neutral structs list their fields in wire order
            fields = _astuple(ev)[:ns]
            if digests:  # block_hashes, parent_block_hash come first
                parent = fields[1]
                fields = ([block_hash_digest(h) for h in fields[0]],
                          None if parent is None else block_hash_digest(parent), *fields[2:])
            out.append(stored_cls(*fields))
        elif t is BlockRemoved:
            fields = _astuple(ev)[:nr]
            if digests:
                fields = ([block_hash_digest(h) for h in fields[0]], *fields[1:])
            out.append(removed_cls(*fields))
        elif t is AllBlocksCleared:
            out.append(cleared_cls())
        else:
            raise InvalidArgument(f"cannot encode {t.__name__} as a vLLM KV event")
    ts = float(batch.ts)  # vLLM stamps wall-clock seconds: always a msgpack float64
    if profile.has_dp_rank:
        return _encoder.encode(batch_cls(ts, out, batch.data_parallel_rank))
    return _encoder.encode(batch_cls(ts, out))


# ---------------------------------------------------------------------------------- decoding


def _array_form(cls: type[msgspec.Struct]) -> Any:
    """The array-form (vLLM < 0.24) decoding struct of a neutral event: its fields, types and bounds, with every
    optional field defaulting to None (an older release sends a prefix of the list)."""
    fields = [(f.name, f.type) if f.required else (f.name, f.type, None) for f in msgspec.structs.fields(cls)]
    return msgspec.defstruct(f"_Array{cls.__name__}", fields, array_like=True, tag=cls.__name__, gc=False)


_ArrayStored = _array_form(BlockStored)
_ArrayRemoved = _array_form(BlockRemoved)
_ArrayCleared = _array_form(AllBlocksCleared)
_ArrayBatch = msgspec.defstruct("_ArrayBatch", [
    ("ts", Stamp),
    ("events", Annotated[GenericAlias(list, _ArrayStored | _ArrayRemoved | _ArrayCleared),
                         Meta(max_length=MAX_BATCH_EVENTS)]),
    ("data_parallel_rank", Rank | None, None)], array_like=True, gc=False)


_fast_decoders: tuple[msgspec.msgpack.Decoder[Any], ...] = (
    msgspec.msgpack.Decoder(KVEventBatch),  # map events (≥ 0.24) decode straight into the neutral structs
    msgspec.msgpack.Decoder(_ArrayBatch),
)
_generic = msgspec.msgpack.Decoder()


def _u64(h: Any) -> int:
    if type(h) is int:
        return h & U64_MASK
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h, "big") & U64_MASK  # vLLM's int form: low 64 bits of the digest
    raise TypeError(f"block hash {h!r} is neither an integer nor bytes")


def _tokens(raw: Any) -> list[int]:
    if raw and isinstance(raw[0], (list, tuple)):  # Eagle bigrams
        return [int(p[0]) for p in raw] + [int(raw[-1][1])]
    return [int(t) for t in raw]


def _from_typed(ev: msgspec.Struct) -> KvEvent:
    """A neutral event from a decoded one (array-form classes are rebuilt; hashes made u64)."""
    t = type(ev)
    if t is _ArrayStored or t is _ArrayRemoved:
        ev = (BlockStored if t is _ArrayStored else BlockRemoved)(**msgspec.structs.asdict(ev))
    elif t is _ArrayCleared:
        return AllBlocksCleared()
    if type(ev) is BlockStored:
        hashes = ev.block_hashes
        parent = ev.parent_block_hash
        if (hashes and min(hashes) < 0) or (parent is not None and parent < 0):
            ev = msgspec.structs.replace(
                ev,
                block_hashes=[h & U64_MASK for h in hashes],
                parent_block_hash=None if parent is None else parent & U64_MASK,
            )
        return ev
    if type(ev) is BlockRemoved:
        if ev.block_hashes and min(ev.block_hashes) < 0:
            ev = msgspec.structs.replace(ev, block_hashes=[h & U64_MASK for h in ev.block_hashes])
        return ev
    if type(ev) is AllBlocksCleared:
        return ev
    raise TypeError(f"{type(ev).__name__} is not a KV event")  # the decoders make no other struct


def _event_from_generic(raw: Any) -> KvEvent:
    """Normalise one event of any form (hashes to u64, Eagle pairs to tokens), then type-check it."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = dict(raw)
    elif isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:]))
    else:
        raise TypeError(f"event is neither a tagged array nor a tagged map: {raw!r:.60}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise TypeError(f"unknown event type {tag!r}")
    fields.pop("type", None)
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, (list, tuple)):
        raise TypeError(f"{tag}.block_hashes must be a list, got {type(hashes).__name__}")
    fields["block_hashes"] = [_u64(h) for h in hashes]
    if tag == "BlockStored":
        parent = fields.get("parent_block_hash")
        fields["parent_block_hash"] = None if parent is None else _u64(parent)
        tokens = fields.get("token_ids")
        if isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], (list, tuple)):
            fields["token_ids"] = _tokens(tokens)
    if tag == "BlockStored":
        return msgspec.convert({k: v for k, v in fields.items() if k in STORED_FIELDS}, BlockStored, strict=True)
    return msgspec.convert({k: v for k, v in fields.items() if k in REMOVED_FIELDS}, BlockRemoved, strict=True)


def _batch_from_generic(raw: Any) -> KVEventBatch:
    ts: Any  # undecoded msgpack values, type-checked below
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise TypeError("batch is neither [ts, events, rank] nor a map")
    if type(ts) not in (float, int):
        raise TypeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, (list, tuple)):
        raise TypeError("batch events is not a list")
    if rank is not None and type(rank) is not int:
        raise TypeError(f"data_parallel_rank {rank!r} is not an integer")
    # converted, not built: the batch's own bounds (a finite time, a rank, a number of events) hold on this path too
    return msgspec.convert([float(ts), [_event_from_generic(e) for e in events], rank], KVEventBatch)


def decode_batch(payload: bytes, *, endpoint: str | None = None, seq: int | None = None) -> KVEventBatch:
    """Decode a payload of any vLLM version (or a peer emitter); ``WireDecodeError`` if impossible."""
    for decoder in _fast_decoders:
        try:
            raw = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            continue
        events = raw.events
        if type(raw) is KVEventBatch:
            for e in raw.events:
                if type(e) is not AllBlocksCleared and e.block_hashes and min(e.block_hashes) < 0 or (
                    type(e) is BlockStored and e.parent_block_hash is not None and e.parent_block_hash < 0
                ):
                    break
            else:
                return raw
        return KVEventBatch(ts=raw.ts, events=[_from_typed(e) for e in events], data_parallel_rank=raw.data_parallel_rank)
    try:
        return _batch_from_generic(_generic.decode(payload))
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError, KeyError, IndexError,
            AttributeError, OverflowError, RecursionError) as exc:
        raise WireDecodeError(str(exc), payload, endpoint=endpoint, seq=seq) from None

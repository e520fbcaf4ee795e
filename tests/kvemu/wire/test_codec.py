"""vLLM KV-event payloads: golden bytes per wire profile, decoder round trips and decoder tolerance.

The expected bytes are built here from the field tables of ``/work/shared/spec/vllm-kv-events.md`` §1
with plain Python lists/dicts and ``msgspec.msgpack.encode`` -- independently of kvemu's struct
machinery -- and stored in ``tests/data/kv_events_golden.json``. Each release from 0.11 has a second set
with the block hashes in bytes form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``): every hash a 32-byte
digest (``digest`` below, written out here again) whose last 8 bytes are the integer hash, so both sets
decode to the same events. Regenerate (and review the diff!) with

    python tests/kvemu/wire/test_codec.py --regen
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from kvemu.router_events import StorageTier
import kvemu
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.wire.codec import (BYTES_HASHES_SINCE, PROFILES, WireDecodeError, block_hash_digest, decode_batch,
                              encode_batch, profile_for)
from kvemu.wire.convert import convert_event, medium_to_tier
from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

GOLDEN_PATH = Path(__file__).parents[2] / "data" / "kv_events_golden.json"
U64 = 2**64 - 1

# --------------------------------------------------------------------------- the spec's field tables

# vllm-kv-events.md §1 "Field history": what each release adds, in wire order.
_STORED_ADDED = {
    (0, 9): ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"],
    (0, 10): [],
    (0, 11): ["medium"],
    (0, 16): ["lora_name"],
    (0, 20): ["extra_keys", "group_idx"],
    (0, 22): ["kv_cache_spec_kind", "kv_cache_spec_sliding_window"],
    (0, 24): [],
    (0, 26): ["locality"],
    (0, 30): ["ownership", "session_id"],
    (0, 33): ["lookahead_token_ids"],
}
_REMOVED_ADDED = {
    (0, 9): ["block_hashes"],
    (0, 10): [],
    (0, 11): ["medium"],
    (0, 16): [],
    (0, 20): ["group_idx"],
    (0, 22): [],
    (0, 24): [],
    (0, 26): ["locality"],
    (0, 30): ["ownership"],
    (0, 33): [],
}
# Fields declared without a default (always on the wire, also as nil, in map form).
SPEC_STORED_REQUIRED = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name"}
SPEC_REMOVED_REQUIRED = {"block_hashes", "medium"}
SPEC_VERSIONS = sorted(_STORED_ADDED)


def spec_fields(version: tuple[int, int]) -> tuple[list[str], list[str]]:
    """BlockStored and BlockRemoved fields of a release, in wire order (from the spec's history table)."""
    stored: list[str] = []
    removed: list[str] = []
    for v in SPEC_VERSIONS:
        if v <= version:
            stored += _STORED_ADDED[v]
            removed += _REMOVED_ADDED[v]
    return stored, removed


def spec_is_map(version: tuple[int, int]) -> bool:
    return version >= (0, 24)


def spec_has_rank(version: tuple[int, int]) -> bool:
    return version >= (0, 10)


# vLLM 0.11 is the first release whose events can carry digest bytes (ExternalBlockHash = bytes | int).
BYTES_VERSIONS = [v for v in SPEC_VERSIONS if v >= (0, 11)]


def digest(block_hash: int) -> bytes:
    """A block hash in bytes form: 32 bytes, the size of vLLM's default sha256 block hash, ending in the integer
    big-endian (vLLM's int form is the digest's low 64 bits); the first 24 are sha256 of those 8 bytes."""
    low = struct.pack(">Q", block_hash)
    return hashlib.sha256(low).digest()[:24] + low


def as_bytes_form(spec_batch: dict) -> dict:
    """``spec_batch`` with every block hash (stored, parent, removed) in bytes form."""
    events = []
    for ev in spec_batch["events"]:
        ev = dict(ev)
        if "block_hashes" in ev:
            ev["block_hashes"] = [digest(h) for h in ev["block_hashes"]]
        if ev.get("parent_block_hash") is not None:
            ev["parent_block_hash"] = digest(ev["parent_block_hash"])
        events.append(ev)
    return {**spec_batch, "events": events}


ALL_STORED, ALL_REMOVED = spec_fields((0, 33))

# --------------------------------------------------------------------------- the golden batches

# Events as plain dicts of every field (``None`` = unset); "type" names the event class.
BIG = 2**64 - 2  # >= 2**63: must go out as msgpack uint64
HEX = "0123456789abcdef" * 4


def _stored(**fields):
    out = {"type": "BlockStored", **{f: None for f in ALL_STORED}}
    out.update(fields)
    return out


def _removed(**fields):
    out = {"type": "BlockRemoved", **{f: None for f in ALL_REMOVED}}
    out.update(fields)
    return out


GOLDEN_BATCHES = {
    # The batch of the brief: 4 events, ts 1733.5, rank 2.
    "basic": {
        "ts": 1733.5,
        "data_parallel_rank": 2,
        "events": [
            _stored(block_hashes=[0x1234, BIG], parent_block_hash=None, token_ids=list(range(100, 132)),
                    block_size=16, medium="GPU", lora_name=None),
            _stored(block_hashes=[777], parent_block_hash=BIG, token_ids=list(range(200, 216)), block_size=16,
                    medium="GPU", lora_name="x"),
            _removed(block_hashes=[0x1234], medium="GPU"),
            {"type": "AllBlocksCleared"},
        ],
    },
    # Every field set (non-None), so that each release's projection and map-form omission show.
    "full": {
        "ts": 1733.5,
        "data_parallel_rank": 2,
        "events": [
            _stored(block_hashes=[5, 2**63], parent_block_hash=2**63 + 7, token_ids=list(range(32)), block_size=16,
                    lora_id=3, medium="CPU", lora_name="x", extra_keys=[None, [HEX]], group_idx=0,
                    kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=128, locality="local",
                    ownership="owned", session_id="s-1", lookahead_token_ids=[7, 8]),
            _removed(block_hashes=[2**63], medium="CPU", group_idx=0, locality="local", ownership="owned"),
            {"type": "AllBlocksCleared"},
        ],
    },
    # Nothing optional: nil parent and medium, no rank on the batch.
    "nils": {
        "ts": 0.25,
        "data_parallel_rank": None,
        "events": [
            _stored(block_hashes=[U64], parent_block_hash=None, token_ids=[1] * 16, block_size=16, medium=None),
            _removed(block_hashes=[U64], medium=None),
        ],
    },
}


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def independent_payload(spec_batch: dict, version: tuple[int, int]) -> bytes:
    """The payload vLLM ``version`` sends for ``spec_batch``, from the spec's field tables alone.

    Every value is ``msgspec.msgpack.encode``d from plain lists/dicts. One msgspec fact is modelled on
    top (pinned by ``test_msgspec_sizes_struct_map_headers_by_declared_fields``): a map-form struct's
    header is sized for *all* its declared fields plus the tag, so 0.33's ``BlockStored`` (15 fields +
    tag = 16 possible entries) always starts with a map16 header (``de 00 NN``), even for 8 entries.
    """
    stored, removed = spec_fields(version)
    events = []
    for ev in spec_batch["events"]:
        kind = ev["type"]
        names, required = {
            "BlockStored": (stored, SPEC_STORED_REQUIRED),
            "BlockRemoved": (removed, SPEC_REMOVED_REQUIRED),
            "AllBlocksCleared": ([], set()),
        }[kind]
        if spec_is_map(version):  # tag under "type" first, then fields; defaulted ones only when set
            out = {"type": kind}
            for name in names:
                if name in required or ev[name] is not None:
                    out[name] = ev[name]
            raw = msgspec.msgpack.encode(out)
            if len(names) + 1 >= 16 and raw[0] & 0xF0 == 0x80:  # fixmap -> map16 of the same count
                raw = b"\xde" + (raw[0] & 0x0F).to_bytes(2, "big") + raw[1:]
            events.append(raw)
        else:  # tag first, then every field of the release
            events.append(msgspec.msgpack.encode([kind] + [ev[name] for name in names]))
    parts = [msgspec.msgpack.encode(float(spec_batch["ts"])), _array_header(len(events)), *events]
    if spec_has_rank(version):
        parts.append(msgspec.msgpack.encode(spec_batch["data_parallel_rank"]))
    return _array_header(2 + spec_has_rank(version)) + b"".join(parts)


def kvemu_batch(spec_batch: dict) -> KVEventBatch:
    """The same batch as kvemu's version-neutral structs (every field given explicitly)."""
    events = []
    for ev in spec_batch["events"]:
        fields = {k: v for k, v in ev.items() if k != "type"}
        events.append({"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                       "AllBlocksCleared": AllBlocksCleared}[ev["type"]](**fields))
    return KVEventBatch(ts=spec_batch["ts"], events=events, data_parallel_rank=spec_batch["data_parallel_rank"])


def _vname(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def generate_golden() -> dict:
    return {
        "about": "vLLM KV-event payloads (msgpack hex) per wire profile; see tests/kvemu/wire/test_codec.py",
        "batches": GOLDEN_BATCHES,
        "payloads": {
            name: {_vname(v): independent_payload(batch, v).hex() for v in SPEC_VERSIONS}
            for name, batch in GOLDEN_BATCHES.items()
        },
        "bytes_hash_payloads": {
            name: {_vname(v): independent_payload(as_bytes_form(batch), v).hex() for v in BYTES_VERSIONS}
            for name, batch in GOLDEN_BATCHES.items()
        },
    }


def _load_golden() -> dict:
    return json.loads(GOLDEN_PATH.read_text())


# --------------------------------------------------------------------------- golden vectors


def test_profiles_are_the_spec_releases():
    assert sorted(PROFILES) == SPEC_VERSIONS
    for v, p in PROFILES.items():
        stored, removed = spec_fields(v)
        assert (p.stored_fields, p.removed_fields) == (len(stored), len(removed)), v
        assert p.map_events is spec_is_map(v)
        assert p.has_dp_rank is spec_has_rank(v)
        assert p.replay_topic is (v >= (0, 26))
        assert p.name == _vname(v)


def test_msgspec_sizes_struct_map_headers_by_declared_fields():
    """The msgspec behaviour the golden map-form vectors rely on (msgspec 0.23.0): header width follows
    the declared field count (+ tag), not the number of entries left after ``omit_defaults``."""
    for n, header in ((14, "82"), (15, "de0002"), (20, "de0002")):
        cls = msgspec.defstruct("S", [(f"f{i}", object, None) for i in range(n)], omit_defaults=True, tag=True)
        assert msgspec.msgpack.encode(cls(f0=1)).hex().startswith(header), n


def test_golden_file_is_current():
    golden = _load_golden()
    assert golden == json.loads(json.dumps(generate_golden())), \
        "regenerate: python tests/kvemu/wire/test_codec.py --regen"
    assert set(golden["payloads"]["basic"]) == {_vname(v) for v in PROFILES}


@pytest.mark.parametrize("name", sorted(GOLDEN_BATCHES))
@pytest.mark.parametrize("version", sorted(PROFILES), ids=_vname)
def test_encode_matches_golden_bytes(name, version):
    stored_hex = _load_golden()["payloads"][name][_vname(version)]
    expected = independent_payload(GOLDEN_BATCHES[name], version)
    got = encode_batch(kvemu_batch(GOLDEN_BATCHES[name]), PROFILES[version])
    assert got.hex() == stored_hex
    assert got == expected


@pytest.mark.parametrize("name", sorted(GOLDEN_BATCHES))
@pytest.mark.parametrize("version", BYTES_VERSIONS, ids=_vname)
def test_encode_bytes_form_matches_golden_bytes(name, version):
    stored_hex = _load_golden()["bytes_hash_payloads"][name][_vname(version)]
    expected = independent_payload(as_bytes_form(GOLDEN_BATCHES[name]), version)
    got = encode_batch(kvemu_batch(GOLDEN_BATCHES[name]), profile_for(_vname(version), "bytes"))
    assert got.hex() == stored_hex
    assert got == expected


@pytest.mark.parametrize("name", sorted(GOLDEN_BATCHES))
@pytest.mark.parametrize("version", BYTES_VERSIONS, ids=_vname)
def test_bytes_form_golden_decodes_as_the_int_form(name, version):
    golden = _load_golden()
    as_int = decode_batch(bytes.fromhex(golden["payloads"][name][_vname(version)]))
    as_bytes = decode_batch(bytes.fromhex(golden["bytes_hash_payloads"][name][_vname(version)]))
    assert as_bytes == as_int == project(kvemu_batch(GOLDEN_BATCHES[name]), version)


def test_bytes_form_exists_from_0_11_on():
    assert BYTES_HASHES_SINCE == (0, 11)
    assert set(_load_golden()["bytes_hash_payloads"]["basic"]) == {_vname(v) for v in PROFILES if v >= (0, 11)}
    assert len(BYTES_VERSIONS) >= 8
    for v in PROFILES:
        if v < (0, 11):
            with pytest.raises(InvalidArgument, match="bytes hashes need vLLM 0.11"):
                profile_for(_vname(v), "bytes")
        else:
            assert profile_for(_vname(v), "bytes") == PROFILES[v]._replace(bytes_hashes=True)
            assert profile_for(_vname(v), "int") is PROFILES[v] and not PROFILES[v].bytes_hashes
    with pytest.raises(InvalidArgument, match="'int' or 'bytes'"):
        profile_for("0.33", "hex")


def test_bytes_form_spot_checks():
    """A hash in bytes form is a msgpack bin8 of 32 bytes ending in the integer big-endian."""
    golden = _load_golden()["bytes_hash_payloads"]
    for version in ("0.11", "0.22", "0.33"):
        payload = bytes.fromhex(golden["basic"][version])
        for h in (0x1234, BIG, 777):
            assert b"\xc4\x20" + digest(h) in payload
        raw = msgspec.msgpack.decode(payload)
        first = raw[1][0]["block_hashes"] if version == "0.33" else raw[1][0][1]
        assert [len(x) for x in first] == [32, 32]
        assert [int.from_bytes(x, "big") & U64 for x in first] == [0x1234, BIG]
        assert b"\xcf" + BIG.to_bytes(8, "big") not in payload  # no hash goes out as an integer too
    assert block_hash_digest(BIG) == digest(BIG) and len(digest(0)) == 32
    assert block_hash_digest(-2) == digest(BIG)  # signed hashes are reinterpreted as u64 first, as decoding does


def test_bytes_form_indexes_the_same_blocks():
    """A chain of stores and an eviction, sent in either form, leaves the router's index in the same state."""
    rng = random.Random(5)
    tokens = [rng.getrandbits(32) for _ in range(6 * 16)]
    hashes = sequence_hashes(local_block_hashes(tokens, 16))
    events = [BlockStored(block_hashes=hashes[:2], parent_block_hash=None, token_ids=tokens[:32], block_size=16),
              BlockStored(block_hashes=hashes[2:6], parent_block_hash=hashes[1], token_ids=tokens[32:], block_size=16),
              BlockRemoved(block_hashes=[hashes[5]])]
    batch = KVEventBatch(ts=1.0, events=events, data_parallel_rank=1)
    for version in ("0.11", "0.22", "0.24", "0.33"):
        cores = {}
        for form in ("int", "bytes"):
            core = cores[form] = kvemu.RoutingCore(block_size=16)
            core.add_worker(kvemu.WorkerSpec(worker_id=3, dp_size=2))
            for ev in decode_batch(encode_batch(batch, profile_for(version, form))).events:
                converted = convert_event(ev, worker_id=3, dp_rank=1, block_size=16)
                assert converted is not None
                core.apply_event(converted)
        for form, core in cores.items():
            assert core.overlaps(core.prepare(tokens)) == {(3, 1): 5}, (version, form)
            assert [core.index.holds(3, h, 1) for h in hashes] == [True] * 5 + [False], (version, form)
            assert core.index.tree_size(3, 1) == 5


def test_golden_bytes_spot_checks():
    """A few byte-level facts of the spec, read straight off the stored vectors."""
    golden = _load_golden()["payloads"]["basic"]
    p09, p10, p22, p24 = (bytes.fromhex(golden[v]) for v in ("0.9", "0.10", "0.22", "0.24"))
    # batch arrays: 2 elements in 0.9, 3 from 0.10; ts as float64 (0xcb) 1733.5
    assert p09[0] == 0x92 and p10[0] == 0x93 and p24[0] == 0x93
    assert p09[1:10] == b"\xcb" + struct.pack(">d", 1733.5)
    assert p10.endswith(b"\x02")  # rank 2 last
    # array events have a fixed length per release: tag + 5 fields in 0.9, tag + 11 in 0.22
    assert msgspec.msgpack.decode(p09)[1][0][0] == "BlockStored" and len(msgspec.msgpack.decode(p09)[1][0]) == 6
    assert len(msgspec.msgpack.decode(p22)[1][0]) == 12 and len(msgspec.msgpack.decode(p22)[1][2]) == 4
    assert msgspec.msgpack.decode(p22)[1][3] == ["AllBlocksCleared"]
    # a hash >= 2**63 is a msgpack uint64 (0xcf), never a negative int64
    assert b"\xcf" + BIG.to_bytes(8, "big") in p24
    # map events: "type" first, nil-valued required fields present, defaulted nils absent
    ev = msgspec.msgpack.decode(p24)[1][0]
    assert list(ev) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                        "medium", "lora_name"]
    assert msgspec.msgpack.decode(p24)[1][3] == {"type": "AllBlocksCleared"}
    full33 = msgspec.msgpack.decode(bytes.fromhex(_load_golden()["payloads"]["full"]["0.33"]))
    assert list(full33[1][0]) == ["type", *ALL_STORED] and full33[1][0]["group_idx"] == 0
    assert list(full33[1][1]) == ["type", *ALL_REMOVED]


@pytest.mark.parametrize("name", sorted(GOLDEN_BATCHES))
@pytest.mark.parametrize("version", sorted(PROFILES), ids=_vname)
def test_golden_bytes_decode_to_the_projection(name, version):
    payload = bytes.fromhex(_load_golden()["payloads"][name][_vname(version)])
    assert decode_batch(payload) == project(kvemu_batch(GOLDEN_BATCHES[name]), version)


def test_profile_for():
    assert profile_for("0.25.1") is PROFILES[(0, 24)]
    assert profile_for("0.25") is PROFILES[(0, 24)]
    assert profile_for("0.9") is PROFILES[(0, 9)]
    assert profile_for("0.9.2") is PROFILES[(0, 9)]
    assert profile_for("0.12") is PROFILES[(0, 11)]
    assert profile_for("0.29.0") is PROFILES[(0, 26)]
    assert profile_for("0.33.0") is PROFILES[(0, 33)]
    assert profile_for("1.2") is PROFILES[(0, 33)]
    assert profile_for((0, 21)) is PROFILES[(0, 20)]
    assert profile_for() is PROFILES[(0, 33)]
    for bad in ("0.8", "0.8.9", "x.y", (0, 5)):
        with pytest.raises(InvalidArgument):
            profile_for(bad)


def test_spec_worked_example_decodes():
    tokens = list(range(64))
    payload = msgspec.msgpack.encode(
        [1733.0, [["BlockStored", [9000, 9001, 9002, 9003], None, tokens, 16, None, "GPU", None]], 0]
    )
    assert decode_batch(payload) == KVEventBatch(
        ts=1733.0,
        events=[BlockStored(block_hashes=[9000, 9001, 9002, 9003], parent_block_hash=None, token_ids=tokens,
                            block_size=16, lora_id=None, medium="GPU", lora_name=None)],
        data_parallel_rank=0,
    )
    follow = msgspec.msgpack.encode([1734.0, [{"type": "BlockStored", "block_hashes": [9100, 9101],
                                               "parent_block_hash": 9003, "token_ids": list(range(64, 96)),
                                               "block_size": 16, "medium": "GPU"}], 0])
    (ev,) = decode_batch(follow).events
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.medium) == ([9100, 9101], 9003,
                                                                                list(range(64, 96)), "GPU")


# --------------------------------------------------------------------------- round trips


def project(batch: KVEventBatch, version: tuple[int, int]) -> KVEventBatch:
    """What decoding release ``version``'s bytes of ``batch`` must give: the fields it carries, else None."""
    stored, removed = spec_fields(version)
    events = []
    for ev in batch.events:
        if type(ev) is BlockStored:
            events.append(BlockStored(**{f: (getattr(ev, f) if f in stored else None) for f in ALL_STORED}))
        elif type(ev) is BlockRemoved:
            events.append(BlockRemoved(**{f: (getattr(ev, f) if f in removed else None) for f in ALL_REMOVED}))
        else:
            events.append(ev)
    rank = batch.data_parallel_rank if spec_has_rank(version) else None
    return KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=rank)


u64s = st.integers(0, U64)
u32s = st.integers(0, 2**32 - 1)
short_text = st.text(max_size=12)
opt = st.none().__or__
extra_key = st.one_of(st.none(), st.integers(-(2**63), U64), short_text,
                      st.just(HEX), st.tuples(st.just(HEX), st.integers(0, 4096)).map(list))
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(u64s, min_size=1, max_size=6),
    parent_block_hash=opt(u64s),
    token_ids=st.lists(u32s, max_size=40),
    block_size=st.integers(1, 1024),
    lora_id=opt(st.integers(0, 2**31)),
    medium=opt(st.sampled_from(["GPU", "CPU", "DISK", "STORAGE", "weird"])),
    lora_name=opt(short_text),
    extra_keys=opt(st.lists(opt(st.lists(extra_key, max_size=3)), max_size=4)),
    group_idx=opt(st.integers(0, 8)),
    kv_cache_spec_kind=opt(st.sampled_from(["full_attention", "sliding_window", "mla_attention"])),
    kv_cache_spec_sliding_window=opt(st.integers(1, 2**20)),
    locality=opt(short_text),
    ownership=opt(short_text),
    session_id=opt(short_text),
    lookahead_token_ids=opt(st.lists(u32s, max_size=4)),
)
removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(u64s, min_size=1, max_size=4),
    medium=opt(st.sampled_from(["GPU", "CPU_TIER2", "NVME"])),
    group_idx=opt(st.integers(0, 8)),
    locality=opt(short_text),
    ownership=opt(short_text),
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=5),
    data_parallel_rank=opt(st.integers(0, 1023)),
)


@pytest.mark.parametrize("version", sorted(PROFILES), ids=_vname)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches)
def test_round_trip(version, batch):
    payload = encode_batch(batch, PROFILES[version])
    assert payload == independent_payload(
        {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
         "events": [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]},
        version,
    )
    assert decode_batch(payload) == project(batch, version)


@pytest.mark.parametrize("version", BYTES_VERSIONS, ids=_vname)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches)
def test_bytes_form_round_trip(version, batch):
    payload = encode_batch(batch, profile_for(_vname(version), "bytes"))
    as_dict = {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
               "events": [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]}
    assert payload == independent_payload(as_bytes_form(as_dict), version)
    assert decode_batch(payload) == decode_batch(encode_batch(batch, PROFILES[version])) == project(batch, version)


# --------------------------------------------------------------------------- tolerance


def _stored_array(*fields):
    return ["BlockStored", *fields]


def test_map_batch_is_accepted():
    raw = {"ts": 2.5, "events": [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}],
           "data_parallel_rank": 3}
    assert decode_batch(msgspec.msgpack.encode(raw)) == KVEventBatch(
        ts=2.5, events=[BlockRemoved(block_hashes=[1], medium="GPU")], data_parallel_rank=3
    )
    del raw["data_parallel_rank"]
    assert decode_batch(msgspec.msgpack.encode(raw)).data_parallel_rank is None


def test_two_element_batch_and_nil_rank_give_no_rank():
    ev = ["BlockRemoved", [4], "GPU"]
    assert decode_batch(msgspec.msgpack.encode([1.0, [ev]])).data_parallel_rank is None
    assert decode_batch(msgspec.msgpack.encode([1.0, [ev], None])).data_parallel_rank is None
    assert decode_batch(msgspec.msgpack.encode([1.0, [ev], 0])).data_parallel_rank == 0


def test_integer_ts_is_a_float():
    got = decode_batch(msgspec.msgpack.encode([7, [], 0]))
    assert got.ts == 7.0 and type(got.ts) is float


def test_extra_trailing_fields_and_unknown_keys_are_ignored():
    tokens = list(range(16))
    base = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0)
    arr = _stored_array([1], None, tokens, 16, None, "GPU", None, None, 0, None, None, None, None, None, None,
                        "future-field", [1, 2], {"x": 1})
    rem = ["BlockRemoved", [1], "GPU", None, None, None, "future", 5]
    got = decode_batch(msgspec.msgpack.encode([1.0, [arr, rem, ["AllBlocksCleared", "future"]], 1, "more"]))
    assert got == KVEventBatch(ts=1.0, events=[base, BlockRemoved(block_hashes=[1], medium="GPU"),
                                               AllBlocksCleared()], data_parallel_rank=1)
    as_map = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens,
              "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
              "block_mm_infos": [None], "future": {"a": [1]}}
    got = decode_batch(msgspec.msgpack.encode([1.0, [as_map, {"type": "AllBlocksCleared", "why": "reset"}], 1]))
    assert got.events == [base, AllBlocksCleared()]


def test_mocker_style_map_without_lora_and_medium():
    """Dynamo's mocker omits lora_id/medium/lora_name (spec §4): still a device-tier store."""
    ev = {"type": "BlockStored", "block_hashes": [3, 4], "parent_block_hash": None, "token_ids": list(range(32)),
          "block_size": 16, "group_idx": 0}
    (got,) = decode_batch(msgspec.msgpack.encode([1.0, [ev], 0])).events
    assert type(got) is BlockStored
    assert (got.block_hashes, got.parent_block_hash, got.token_ids, got.block_size, got.group_idx) == (
        [3, 4], None, list(range(32)), 16, 0)
    assert got.lora_id is None and got.lora_name is None
    # absent medium: None through the generic path, "GPU" through the typed map path -- both the device tier
    assert medium_to_tier(got.medium) is StorageTier.DEVICE


@pytest.mark.parametrize("form", ["array", "map"])
def test_signed_hashes_are_reinterpreted_as_u64(form):
    tokens = list(range(16))
    if form == "array":
        events = [_stored_array([-1, -(2**63), 5], -2, tokens, 16), ["BlockRemoved", [-3], None]]
    else:
        events = [{"type": "BlockStored", "block_hashes": [-1, -(2**63), 5], "parent_block_hash": -2,
                   "token_ids": tokens, "block_size": 16},
                  {"type": "BlockRemoved", "block_hashes": [-3], "medium": None}]
    stored, removed = decode_batch(msgspec.msgpack.encode([1.0, events, 0])).events
    assert stored.block_hashes == [U64, 2**63, 5]
    assert stored.parent_block_hash == U64 - 1
    assert removed.block_hashes == [U64 - 2]


def test_bytes_hashes_are_their_low_64_bits_big_endian():
    digest = bytes(range(32))  # a sha256-sized digest
    parent = bytes(range(100, 132))
    events = [_stored_array([digest, b"\x01\x02"], parent, list(range(32)), 16, None, "GPU", None),
              ["BlockRemoved", [digest], "GPU"]]
    stored, removed = decode_batch(msgspec.msgpack.encode([1.0, events, 0])).events
    assert stored.block_hashes == [int.from_bytes(digest[-8:], "big"), 0x0102]
    assert stored.parent_block_hash == int.from_bytes(parent[-8:], "big")
    assert removed.block_hashes == [int.from_bytes(digest[-8:], "big")]


@pytest.mark.parametrize("form", ["array", "map"])
def test_eagle_token_pairs_are_unfolded(form):
    pairs = [[10, 11], [11, 12], [12, 13], [13, 14]]
    if form == "array":
        ev = _stored_array([1], None, pairs, 3, None, "GPU", None)
    else:
        ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": pairs,
              "block_size": 3, "lora_id": None, "medium": "GPU", "lora_name": None}
    (got,) = decode_batch(msgspec.msgpack.encode([1.0, [ev], 0])).events
    assert got.token_ids == [10, 11, 12, 13, 14]


# --------------------------------------------------------------------------- errors


def _enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


VALID = _enc([1.0, [_stored_array([1, 2], None, list(range(32)), 16, None, "GPU", None)], 0])
GARBAGE = {
    "empty": b"",
    "reserved-byte": b"\xc1",
    "text": b"hello, world",
    "truncated": VALID[:-5],
    "truncated-header": VALID[:2],
    "huge-declared-array": b"\xdd\xff\xff\xff\xff",
    "int": _enc(5),
    "string": _enc("batch"),
    "nil": _enc(None),
    "one-element": _enc([1.0]),
    "events-not-a-list": _enc([1.0, 5, 0]),
    "events-a-map": _enc([1.0, {"a": 1}, 0]),
    "ts-nil": _enc([None, [], 0]),
    "ts-list": _enc([[1], [], 0]),
    "rank-string": _enc([1.0, [], "0"]),
    "rank-float": _enc([1.0, [], 1.5]),
    "event-empty-array": _enc([1.0, [[]], 0]),
    "event-int": _enc([1.0, [7], 0]),
    "unknown-tag": _enc([1.0, [["BlockMoved", [1]]], 0]),
    "unknown-map-type": _enc([1.0, [{"type": "BlockMoved"}], 0]),
    "map-without-type": _enc([1.0, [{"block_hashes": [1]}], 0]),
    "stored-tag-only": _enc([1.0, [["BlockStored"]], 0]),
    "hashes-nil": _enc([1.0, [_stored_array(None, None, [1] * 16, 16)], 0]),
    "hash-float": _enc([1.0, [["BlockRemoved", [1.5]]], 0]),
    "hash-string": _enc([1.0, [["BlockRemoved", ["ab"]]], 0]),
    "hash-nil": _enc([1.0, [["BlockRemoved", [None]]], 0]),
    "parent-string": _enc([1.0, [_stored_array([1], "p", [1] * 16, 16)], 0]),
    "block-size-nil": _enc([1.0, [_stored_array([1], None, [1] * 16, None)], 0]),
    "token-nil": _enc([1.0, [_stored_array([1], None, [None] * 16, 16)], 0]),
    "token-pair-empty": _enc([1.0, [_stored_array([1], None, [[]], 16)], 0]),
    "map-batch-without-ts": _enc({"events": []}),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_undecodable_payloads_raise_wire_decode_error(name):
    payload = GARBAGE[name]
    with pytest.raises(WireDecodeError) as info:
        decode_batch(payload, endpoint="tcp://10.0.0.7:5557", seq=41)
    err = info.value
    assert err.endpoint == "tcp://10.0.0.7:5557" and err.seq == 41
    assert err.head == payload[:32]
    msg = str(err)
    assert "tcp://10.0.0.7:5557" in msg and "seq 41" in msg and payload[:32].hex() in msg
    assert isinstance(err, ValueError)


def test_error_without_origin_still_shows_the_bytes():
    with pytest.raises(WireDecodeError) as info:
        decode_batch(b"\xc1\xc1")
    assert info.value.endpoint is None and info.value.seq is None
    assert "c1c1" in str(info.value) and " from " not in str(info.value)


# Wrong field types that no vLLM release (nor any known peer) sends: the decoder rejects them.
WRONG_TYPES = {
    "medium-int": _enc([1.0, [["BlockRemoved", [1], 5]], 0]),
    "lora-name-int": _enc([1.0, [_stored_array([1], None, [1] * 16, 16, None, "GPU", 7)], 0]),
    "block-size-string": _enc([1.0, [_stored_array([1], None, [1] * 16, "16")], 0]),
    "token-ids-string": _enc([1.0, [_stored_array([1], None, "1234567890123456", 16)], 0]),
    "token-ids-float": _enc([1.0, [_stored_array([1], None, [1.5] * 16, 16)], 0]),
    "extra-keys-int": _enc([1.0, [_stored_array([1], None, [1] * 16, 16, None, "GPU", None, 5)], 0]),
    "kind-list": _enc([1.0, [_stored_array([1], None, [1] * 16, 16, None, "GPU", None, None, None, [1])], 0]),
    "group-idx-string": _enc([1.0, [["BlockRemoved", [1], "GPU", "zero"]], 0]),
    "ts-string": _enc(["1.5", [], 0]),
    "rank-bool": _enc([1.0, [], True]),
}


@pytest.mark.parametrize("name", sorted(WRONG_TYPES))
def test_wrong_field_types_raise_wire_decode_error(name):
    try:
        got = decode_batch(WRONG_TYPES[name], endpoint="e", seq=1)
    except WireDecodeError:
        return
    raise AssertionError(f"decoded to {got!r}")


def test_deeply_nested_payload_is_a_wire_decode_error():
    with pytest.raises(WireDecodeError):
        decode_batch(b"\x91" * 5000 + b"\xc0")


def test_moderately_nested_payload_is_a_wire_decode_error():
    with pytest.raises(WireDecodeError):
        decode_batch(b"\x91" * 500 + b"\xc0")


def _well_formed_or_error(payload: bytes) -> None:
    try:
        got = decode_batch(payload, endpoint="tcp://h:1", seq=3)
    except WireDecodeError as err:
        assert err.seq == 3 and err.endpoint == "tcp://h:1"
        return
    assert type(got) is KVEventBatch
    assert type(got.ts) is float
    for ev in got.events:
        assert type(ev) in (BlockStored, BlockRemoved, AllBlocksCleared)
        if type(ev) is not AllBlocksCleared:
            assert all(type(h) is int and 0 <= h <= U64 for h in ev.block_hashes)
        if type(ev) is BlockStored:
            assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash <= U64
            assert all(isinstance(t, int) for t in ev.token_ids)


# Random msgpack values, biased towards batch shapes so that the event-level code is reached.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), U64), st.floats(), st.text(max_size=8),
                    st.binary(max_size=40), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared",
                                                             "type", "ts", "events", "data_parallel_rank"]))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(
                                ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium",
                                 "ts", "events"])), inner, max_size=5)),
    max_leaves=12,
)
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])
event_like = st.one_of(
    st.tuples(TAGS, st.lists(values, max_size=12)).map(lambda t: [t[0], *t[1]]),
    st.tuples(TAGS, st.dictionaries(st.sampled_from(["block_hashes", "parent_block_hash", "token_ids", "block_size",
                                                     "medium", "lora_name", "group_idx"]), values, max_size=7)
              ).map(lambda t: {"type": t[0], **t[1]}),
)
batch_like = st.one_of(
    values,
    st.tuples(st.one_of(st.floats(), values), st.lists(st.one_of(event_like, values), max_size=4),
              values).map(list),
    st.tuples(st.floats(), st.lists(event_like, max_size=4)).map(list),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=batch_like)
def test_decoder_on_random_msgpack_values_gives_batch_or_wire_decode_error(obj):
    _well_formed_or_error(msgspec.msgpack.encode(obj))


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=200))
def test_decoder_on_random_bytes_gives_batch_or_wire_decode_error(data):
    _well_formed_or_error(data)


@settings(max_examples=200, deadline=None)
@given(batch=batches, cut=st.integers(0, 10_000), flip=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_decoder_on_damaged_real_payloads_gives_batch_or_wire_decode_error(batch, cut, flip, byte):
    for profile in PROFILES.values():
        payload = bytearray(encode_batch(batch, profile))
        _well_formed_or_error(bytes(payload[: cut % (len(payload) + 1)]))
        payload[flip % len(payload)] = byte
        _well_formed_or_error(bytes(payload))


if __name__ == "__main__":
    if sys.argv[1:] == ["--regen"]:
        GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN_PATH.write_text(json.dumps(generate_golden(), indent=1) + "\n")
        print(f"wrote {GOLDEN_PATH}")
    else:
        print(__doc__)

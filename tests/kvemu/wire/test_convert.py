"""Dynamo's conversion rules from vLLM wire events to router events (dynamo-reference.md §11.3)."""

from __future__ import annotations

import random

import msgspec
import pytest

import kvemu
from kvemu.errors import KvCacheEventError
from kvemu.router_events import AllCleared, BlocksRemoved, BlocksStored, RouterEvent, StorageTier
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.wire.codec import decode_batch
from kvemu.group_index import group_of, group_tag
from kvemu.wire.convert import MAIN_GROUP_KINDS, BlockSizeMismatch, MissingTokens, convert_event, medium_to_tier
from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 16
rng = random.Random(1234)
TOKENS = [rng.getrandbits(32) for _ in range(4 * BS)]
LOCALS = local_block_hashes(TOKENS, BS)
HASHES = sequence_hashes(LOCALS)  # engine-like external hashes
HEX_A = "0123456789abcdef" * 4
HEX_B = "fedcba9876543210" * 4


def stored(n=4, *, start=0, tokens=TOKENS, hashes=HASHES, parent=None, **kw) -> BlockStored:
    kw.setdefault("block_size", BS)
    return BlockStored(block_hashes=list(hashes[start:start + n]), parent_block_hash=parent,
                       token_ids=list(tokens[start * BS:(start + n) * BS]), **kw)


def conv(ev, **kw):
    args = dict(worker_id=3, dp_rank=1, block_size=BS, event_id=9)
    args.update(kw)
    return convert_event(ev, **args)


# --------------------------------------------------------------------------- stored blocks


def test_stored_event_recomputes_local_hashes_from_token_ids():
    got = conv(stored())
    assert got == RouterEvent(worker_id=3, dp_rank=1, data=BlocksStored(HASHES, LOCALS, None),
                              tier=StorageTier.DEVICE, event_id=9)
    assert got.data.local_hashes == local_block_hashes(TOKENS, BS)
    assert got.data.block_hashes == HASHES  # the engine's hashes become the external hashes


def test_stored_event_with_parent_hashes_only_its_own_blocks():
    got = conv(stored(2, start=2, parent=HASHES[1]))
    assert got.data == BlocksStored(HASHES[2:], LOCALS[2:], HASHES[1])


def test_local_hashes_do_not_depend_on_the_engine_hashes():
    got = conv(stored(hashes=[11, 12, 13, 2**64 - 1]))
    assert got.data.local_hashes == LOCALS and got.data.block_hashes == [11, 12, 13, 2**64 - 1]


@pytest.mark.parametrize("bs", [1, 4, 32, 64])
def test_other_block_sizes(bs):
    tokens = [random.Random(bs).getrandbits(32) for _ in range(2 * bs)]
    ev = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens, block_size=bs)
    assert conv(ev, block_size=bs).data.local_hashes == local_block_hashes(tokens, bs)


def test_lora_name_changes_the_local_hashes():
    plain = conv(stored()).data.local_hashes
    lora = conv(stored(lora_name="x")).data.local_hashes
    assert lora == local_block_hashes(TOKENS, BS, lora_name="x")
    assert all(a != b for a, b in zip(plain, lora))
    assert conv(stored(lora_name="y")).data.local_hashes != lora
    assert conv(stored(lora_name="")).data.local_hashes == plain  # empty name = no adapter
    assert conv(stored(lora_id=7)).data.local_hashes == plain  # the deprecated id does not take part


def test_lora_store_matches_only_lora_requests():
    core = kvemu.RoutingCore(block_size=BS)
    core.apply_event(conv(stored(lora_name="x"), dp_rank=0))
    assert core.overlaps(core.prepare(TOKENS, lora_name="x")) == {(3, 0): 4}
    assert core.overlaps(core.prepare(TOKENS)) == {}


def test_eagle_hashes_windows_of_block_size_plus_one():
    ev = BlockStored(block_hashes=HASHES[:3], parent_block_hash=None, token_ids=TOKENS[: 3 * BS + 1], block_size=BS)
    got = conv(ev, eagle=True)
    assert got.data.local_hashes == local_block_hashes(TOKENS[: 3 * BS + 1], BS, eagle=True)
    assert got.data.local_hashes != LOCALS[:3]
    with pytest.raises(MissingTokens):  # eagle needs the one look-ahead token
        conv(stored(3), eagle=True)


def test_eagle_pairs_on_the_wire_convert_like_flat_tokens():
    pairs = [[TOKENS[i], TOKENS[i + 1]] for i in range(2 * BS)]
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", HASHES[:2], None, pairs, BS, None, "GPU", None]], 0])
    (ev,) = decode_batch(payload).events
    assert ev.token_ids == TOKENS[: 2 * BS + 1]
    assert conv(ev, eagle=True).data.local_hashes == local_block_hashes(TOKENS[: 2 * BS + 1], BS, eagle=True)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("engine_bs", [8, 32, 15])
def test_block_size_mismatch_is_loud(engine_bs):
    ev = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(2 * engine_bs)),
                     block_size=engine_bs)
    with pytest.raises(BlockSizeMismatch) as info:
        convert_event(ev, worker_id=42, dp_rank=3, block_size=BS)
    msg = str(info.value)
    assert "worker 42" in msg and "rank 3" in msg and str(engine_bs) in msg and str(BS) in msg
    assert isinstance(info.value, KvCacheEventError)


def test_missing_tokens():
    with pytest.raises(MissingTokens) as info:
        conv(BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(BS + 3)), block_size=BS))
    assert "worker 3" in str(info.value) and "rank 1" in str(info.value)
    assert isinstance(info.value, KvCacheEventError)
    with pytest.raises(MissingTokens):
        conv(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=BS))


# --------------------------------------------------------------------------- filters


@pytest.mark.parametrize("group_idx,kept", [(None, True), (0, True), (1, False), (3, False)])
def test_non_main_kv_groups_are_dropped(group_idx, kept):
    got = conv(stored(group_idx=group_idx))
    assert (got is not None) is kept
    # a removal names only its group: another group's comes tagged with it (kvemu.group_index), for the router to
    # apply to that group (or, a full-attention group's, to the prefix index)
    rem = conv(BlockRemoved(block_hashes=[HASHES[0]], group_idx=group_idx))
    assert rem is not None
    if kept:
        assert rem.data.block_hashes == [HASHES[0]]
    else:
        assert [group_of(h) for h in rem.data.block_hashes] == [group_idx]
        assert [h & (2**64 - 1) for h in rem.data.block_hashes] == [HASHES[0]]


@pytest.mark.parametrize("kind", sorted(MAIN_GROUP_KINDS) + ["sliding_window", "chunked_local_attention",
                                                            "mamba", "cross_attention", ""])
@pytest.mark.parametrize("group_idx", [None, 0, 1])
def test_kv_cache_spec_kind_decides_when_present(kind, group_idx):
    window = 9 if kind == "sliding_window" else None
    got = conv(stored(group_idx=group_idx, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))
    if kind in {"full_attention", "mla_attention", "sink_full_attention"}:  # group 0 plain, another tagged
        tag = group_tag(group_idx, 0) if group_idx else 0
        assert got is not None and got.data.block_hashes == [h | tag for h in HASHES]
        assert got.data.local_hashes == LOCALS
    elif kind in ("sliding_window", "mamba"):  # a hybrid model's other group: kept aside for the router, tagged
        target = -(-(9 - 1) // BS) if kind == "sliding_window" else 1
        assert got.data.block_hashes == [h | group_tag(group_idx or 0, target) for h in HASHES]
        assert got.data.local_hashes == []
    else:
        assert got is None


def test_main_group_kinds_are_the_spec_list():
    assert MAIN_GROUP_KINDS == {"full_attention", "mla_attention", "sink_full_attention"}


def test_a_dropped_group_does_not_need_matching_block_size_or_tokens():
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=BS * 2, group_idx=1)
    assert conv(ev) is None


# Dynamo's mapping stated as its source states it, tier by tier (no medium at all counts as the device)
TIER_MEDIA = {
    StorageTier.DEVICE: [None, "GPU", "DEVICE"],
    StorageTier.HOST_PINNED: ["CPU", "CPU_PINNED", "CPU_TIER1"],
    StorageTier.DISK: ["CPU_TIER2", "DISK", "NVME", "STORAGE"],
    StorageTier.EXTERNAL: ["EXTERNAL", "NETWORK", "REMOTE", "SHARED"],
}
MEDIA = {medium: tier for tier, media in TIER_MEDIA.items() for medium in media}


@pytest.mark.parametrize("medium", list(MEDIA), ids=str)
def test_medium_to_tier_table(medium):
    tier = MEDIA[medium]
    assert medium_to_tier(medium) is tier
    assert conv(stored(medium=medium)).tier is tier
    assert conv(BlockRemoved(block_hashes=[1], medium=medium)).tier is tier


def test_unknown_medium_counts_as_device():
    assert medium_to_tier("QUANTUM") is StorageTier.DEVICE


def test_lower_tier_stores_do_not_feed_the_device_index():
    core = kvemu.RoutingCore(block_size=BS)
    core.apply_event(conv(stored(medium="CPU"), dp_rank=0))
    prepared = core.prepare(TOKENS)
    assert core.overlaps(prepared) == {}
    assert core.tier_indexes[StorageTier.HOST_PINNED].find_matches(LOCALS) == {(3, 0): 4}


# --------------------------------------------------------------------------- duplicates


@pytest.mark.parametrize("hashes,parent", [([5, 6, 5], None), ([5, 5], None), ([5, 6], 6), ([7, 8], 7),
                                           ([9], 9)])
def test_repeated_hashes_drop_the_event(hashes, parent):
    ev = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=TOKENS[: len(hashes) * BS],
                     block_size=BS)
    assert conv(ev) is None


def test_repeated_hashes_are_dropped_before_the_block_size_check():
    ev = BlockStored(block_hashes=[5, 5], parent_block_hash=None, token_ids=[1] * 64, block_size=32)
    assert conv(ev) is None


# --------------------------------------------------------------------------- removal / clear


def test_removal():
    got = conv(BlockRemoved(block_hashes=[HASHES[3], HASHES[2]]))
    assert got == RouterEvent(worker_id=3, dp_rank=1, data=BlocksRemoved([HASHES[3], HASHES[2]]),
                              tier=StorageTier.DEVICE, event_id=9)


def test_all_blocks_cleared():
    got = conv(AllBlocksCleared())
    assert got == RouterEvent(worker_id=3, dp_rank=1, data=AllCleared(), event_id=9)


def test_converted_events_drive_the_index():
    """The spec's worked example (§11.3): 4 device blocks, then a map event extends the chain to 6."""
    core = kvemu.RoutingCore(block_size=BS)
    core.add_worker(kvemu.WorkerSpec(worker_id=3, dp_size=4))
    tokens = list(range(96))
    first = msgspec.msgpack.encode(
        [1733.0, [["BlockStored", [9000, 9001, 9002, 9003], None, tokens[:64], 16, None, "GPU", None]], 0])
    follow = msgspec.msgpack.encode([1734.0, [{"type": "BlockStored", "block_hashes": [9100, 9101],
                                               "parent_block_hash": 9003, "token_ids": tokens[64:],
                                               "block_size": 16, "medium": "GPU"}], 0])
    prepared = core.prepare(tokens)
    for payload, depth in ((first, 4), (follow, 6)):
        batch = decode_batch(payload)
        for ev in batch.events:
            core.apply_event(convert_event(ev, worker_id=3, dp_rank=batch.data_parallel_rank, block_size=BS))
        assert core.overlaps(prepared) == {(3, 0): depth}
    core.apply_event(conv(BlockRemoved(block_hashes=[9101]), dp_rank=0))
    assert core.overlaps(prepared) == {(3, 0): 5}
    core.apply_event(conv(AllBlocksCleared(), dp_rank=0))
    assert core.overlaps(prepared) == {}


# --------------------------------------------------------------------------- multimodal extra_keys


def _mm(hex_id: str) -> int:
    return int(hex_id[:16], 16)


@pytest.mark.parametrize("key", [HEX_A, [HEX_A, 0], [HEX_A, 7], HEX_A.upper()],
                         ids=["plain", "pair0", "pair7", "upper"])
def test_mm_hash_in_extra_keys_changes_that_block_only(key):
    ev = stored(extra_keys=[None, [key], None, None])
    got = conv(ev).data.local_hashes
    assert got == local_block_hashes(TOKENS, BS, block_mm_hashes={1: [_mm(HEX_A)]})
    assert got[0] == LOCALS[0] and got[2:] == LOCALS[2:] and got[1] != LOCALS[1]


def test_several_mm_objects_in_one_block_and_in_several_blocks():
    ev = stored(extra_keys=[[HEX_B, HEX_A], None, [[HEX_A, 3]], []])
    got = conv(ev).data.local_hashes
    assert got == local_block_hashes(TOKENS, BS, block_mm_hashes={0: [_mm(HEX_A), _mm(HEX_B)], 2: [_mm(HEX_A)]})
    assert got[1] == LOCALS[1] and got[3] == LOCALS[3]


@pytest.mark.parametrize("key", [
    "lora-adapter", "salt:abc", "g" * 64, HEX_A[:63], HEX_A + "0", 12345, None, ["salt", 1],
], ids=["lora", "salt", "non-hex-64", "63-hex", "65-hex", "int", "none", "pair-non-hex"])
def test_other_extra_keys_do_not_change_hashes(key):
    assert conv(stored(extra_keys=[[key], [key], [key], [key]])).data.local_hashes == LOCALS


def test_mm_keys_beyond_the_event_blocks_are_ignored():
    assert conv(stored(2, extra_keys=[None, None, [HEX_A]])).data.local_hashes == LOCALS[:2]


@pytest.mark.reference
def test_mm_hashes_match_the_reference_binding(dynamo_core):
    core = dynamo_core
    ev = stored(extra_keys=[None, [[HEX_A, 0]], [HEX_B, HEX_A], None], lora_name="x")
    infos = [None, {"mm_objects": [{"mm_hash": _mm(HEX_A), "offsets": [[0, 1]]}]},
             {"mm_objects": [{"mm_hash": _mm(HEX_B), "offsets": [[0, 1]]},
                             {"mm_hash": _mm(HEX_A), "offsets": [[0, 1]]}]}, None]
    expected = core.compute_block_hash_for_seq(TOKENS, BS, block_mm_infos=infos, lora_name="x")
    assert conv(ev).data.local_hashes == expected

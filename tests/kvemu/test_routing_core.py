"""RoutingCore end to end: prepare → eligibility → select → book → prefill complete → free."""

import pytest

from kvemu.config import RouterConfig, RouterOverrides
from kvemu.errors import DuplicateWorker, InvalidArgument, NoEndpoints, UnknownWorker
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore


def make(workers=2, dp=2, **kw):
    core = RoutingCore(block_size=4, seed=0, **kw)
    for w in range(1, workers + 1):
        core.add_worker(WorkerSpec(worker_id=w, dp_size=dp))
    return core


def test_booking_steers_the_next_identical_request_by_cache_and_load():
    core = make()
    tokens = list(range(32))
    req = core.prepare(tokens, request_id="r1")
    sel = core.select(req)
    core.book("r1", sel, req)
    # the engine reports the blocks it cached for that rank
    core.index.store(sel.worker_id, req.local_hashes, req.seq_hashes, dp_rank=sel.dp_rank)
    core.prefill_complete("r1")
    again = core.select(core.prepare(tokens))
    assert again.key == sel.key and again.overlap_blocks == 8
    # blocks still active on that rank are not counted again
    assert again.potential_decode_blocks == 8
    assert core.free("r1") == sel.key


def test_booking_uses_effective_prefill_tokens():
    core = make(workers=1, dp=1)
    req = core.prepare(list(range(30)))
    core.index.store(1, req.local_hashes[:5], req.seq_hashes[:5])
    sel = core.select(req)
    assert sel.cached_tokens == 20 and sel.prefill_tokens == 10
    core.book("r", sel, req)
    assert core.load.rank((1, 0)).active_prefill_tokens == 10
    loads = core.potential_loads(req)
    assert loads[0].additional_active_blocks == 0 and loads[0].active_requests == 1


def test_no_kv_reuse_books_unshared_blocks():
    core = make(workers=1, dp=1, config=RouterConfig(router_assume_kv_reuse=False))
    a, b = core.prepare(list(range(16))), core.prepare(list(range(16)))
    core.book("a", core.select(a), a)
    core.book("b", core.select(b), b)
    assert core.load.rank((1, 0)).active_decode_blocks == 8


def test_untracked_prefill_override_books_zero_tokens():
    core = make(workers=1, dp=1)
    req = core.prepare(list(range(16)), overrides=RouterOverrides(track_prefill_tokens=False))
    core.book("a", core.select(req), req)
    assert core.load.rank((1, 0)).active_prefill_tokens == 0


def test_remove_worker_forgets_index_and_load_and_returns_dropped_requests():
    core = make()
    req = core.prepare(list(range(8)))
    core.index.store(1, req.local_hashes, req.seq_hashes, dp_rank=1)
    core.book("x", core.select(req, core.eligibility().pin(1, 1).build()), req)
    assert core.remove_worker(1) == ["x"]
    assert core.overlaps(req) == {}
    assert all(k[0] == 2 for k in core.eligibility().build().ranks)
    with pytest.raises(NoEndpoints):
        core.select(req, core.eligibility().pin(1, 0).build())
    with pytest.raises(UnknownWorker, match="worker 1 is not registered"):
        core.remove_worker(1)


def test_worker_with_other_block_size_is_rejected_loudly():
    core = make(workers=0)
    with pytest.raises(InvalidArgument, match="block_size 16 but the router uses 4"):
        core.add_worker(WorkerSpec(worker_id=5, block_size=16))
    assert len(core.registry) == 0
    core.add_worker(WorkerSpec(worker_id=5, block_size=4))
    with pytest.raises(DuplicateWorker, match="worker 5 is already registered"):
        core.add_worker(WorkerSpec(worker_id=5))


def test_prepare_validates_input():
    core = make()
    with pytest.raises(InvalidArgument, match="tokens: the prompt is empty"):
        core.prepare([])
    with pytest.raises(InvalidArgument, match="tokens or local_hashes"):
        core.prepare()
    with pytest.raises(InvalidArgument, match="tokens: every token id"):
        core.prepare([1, -2, 3, 4])
    p = core.prepare(local_hashes=[5, 6, 7])
    assert p.isl == 12 and len(p.seq_hashes) == 3


def test_lora_and_namespace_separate_cache_identities():
    core = make(workers=1, dp=1)
    plain = core.prepare(list(range(8)))
    lora = core.prepare(list(range(8)), lora_name="adapter")
    ns = core.prepare(list(range(8)), cache_namespace="tenant")
    assert len({tuple(plain.local_hashes), tuple(lora.local_hashes), tuple(ns.local_hashes)}) == 3


def test_fenced_worker_is_skipped_until_unfenced():
    core = make(workers=2, dp=1)
    core.registry.fence(1)
    assert core.eligibility().build().ranks == ((2, 0),)
    core.registry.unfence(1)
    assert core.eligibility().build().ranks == ((1, 0), (2, 0))


def test_worker_spec_validation_names_fields():
    with pytest.raises(InvalidArgument, match="dp_size"):
        WorkerSpec(worker_id=1, dp_size=0)
    with pytest.raises(InvalidArgument, match="total_kv_blocks"):
        WorkerSpec(worker_id=1, total_kv_blocks=0)
    with pytest.raises(InvalidArgument, match="block_size must be a positive integer"):
        RoutingCore(block_size=0)


def stored(worker, req, n, *, rank=0, tier=None, parent=None, start=0):
    from kvemu.router_events import BlocksStored, RouterEvent, StorageTier

    data = BlocksStored(req.seq_hashes[start:n], req.local_hashes[start:n], parent)
    return RouterEvent(worker_id=worker, dp_rank=rank, data=data,
                       tier=tier or StorageTier.DEVICE)


def test_events_feed_device_and_lower_tier_indexes():
    from kvemu.router_events import AllCleared, BlocksRemoved, RouterEvent, StorageTier

    core = make(workers=2, dp=1)
    req = core.prepare(list(range(40)))  # 10 blocks
    core.apply_event(stored(1, req, 2))
    core.apply_event(stored(1, req, 6, tier=StorageTier.HOST_PINNED))
    core.apply_event(stored(1, req, 9, tier=StorageTier.DISK))
    core.apply_event(stored(2, req, 3, tier=StorageTier.EXTERNAL))
    tiers = core.tier_hits(req, core.overlaps(req))
    assert core.overlaps(req) == {(1, 0): 2}
    assert tiers.host == {(1, 0): 4} and tiers.disk == {(1, 0): 3, (2, 0): 3}
    sel = core.select(req)
    # worker 1: effective overlap 2 + 0.75*4 + 0.25*3 = 5.75 blocks
    assert sel.key == (1, 0) and sel.effective_overlap_blocks == 5.75 and sel.cached_tokens == 23
    core.apply_event(RouterEvent(worker_id=1, data=BlocksRemoved([req.seq_hashes[1]])))
    assert core.overlaps(req) == {(1, 0): 1}
    core.apply_event(RouterEvent(worker_id=1, data=AllCleared(), tier=StorageTier.HOST_PINNED))
    assert core.tier_hits(req, {}).host == {}


def test_events_rejected_in_approximate_mode():
    core = make(workers=1, dp=1, config=RouterConfig(use_kv_events=False))
    req = core.prepare(list(range(8)))
    with pytest.raises(InvalidArgument, match="use_kv_events=False"):
        core.apply_event(stored(1, req, 2))

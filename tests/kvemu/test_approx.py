"""Approximate (no KV events) indexing: TTL on the injected clock, refresh, size pruning."""

import pytest

from kvemu.approx import ApproxIndex
from kvemu.clock import ManualClock, seconds_to_ns
from kvemu.config import RouterConfig
from kvemu.errors import InvalidArgument
from kvemu.hashing import sequence_hashes
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore


def chain(*locs):
    return list(locs), sequence_hashes(list(locs))


def test_blocks_expire_after_ttl_of_virtual_time():
    clock = ManualClock()
    ax = ApproxIndex(clock, ttl_secs=120)
    ax.record(1, 0, *chain(1, 2, 3))
    assert ax.find_matches([1, 2, 3]) == {(1, 0): 3}
    clock.advance(seconds_to_ns(119.999))
    assert ax.find_matches([1, 2, 3]) == {(1, 0): 3}
    clock.advance(seconds_to_ns(0.001))
    assert ax.find_matches([1, 2, 3]) == {}
    assert ax.index.current_size == 0 and ax.expired_blocks == 3


def test_rerouting_refreshes_the_ttl_of_the_shared_prefix_only():
    clock = ManualClock()
    ax = ApproxIndex(clock, ttl_secs=10)
    ax.record(1, 0, *chain(1, 2, 3, 4))
    clock.advance(seconds_to_ns(6))
    ax.record(1, 0, *chain(1, 2))  # refreshes blocks 1 and 2
    clock.advance(seconds_to_ns(5))  # 11 s after the first record
    assert ax.find_matches([1, 2, 3, 4]) == {(1, 0): 2}
    clock.advance(seconds_to_ns(5))
    assert ax.find_matches([1, 2]) == {}


def test_ranks_are_independent():
    clock = ManualClock()
    ax = ApproxIndex(clock, ttl_secs=10)
    ax.record(1, 0, *chain(1, 2))
    clock.advance(seconds_to_ns(5))
    ax.record(1, 1, *chain(1, 2))
    clock.advance(seconds_to_ns(6))
    assert ax.find_matches([1, 2]) == {(1, 1): 2}


def test_size_pruning_evicts_soonest_expiring_deepest_first():
    clock = ManualClock()
    ax = ApproxIndex(clock, ttl_secs=100, max_tree_size=10, prune_target_ratio=0.8)
    ax.record(1, 0, *chain(1, 2, 3, 4))  # expires at 100 s
    clock.advance(seconds_to_ns(1))
    ax.record(2, 0, *chain(5, 6, 7, 8))  # expires at 101 s
    clock.advance(seconds_to_ns(1))
    ax.record(3, 0, *chain(9, 10, 11))  # 11 entries > 10 → prune to 8
    assert ax.index.current_size == 8
    assert ax.find_matches([1, 2, 3, 4]) == {(1, 0): 1}  # worker 1's deepest three went first
    assert ax.find_matches([5, 6, 7, 8]) == {(2, 0): 4}
    assert ax.pruned_blocks == 3


def test_remove_worker_forgets_blocks():
    clock = ManualClock()
    ax = ApproxIndex(clock)
    ax.record(1, 0, *chain(1, 2))
    ax.remove_worker(1)
    assert ax.find_matches([1, 2]) == {}
    clock.advance(seconds_to_ns(500))
    assert ax.expire() == 0


def test_invalid_settings_are_rejected():
    with pytest.raises(InvalidArgument, match="ttl_secs"):
        ApproxIndex(ManualClock(), ttl_secs=0)
    with pytest.raises(InvalidArgument, match="max_tree_size"):
        ApproxIndex(ManualClock(), max_tree_size=0)


def test_core_without_kv_events_learns_from_its_bookings():
    clock = ManualClock()
    core = RoutingCore(block_size=4, config=RouterConfig(use_kv_events=False, router_ttl_secs=30), clock=clock)
    core.add_worker(WorkerSpec(worker_id=1))
    core.add_worker(WorkerSpec(worker_id=2))
    tokens = list(range(16))
    req = core.prepare(tokens)
    first = core.select(req)
    core.book("r1", first, req)
    core.free("r1")
    again = core.select(core.prepare(tokens))
    assert again.key == first.key and again.overlap_blocks == 4
    clock.advance(seconds_to_ns(31))
    assert core.overlaps(core.prepare(tokens)) == {}

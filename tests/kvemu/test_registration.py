"""Registration is bounded: ranks per worker, workers, ranks in total, endpoints and taints; a refused
registration changes nothing, and a live subscriber is sized for the ranks it may have to consume."""

import os
import time

import pytest
import zmq

from kvemu import ManualClock, RoutingCore
from kvemu.clock import NS_PER_S
from kvemu.ratelimit import TokenBucket
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_virtual
from kvemu.messages import Register
from kvemu.runtime.router import Router, RouterSettings
from kvemu.runtime.transport import MemoryNetwork
from kvemu.wire.codec import encode_batch
from kvemu.kv_events import KVEventBatch
import kvemu.wire.subscriber as subscriber_module
from kvemu.wire.subscriber import (FDS_PER_STREAM, FDS_RESERVED, FILES_RECOUNT_NS, KvEventSubscriber, StreamSpec,
                                   open_files)

from harness.run.cluster import cluster
from harness.scenario import parse_scenario


def router(**limits) -> Router:
    clock = ManualClock()
    return Router(guarded=False, core=RoutingCore(block_size=4, clock=clock), end=MemoryNetwork().router_end(), clock=clock,
                  settings=RouterSettings(**limits))


def register(r: Router, peer: bytes, **fields) -> None:
    r.on_message(peer, Register(block_size=4, **fields))


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"worker_id": 9, "dp_size": 3}, "dp_size 3 is outside 1..2 (max_ranks_per_worker)"),
        ({"worker_id": 9, "dp_size": 0}, "dp_size 0 is outside 1..2"),
        ({"worker_id": 9, "dp_size": 2}, "would make 5, more than this router takes (4, max_ranks)"),
        ({"worker_id": 9, "kv_endpoints": ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]}, "2 kv_endpoints for 1 ranks"),
        ({"worker_id": 9, "kv_replay_endpoints": ["http://evil"]}, "'http://evil' is not a tcp:// or ipc:// endpoint"),
        ({"worker_id": 9, "taints": ["t"] * 65}, "at most 64 taints"),
    ],
)
def test_registrations_beyond_the_bounds_are_refused_and_change_nothing(fields, why, caplog):
    r = router(max_ranks=4, max_ranks_per_worker=2, max_workers=3)
    register(r, b"a", worker_id=1, dp_size=2)
    register(r, b"b", worker_id=2, dp_size=1)
    before = (sorted(r.workers), list(r.core.registry.rank_keys()))
    register(r, b"c", **fields)
    assert (sorted(r.workers), list(r.core.registry.rank_keys())) == before
    assert why in caplog.text


def test_the_worker_count_is_bounded_too(caplog):
    r = router(max_workers=2)
    for wid in (1, 2, 3):
        register(r, f"p{wid}".encode(), worker_id=wid)
    assert sorted(r.workers) == [1, 2]
    assert "2 workers are registered, the most this router takes (max_workers)" in caplog.text


def test_two_thousand_ranks_stream_into_one_subscriber():
    """ZeroMQ's default context stops at 1,023 sockets; a subscriber sized for its ranks is not limited by it."""
    ranks = 2000
    applied: list[object] = []
    sub = KvEventSubscriber(applied.append, block_size=4, max_streams=ranks, replay_on_connect=False)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        for wid in range(ranks):  # every stream listens to the same publisher: 2,000 SUB sockets at once
            sub.add(StreamSpec(wid, 0, endpoint, None))
        with pytest.raises(Exception, match="the most this subscriber was sized for"):
            sub.add(StreamSpec(ranks, 0, endpoint, None))
        payload = encode_batch(KVEventBatch(ts=0.0, events=[], data_parallel_rank=0))
        seq = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            sub.poll(50)
            if all(sub.expected_seq(w, 0) is not None for w in range(ranks)):
                break
        assert all(sub.expected_seq(w, 0) is not None for w in range(ranks)), "every stream received a batch"
        assert sum(s.decode_errors for s in sub.stats.values()) == 0
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()


def test_open_files_held_by_other_connections_lower_the_streams_left(monkeypatch):
    """A flood of peers holds one open file each on the router: the streams budget counts them, so the router
    refuses registrations before it runs out of files for its own sockets (it stopped answering at 4,096).
    The process's open files are the test's own count here: other threads (earlier tests' ZeroMQ contexts)
    open and close files whenever they like."""
    limit, used = 10_000, [200]
    monkeypatch.setattr(subscriber_module, "open_files", lambda: (used[0], limit))
    clock = ManualClock()
    sub = KvEventSubscriber(lambda e: None, block_size=4, max_streams=100, replay_on_connect=False, clock=clock)
    try:
        before = sub.streams_left()
        assert before == min(100, (limit - FDS_RESERVED - used[0]) // FDS_PER_STREAM) == 100
        used[0] = limit - FDS_RESERVED - 60 * FDS_PER_STREAM  # what peers' connections now hold
        assert sub.streams_left() == before  # the last count stands for FILES_RECOUNT_NS
        clock.advance(FILES_RECOUNT_NS)
        assert sub.streams_left() == 60
        sub.add(StreamSpec(1, 0, "tcp://127.0.0.1:1", None))  # added, not yet connected: counted all the same
        assert sub.streams_left() == 59
        used[0] = limit  # no file left beyond the reserve
        clock.advance(FILES_RECOUNT_NS)
        assert sub.streams_left() == 0
    finally:
        sub.close()


@pytest.mark.skipif(open_files() is None, reason="open files are counted through /proc/self/fd (Linux)")
def test_open_files_counts_this_processs_open_files():
    used, limit = open_files()
    held = [open(os.devnull) for _ in range(50)]
    try:
        now, same_limit = open_files()
    finally:
        for f in held:
            f.close()
    assert same_limit == limit
    assert abs(now - used - 50) <= 4  # other threads may open or close a few meanwhile


def test_a_token_bucket_spends_its_burst_then_refills_at_its_rate():
    bucket = TokenBucket(rate_per_s=2.0, burst=3, now_ns=0)
    assert [bucket.take(0) for _ in range(4)] == [True, True, True, False]
    assert bucket.wait_s(0) == 0.5
    assert not bucket.take(499_999_999) and bucket.take(500_000_000)
    assert [bucket.take(10 * NS_PER_S) for _ in range(4)] == [True, True, True, False]  # never more than the burst


def test_past_the_rate_a_registration_is_refused_with_a_retry_time_and_changes_nothing(caplog):
    r = router(registration_burst=2, registrations_per_s=4.0)
    for wid in (1, 2, 3):
        register(r, f"p{wid}".encode(), worker_id=wid)
    assert sorted(r.workers) == [1, 2] and r.registrations_refused == 1
    assert "rate_limited: worker 3" in caplog.text and "retry in 0.25 s" in caplog.text
    r.clock.advance(NS_PER_S // 4)
    register(r, b"p3", worker_id=3)
    assert sorted(r.workers) == [1, 2, 3]


def test_rate_limited_workers_register_again_when_told_and_all_join():
    """Workers refused with a retry time are not rejected: they register again then (virtual time)."""
    scenario = parse_scenario("cluster: {workers: 4}\nrouter: {registration_burst: 2, registrations_per_s: 2}\n")
    clock = ManualClock()

    async def main():
        async with cluster(scenario, clock, Hooks()) as c:
            return sorted(c.router.workers), c.router.registrations_refused, clock.now_ns()

    workers, refused, t = run_virtual(main, clock)
    assert workers == [0, 1, 2, 3] and refused >= 2
    assert t >= NS_PER_S  # two registrations waited for two tokens at 2 per second


def test_the_open_file_limit_bounds_the_streams_and_registrations_past_it_are_refused(monkeypatch, caplog):
    """A hard open-file limit too low for max_ranks: the subscriber takes what fits and the router refuses, with
    the reason and what to do, a registration whose streams would not fit, instead of crashing later."""
    import kvemu.wire.subscriber as subscriber

    monkeypatch.setattr(subscriber, "open_file_limit", lambda want: subscriber.FDS_RESERVED + 3 * subscriber.FDS_PER_STREAM)
    clock = ManualClock()
    r = Router(guarded=False, core=RoutingCore(block_size=4, clock=clock), end=MemoryNetwork().router_end(), clock=clock,
               settings=RouterSettings(max_ranks=100), zmq_kv_events=True)
    try:
        assert r.kv.streams_left() == 3
        ends = [f"tcp://127.0.0.1:{p}" for p in (20001, 20002)]
        register(r, b"a", worker_id=1, dp_size=2, kv_endpoints=ends)
        register(r, b"b", worker_id=2, dp_size=2, kv_endpoints=ends)
        assert sorted(r.workers) == [1]
        assert "its 2 KV-event streams would exceed what this router can open (1 more" in caplog.text
        assert "ulimit -Hn" in caplog.text
    finally:
        r.kv.subscriber.close()


@pytest.mark.parametrize(("overrides", "warned"), [
    (["cluster.workers=2", "cluster.dp_size=1"], False),
    (["cluster.workers=3", "cluster.dp_size=1"], False),
    (["cluster.workers=2", "cluster.dp_size=2"], True),
    (["cluster.workers=2", "cluster.dp_size=1", "autoscaler.min_workers=1", "autoscaler.max_workers=4"], True),
])
def test_the_open_file_limit_is_mentioned_only_when_the_configured_cluster_does_not_fit(monkeypatch, caplog,
                                                                                         overrides, warned):
    """A live router with room for 3 ranks' streams (not max_ranks): silent for a cluster of up to 3 ranks, a
    warning naming both numbers for one that can reach more."""
    import kvemu.wire.subscriber as subscriber
    from harness.run.factories import pool_router

    monkeypatch.setattr(subscriber, "open_file_limit", lambda want: subscriber.FDS_RESERVED + 3 * subscriber.FDS_PER_STREAM)
    scenario = parse_scenario("name: x\n", overrides=overrides)
    clock = ManualClock()
    r = pool_router(scenario, "aggregated", clock=clock, end=MemoryNetwork().router_end(), hooks=Hooks(),
                    zmq_kv_events=True)
    try:
        assert ("allows KV streams for 3 ranks, but this cluster's aggregated pool can reach 4" in caplog.text) == warned
        assert ("open-file limit" in caplog.text) == warned
    finally:
        r.kv.subscriber.close()


def test_a_stream_that_cannot_be_opened_is_counted_and_the_others_go_on(monkeypatch):
    applied: list[object] = []
    sub = KvEventSubscriber(applied.append, block_size=4, max_streams=4, replay_on_connect=False)
    real = sub._connect_sub

    def failing(sock, spec):
        if spec.worker_id == 1:
            raise zmq.ZMQError(24, "Too many open files")
        return real(sock, spec)

    monkeypatch.setattr(sub, "_connect_sub", failing)
    try:
        sub.add(StreamSpec(1, 0, "tcp://127.0.0.1:20001", None))
        sub.add(StreamSpec(2, 0, "tcp://127.0.0.1:20002", None))
        sub.poll(0)
        assert sub.stats[1].connect_failures == 1 and sub.stats[2].connect_failures == 0
        sub.remove_worker(1)  # a stream that never opened goes away cleanly
        sub.remove_worker(2)
    finally:
        sub.close()

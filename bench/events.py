"""KV-event wire throughput over TCP loopback (127.0.0.1 only).

Prints, one per line:
  encode: N batches per s                     (msgspec, vLLM 0.33 map form)
  encode+publish: N batches per s             (publisher in this process, a draining SUB in another)
  publish live drops: N batches / publish received: N batches   (by that SUB)
  receive+decode+apply: N batches per s       (publisher in another process, SUB + decode + index here)
  receive applied: N batches / receive lost batches: N   (after gap recovery by replay; must be 0)
  receive gaps: N / receive replays: N / receive restarts: N   (the publisher never restarts: must be 0)
Batches hold one BlockStored of 8 blocks × 16 tokens, as in the issue. Counts and times are bounded.

ZeroMQ's slow joiner: a SUB gets only what is published after its subscription reached the publisher,
so before any timed batch the publishing side sends probe batches (no events) every 10 ms until the
consuming side acknowledges one; no acknowledgement within 10 s is an error. Consumers skip the probes.
The exit status is 1 when a batch went missing (lost after recovery, or fewer received or applied than
sent and not counted as a live drop) or was applied twice or taken for a restart, and an exception (no
subscriber, a child process gone, a bound exceeded) also ends the run with a non-zero status.
``--quick`` sends 5,000 batches instead of 100,000.
Run: python -m bench.events [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvemu import RoutingCore, WorkerSpec
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.wire.codec import encode_batch, profile_for
from kvemu.kv_events import BlockStored, KVEventBatch
from kvemu.wire.publisher import KvEventPublisher
from kvemu.wire.subscriber import KvEventSubscriber, StreamSpec

from harness.tuning import tune_gc
from bench import verdict

BLOCK = 16
BLOCKS = 8
FULL_BATCHES = 100_000
QUICK_BATCHES = 5_000
PROBE = KVEventBatch(ts=0.0, events=[], data_parallel_rank=0)
"""The handshake batch: no events, so applying it changes nothing."""
PROBE_INTERVAL_S = 0.01
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PROBES = int(HANDSHAKE_TIMEOUT_S / PROBE_INTERVAL_S) + 1
RUN_TIMEOUT_S = 120.0
"""Bound of every wait for batches, child processes and queues."""


def make_batch(k: int) -> KVEventBatch:
    """Batch ``k``: one BlockStored of 8 fresh blocks of 16 tokens."""
    tokens = [(k * 131 + i) % 2**32 for i in range(BLOCK * BLOCKS)]
    hashes = sequence_hashes(local_block_hashes(tokens, BLOCK))
    ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK)
    return KVEventBatch(ts=1.0 + k, events=[ev], data_parallel_rank=0)


def _get(q: Any, proc: Any, what: str, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    """The next item of ``q``; fails fast when the child ``proc`` has died, and after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(
                    f"bench.events: the child process exited (code {proc.exitcode}) before {what}") from None
    raise TimeoutError(f"bench.events: no {what} within {timeout_s:.0f} s")


def _handshake(send_probe: Callable[[], object], acked: Any, alive: Callable[[], bool]) -> int:
    """Send probes until ``acked`` (an Event) is set; the number sent. Raises after HANDSHAKE_TIMEOUT_S."""
    sent = 0
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while sent < MAX_PROBES and time.monotonic() < deadline and alive():
        send_probe()
        sent += 1
        if acked.wait(PROBE_INTERVAL_S):
            return sent
    raise TimeoutError(f"bench.events: no subscriber acknowledged a probe within {HANDSHAKE_TIMEOUT_S:.0f} s "
                       f"({sent} probes sent)")


# ------------------------------------------------------------------------- encode + publish


def _drain(endpoint_q: Any, probe: bytes, acked: Any, sent: Any, result_q: Any) -> None:
    """Child: SUB on the publisher, acknowledge the first probe, count the other batches until all sent."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint_q.get(timeout=RUN_TIMEOUT_S))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    got = 0
    while time.monotonic() < deadline:
        total = sent.value  # -1 until the publisher has sent everything
        if 0 <= total <= got:
            break
        if not sub.poll(100):
            continue
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames[-1] == probe:
                acked.set()
            else:
                got += 1
    result_q.put(got)
    sub.close()
    ctx.term()


def bench_publish(count: int) -> tuple[float, float, int, int]:
    """(encode rate, encode+publish rate, live drops, batches the other process received)."""
    batches = [make_batch(k) for k in range(count)]
    probe = encode_batch(PROBE, profile_for("0.33"))
    endpoint_q: mp.Queue = mp.Queue()
    result_q: mp.Queue = mp.Queue()
    acked = mp.Event()
    sent = mp.Value("q", -1)
    # started before this process opens any ZeroMQ context (fork)
    proc = mp.Process(target=_drain, args=(endpoint_q, probe, acked, sent, result_q), daemon=True)
    proc.start()
    tune_gc()  # as a worker process does at startup
    profile = profile_for("0.33")
    t0 = time.perf_counter()
    for b in batches:
        encode_batch(b, profile)
    encode_rate = count / (time.perf_counter() - t0)
    ctx = zmq.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:0", bind=True, context=ctx)
    try:
        endpoint_q.put(pub.endpoint)
        _handshake(lambda: pub.publish_payload(probe), acked, proc.is_alive)
        dropped0 = pub.stats.dropped
        t0 = time.perf_counter()
        for b in batches:
            pub.publish(b)
        rate = count / (time.perf_counter() - t0)
        dropped = pub.stats.dropped - dropped0
        sent.value = count - dropped
        received = _get(result_q, proc, "the subscriber's count")
        proc.join(RUN_TIMEOUT_S)
    finally:
        pub.close()
        ctx.term()
        if proc.is_alive():
            proc.terminate()
    return encode_rate, rate, dropped, received


# ------------------------------------------------------------------------- receive + apply


def _publish(endpoint_q: Any, count: int, acked: Any, probes_q: Any, start: Any, done: Any) -> None:
    """Child: probe until acknowledged (tell how many), then publish ``count`` batches; serve replays."""
    ctx = zmq.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True, context=ctx,
                           buffer_steps=MAX_PROBES + count + 10)
    try:
        payloads = [encode_batch(make_batch(k), pub.profile) for k in range(count)]
        probe = encode_batch(PROBE, pub.profile)
        endpoint_q.put((pub.endpoint, pub.replay_endpoint))
        probes_q.put(_handshake(lambda: pub.publish_payload(probe), acked, lambda: True))
        if start.wait(RUN_TIMEOUT_S):
            for p in payloads:
                pub.publish_payload(p)
            done.wait(RUN_TIMEOUT_S)  # keep serving replays while the consumer catches up
    finally:
        pub.close()
        ctx.term()


def bench_receive(count: int) -> tuple[float, int, int, int, int, int]:
    """(rate, data batches applied, lost, gaps, replays, restarts) for receive+decode+apply into a RoutingCore.

    Gaps and replays count the data phase only: the probes sent before the SUB connected always come
    back by one replay. Lost and restarts count the whole run.
    """
    endpoint_q: mp.Queue = mp.Queue()
    probes_q: mp.Queue = mp.Queue()
    acked, start, done = mp.Event(), mp.Event(), mp.Event()
    proc = mp.Process(target=_publish, args=(endpoint_q, count, acked, probes_q, start, done), daemon=True)
    proc.start()  # before this process opens a ZeroMQ context (fork)
    core = RoutingCore(block_size=BLOCK)
    core.add_worker(WorkerSpec(worker_id=1))
    tune_gc()  # as the router process does at startup
    endpoint, replay = _get(endpoint_q, proc, "the publisher's endpoints")
    ctx = zmq.Context()
    sub = KvEventSubscriber(core.apply_event, block_size=BLOCK, context=ctx)
    try:
        sub.add(StreamSpec(1, 0, endpoint, replay))
        stats = sub.stats[1]

        def poll_until(target: int, what: str) -> None:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while stats.batches + stats.lost_batches < target:
                if time.monotonic() > deadline or not proc.is_alive():
                    raise TimeoutError(f"bench.events: {what}: {stats.batches} batches applied, "
                                       f"{stats.lost_batches} lost, {target} expected")
                sub.poll(100)

        poll_until(1, "no probe batch arrived")  # earlier probes come back by replay
        acked.set()
        probes = _get(probes_q, proc, "the probe count")
        poll_until(probes, "probe batches missing")
        base, base_gaps, base_replays = stats.batches, stats.gaps, stats.replays  # probes before the connection
        start.set()
        sub.poll(10_000, max_batches=1)  # the clock starts at the first data batch
        first = stats.batches - base
        t0 = time.perf_counter()
        poll_until(probes + count, "data batches missing")
        elapsed = time.perf_counter() - t0
    finally:
        done.set()
        sub.close()
        ctx.term()
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
    applied = stats.batches - base
    gaps, replays = stats.gaps - base_gaps, stats.replays - base_replays
    return (applied - first) / elapsed, applied, stats.lost_batches, gaps, replays, stats.restarts


def main(argv: list[str] | None = None) -> int:
    """Run both benchmarks; 0 when every batch arrived, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m bench.events", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_BATCHES:,} batches (a CI smoke run)")
    args = parser.parse_args(argv)
    n = QUICK_BATCHES if args.quick else FULL_BATCHES
    problems = []
    encode_rate, publish_rate, dropped, received = bench_publish(n)
    print(f"encode: {encode_rate:.0f} batches per s", flush=True)
    print(f"encode+publish: {publish_rate:.0f} batches per s", flush=True)
    print(f"publish live drops: {dropped} batches", flush=True)
    print(f"publish received: {received} batches", flush=True)
    if received != n - dropped:
        problems.append(f"the subscriber received {received} of {n - dropped} batches sent live")
    rate, applied, lost, gaps, replays, restarts = bench_receive(n)
    print(f"receive+decode+apply: {rate:.0f} batches per s", flush=True)
    print(f"receive applied: {applied} batches", flush=True)
    print(f"receive lost batches: {lost}", flush=True)
    print(f"receive gaps: {gaps}", flush=True)
    print(f"receive replays: {replays}", flush=True)
    print(f"receive restarts: {restarts}", flush=True)
    if lost or applied != n:
        problems.append(f"receive: {applied} of {n} batches applied, {lost} lost")
    if restarts:
        problems.append(f"receive: {restarts} restarts of a publisher that never restarted")
    return verdict("events", problems)


if __name__ == "__main__":
    sys.exit(main())

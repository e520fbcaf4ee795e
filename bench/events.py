"""KV-event wire throughput over TCP loopback (127.0.0.1 only).

Prints, one per line:
  encode: N batches per s                     (msgspec, vLLM 0.33 map form)
  encode+publish: N batches per s             (publisher in this process, a draining SUB in another)
  receive+decode+apply: N batches per s       (publisher in another process, SUB + decode + index here)
  receive lost batches: N                     (after gap recovery by replay; must be 0)
  receive gaps: N / receive replays: N
Batches hold one BlockStored of 8 blocks × 16 tokens, as in the issue. Counts and times are bounded.
Run: python -m bench.events [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import zmq

from kvemu import RoutingCore, WorkerSpec
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.tuning import tune_gc
from kvemu.wire.codec import encode_batch, profile_for
from kvemu.wire.kv_events import BlockStored, KVEventBatch
from kvemu.wire.publisher import KvEventPublisher
from kvemu.wire.subscriber import KvEventSubscriber, StreamSpec

BLOCK = 16
BLOCKS = 8


def make_batch(k: int) -> KVEventBatch:
    tokens = [(k * 131 + i) % 2**32 for i in range(BLOCK * BLOCKS)]
    hashes = sequence_hashes(local_block_hashes(tokens, BLOCK))
    ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK)
    return KVEventBatch(ts=1.0 + k, events=[ev], data_parallel_rank=0)


def _drain(endpoint: str, count: int, ready) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    ready.set()
    deadline = time.monotonic() + 120
    got = 0
    while got < count and time.monotonic() < deadline:
        if sub.poll(200):
            sub.recv_multipart()
            got += 1
    sub.close(linger=0)
    ctx.term()


def bench_publish(count: int) -> tuple[float, float, int]:
    """(encode rate, encode+publish rate, live drops) with a draining subscriber in another process."""
    batches = [make_batch(k) for k in range(count)]
    tune_gc()  # as a worker process does at startup
    profile = profile_for("0.33")
    t0 = time.perf_counter()
    for b in batches:
        encode_batch(b, profile)
    encode_rate = count / (time.perf_counter() - t0)
    pub = KvEventPublisher("tcp://127.0.0.1:0", bind=True, context=zmq.Context())
    ready = mp.Event()
    proc = mp.Process(target=_drain, args=(pub.endpoint, count + 1, ready), daemon=True)
    proc.start()
    ready.wait(10)
    probe = make_batch(-1)
    deadline = time.monotonic() + 10
    while pub.stats.published == 0 and time.monotonic() < deadline:  # wait for the subscription
        pub.publish(probe)
        time.sleep(0.01)
        if pub._pub.poll(0, zmq.POLLIN):
            pub._pub.recv_multipart()
            break
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    rate = count / (time.perf_counter() - t0)
    dropped = pub.stats.dropped
    proc.join(30)
    pub.close()
    return encode_rate, rate, dropped


def _publish(endpoint_q, count: int, start) -> None:
    ctx = zmq.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True, context=ctx,
                           buffer_steps=count + 10)
    payloads = [encode_batch(make_batch(k), pub.profile) for k in range(count)]
    endpoint_q.put((pub.endpoint, pub.replay_endpoint))
    start.wait(30)
    for p in payloads:
        pub.publish_payload(p)
    time.sleep(15)  # keep serving replays while the consumer catches up
    pub.close()


def bench_receive(count: int) -> tuple[float, int, int, int, int]:
    """(rate, batches applied, lost, gaps, replays) for receive+decode+apply into a RoutingCore."""
    core = RoutingCore(block_size=BLOCK)
    core.add_worker(WorkerSpec(worker_id=1))
    tune_gc()  # as the router process does at startup
    q: mp.Queue = mp.Queue()
    start = mp.Event()
    proc = mp.Process(target=_publish, args=(q, count, start), daemon=True)
    proc.start()
    endpoint, replay = q.get(timeout=60)
    sub = KvEventSubscriber(core.apply_event, block_size=BLOCK, context=zmq.Context())
    sub.add(StreamSpec(1, 0, endpoint, replay))
    time.sleep(0.5)  # let the SUB connect before the first batch (slow joiner)
    start.set()
    stats = sub.stats[1]
    deadline = time.monotonic() + 120
    sub.poll(10_000, max_batches=1)
    t0 = time.perf_counter()
    while stats.batches + stats.lost_batches < count and time.monotonic() < deadline:
        sub.poll(1000)
    elapsed = time.perf_counter() - t0
    sub.close()
    proc.terminate()
    applied = stats.batches
    return (applied - 1) / elapsed, applied, stats.lost_batches, stats.gaps, stats.replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 20_000 if args.quick else 100_000
    encode_rate, publish_rate, dropped = bench_publish(n)
    print(f"encode: {encode_rate:.0f} batches per s")
    print(f"encode+publish: {publish_rate:.0f} batches per s")
    print(f"publish live drops: {dropped} batches")
    rate, applied, lost, gaps, replays = bench_receive(n)
    print(f"receive+decode+apply: {rate:.0f} batches per s")
    print(f"receive applied: {applied} batches")
    print(f"receive lost batches: {lost}")
    print(f"receive gaps: {gaps}")
    print(f"receive replays: {replays}")


if __name__ == "__main__":
    main()

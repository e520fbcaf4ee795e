"""Throughput of kvemu's prefix index and routing path, against Dynamo's ``RadixTree`` when installed.

Run with ``python -m bench.index`` (``--quick`` for a CI-sized smoke run). Every figure is printed on
stdout as ``figure name: value unit``; where the reference ran in this process, a line
``figure name ratio vs reference: X.XXx`` (kvemu / reference, higher is better for kvemu) follows.
Workload notes go to stderr, as do the reference's own WARN logs.

Workload (from the issue): 16 workers x 2 DP ranks; prompts of 64 blocks of 16 tokens that share an
8-block system prefix (8 shared + 56 distinct blocks). Each prompt is stored on one or more ranks
through chained 16-block store events (a prompt is 4 events; the parent of each is the previous
event's last external hash). External hashes are the engine-like rolling sequence hashes
``kvemu.hashing.sequence_hashes(local_hashes)``, so identical prefixes have identical external hashes
on every worker. Queries are the prompts plus 20 % random miss queries.

Method: ``time.perf_counter``; every throughput figure is the BEST of N repeats (max rate), for kvemu
and the reference alike. The reference ``RadixTree`` serves its calls on a background thread and is
bimodal (hot or cold thread), so the kvemu and reference repeats are interleaved (alternating which
side goes first) and the best run of each side is reported, which is the fair comparison for both.
The latency percentiles time each kvemu ``find_matches`` call on its own (timer overhead included) and
use ``harness.report.stats.percentile``. All loops are bounded both in count and in time.

Reference input form: ``RadixTree.apply_event(worker_id, bytes)`` takes only ``bytes`` holding the
JSON of one ``KvCacheEvent`` (``str``, ``bytearray``, ``memoryview`` and MessagePack are refused;
there is no batch call, and ``KvIndexer`` needs a distributed runtime). serde also accepts every
struct as a JSON array of its fields in declaration order, so the events are fed in that sequence
form, compact (no spaces): ``[event_id, {"stored": [parent_hash, null, [[block_hash, tokens_hash,
null], ...]]}, dp_rank]`` and ``[event_id, {"removed": [[block_hash, ...]]}, dp_rank]``; a 16-block
store averages 808 bytes instead of 1,278 in ``json.dumps``'s map form. Measured on this workload (400
prompts, best of 41 interleaved rounds, 2 shared cores, two runs): store events 119k-125k/s in
sequence form against 108k-113k/s in map form (``json.dumps`` default or compact separators); removal
events 147k-159k/s in every form (within noise: the call's hop to the tree's thread dominates). All
payloads are encoded once before timing; the untimed check cycle verifies that the reference then
agrees with kvemu on every query and is empty after the removals (otherwise the exit status is 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable
from typing import NamedTuple

from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.index import PrefixIndex
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore

from harness.report.stats import percentile
from bench import verdict

try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq
except ImportError:  # ai-dynamo-runtime is optional (linux x86_64 dev extra)
    RadixTree = None
    compute_block_hash_for_seq = None

perf_counter = time.perf_counter

BLOCK_SIZE = 16
WORKERS = 16
DP_SIZE = 2
PROMPT_BLOCKS = 64
PREFIX_BLOCKS = 8
EVENT_BLOCKS = 16
MISS_FRACTION = 0.20
VOCAB = 32_000
PLACEMENT_COPIES = (1, 1, 1, 1, 1, 2, 2, 2, 3, 4)  # ranks holding a prompt: mean 1.8


class Params(NamedTuple):
    prompts: int
    repeats: int  # interleaved rounds (store / find_matches / removal / hashing)
    sample_s: float  # target duration of one find_matches / hashing / selection sample
    budget_s: float  # wall-clock bound of each repeat loop (after the first round)
    select_repeats: int
    latency_calls: int
    max_passes: int


FULL = Params(prompts=400, repeats=9, sample_s=0.25, budget_s=40.0, select_repeats=7, latency_calls=50_000, max_passes=2_000)
QUICK = Params(prompts=60, repeats=3, sample_s=0.03, budget_s=3.0, select_repeats=3, latency_calls=5_000, max_passes=200)


class StoreEvent(NamedTuple):
    worker_id: int
    dp_rank: int
    parent_hash: int | None
    local_hashes: list[int]
    block_hashes: list[int]


class RemoveEvent(NamedTuple):
    worker_id: int
    dp_rank: int
    block_hashes: list[int]


class Workload(NamedTuple):
    prompt_tokens: list[list[int]]
    stores: list[StoreEvent]
    removals: list[RemoveEvent]
    query_tokens: list[list[int]]  # prompts + misses, shuffled
    queries: list[list[int]]  # local hashes of query_tokens
    placements: dict[tuple[int, int], list[int]]  # rank -> prompt numbers it holds


def _interleave(rng: random.Random, streams: list[list]) -> list:
    """Merge the streams in random order, keeping each stream's own order."""
    owners = [i for i, s in enumerate(streams) for _ in s]
    rng.shuffle(owners)
    pos = [0] * len(streams)
    out = []
    for i in owners:
        out.append(streams[i][pos[i]])
        pos[i] += 1
    return out


def build_workload(n_prompts: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    ranks = [(w, r) for w in range(WORKERS) for r in range(DP_SIZE)]
    system = [rng.randrange(VOCAB) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    distinct = (PROMPT_BLOCKS - PREFIX_BLOCKS) * BLOCK_SIZE
    prompt_tokens = [system + [rng.randrange(VOCAB) for _ in range(distinct)] for _ in range(n_prompts)]
    locs = [local_block_hashes(t, BLOCK_SIZE) for t in prompt_tokens]
    exts = [sequence_hashes(lh) for lh in locs]

    placements: dict[tuple[int, int], list[int]] = {k: [] for k in ranks}
    chains: list[list[StoreEvent]] = []
    for p in range(n_prompts):
        for wid, rank in rng.sample(ranks, rng.choice(PLACEMENT_COPIES)):
            placements[(wid, rank)].append(p)
            chain = []
            for lo in range(0, PROMPT_BLOCKS, EVENT_BLOCKS):
                parent = exts[p][lo - 1] if lo else None
                hi = lo + EVENT_BLOCKS
                chain.append(StoreEvent(wid, rank, parent, locs[p][lo:hi], exts[p][lo:hi]))
            chains.append(chain)
    stores = _interleave(rng, chains)

    # Removal, leaf first: per rank, every prompt's distinct blocks deepest first, then the shared
    # prefix, cut into 16-block events (a rank's last event has 8 blocks when it holds an even number
    # of prompts). Hashes are listed deepest first inside each event too: no block is removed before
    # its descendants on that rank, so no removal cascades and no event names a block that is already
    # gone (as with LRU eviction). A root-first order would cascade in both indexes and make kvemu
    # raise BlockNotFound for the rest of the event.
    per_rank: list[list[RemoveEvent]] = []
    for (wid, rank), held in placements.items():
        order: list[int] = []
        for p in held:
            order.extend(reversed(exts[p][PREFIX_BLOCKS:]))
        if held:
            order.extend(reversed(exts[held[0]][:PREFIX_BLOCKS]))
        per_rank.append(
            [RemoveEvent(wid, rank, order[i : i + EVENT_BLOCKS]) for i in range(0, len(order), EVENT_BLOCKS)]
        )
    removals = _interleave(rng, per_rank)

    n_miss = round(n_prompts * MISS_FRACTION)
    miss_tokens = [[rng.randrange(VOCAB) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE)] for _ in range(n_miss)]
    query_tokens = prompt_tokens + miss_tokens
    queries = locs + [local_block_hashes(t, BLOCK_SIZE) for t in miss_tokens]
    order_q = list(range(len(queries)))
    rng.shuffle(order_q)
    return Workload(
        prompt_tokens,
        stores,
        removals,
        [query_tokens[i] for i in order_q],
        [queries[i] for i in order_q],
        placements,
    )


# --------------------------------------------------------------------------- kvemu side


def kv_store(idx: PrefixIndex, stores: list[StoreEvent]) -> None:
    store = idx.store
    for wid, rank, parent, lh, bh in stores:
        store(wid, lh, bh, parent_hash=parent, dp_rank=rank)


def kv_remove(idx: PrefixIndex, removals: list[RemoveEvent]) -> None:
    remove = idx.remove
    for wid, rank, bh in removals:
        remove(wid, bh, dp_rank=rank)


def kv_find_pass(idx: PrefixIndex, queries: list[list[int]], passes: int) -> None:
    find = idx.find_matches
    for _ in range(passes):
        for q in queries:
            find(q)


# --------------------------------------------------------------------------- reference side


def _compact_json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_reference_events(wl: Workload) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """The workload's events as the reference's fastest input: compact JSON ``KvCacheEvent`` bytes in
    serde's sequence form (see the module docstring), encoded once, before any timing."""
    stores = []
    for n, (wid, rank, parent, lh, bh) in enumerate(wl.stores):
        blocks = [[b, t, None] for b, t in zip(bh, lh)]  # [block_hash, tokens_hash, mm_extra_info]
        stores.append((wid, _compact_json([n, {"stored": [parent, None, blocks]}, rank])))  # [parent, start_position, blocks]
    removals = []
    base = len(wl.stores)
    for n, (wid, rank, bh) in enumerate(wl.removals):
        removals.append((wid, _compact_json([base + n, {"removed": [bh]}, rank])))  # [block_hashes]
    return stores, removals


def ref_apply(tree, events: list[tuple[int, bytes]], probe: list[int]) -> None:
    apply = tree.apply_event
    for wid, payload in events:
        apply(wid, payload)
    # One query at the end: a barrier in case the background thread still applies events (it is
    # synchronous in 1.6.1 as far as we can tell; the probe costs microseconds against milliseconds).
    _ = tree.find_matches(probe).scores


def ref_find_pass(tree, queries: list[list[int]], passes: int) -> None:
    find = tree.find_matches
    for _ in range(passes):
        for q in queries:
            _ = find(q).scores


# --------------------------------------------------------------------------- helpers


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    t0 = perf_counter()
    fn()
    return perf_counter() - t0


def calibrate(run: Callable[[int], object], target_s: float, max_passes: int) -> int:
    """Passes of ``run`` filling about ``target_s`` (from a one-pass trial), within [1, max_passes]."""
    dt = timed(lambda: run(1))
    return max(1, min(max_passes, math.ceil(target_s / max(dt, 1e-6))))


def fmt_rate(x: float) -> str:
    return f"{x:.0f}"


def emit(name: str, value: str, unit: str) -> None:
    print(f"{name}: {value} {unit}", flush=True)


def emit_ratio(name: str, ours: float, ref: float) -> None:
    print(f"{name} ratio vs reference: {ours / ref:.2f}x", flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- benchmarks


def bench_index(wl: Workload, prm: Params) -> list[str]:
    """Hashing, store, find_matches and removal; kvemu and reference interleaved round by round.

    Returns the problems found (the reference disagreeing with kvemu, or not empty after the removals).
    """
    problems: list[str] = []
    have_ref = RadixTree is not None
    n_store, n_remove, n_q = len(wl.stores), len(wl.removals), len(wl.queries)
    n_hash_blocks = sum(len(t) // BLOCK_SIZE for t in wl.prompt_tokens)
    probe = wl.queries[0]
    ref_stores = ref_removals = None
    if have_ref:
        ref_stores, ref_removals = encode_reference_events(wl)

    # One untimed kvemu cycle: checks the workload and calibrates the sample sizes.
    idx = PrefixIndex()
    kv_store(idx, wl.stores)
    entries = idx.current_size
    kv_passes = calibrate(lambda p: kv_find_pass(idx, wl.queries, p), prm.sample_s, prm.max_passes)
    expected = [idx.find_matches(q) for q in wl.queries]
    kv_remove(idx, wl.removals)
    assert idx.current_size == 0, "removal workload left entries behind"
    note(
        f"workload: {len(wl.prompt_tokens)} prompts, {n_store} store events, {n_remove} removal events, "
        f"{n_q} queries ({n_q - len(wl.prompt_tokens)} misses), {entries} (block, rank) entries"
    )

    def hash_kv(passes: int) -> None:
        for _ in range(passes):
            for t in wl.prompt_tokens:
                local_block_hashes(t, BLOCK_SIZE)

    def hash_ref(passes: int) -> None:
        for _ in range(passes):
            for t in wl.prompt_tokens:
                compute_block_hash_for_seq(t, BLOCK_SIZE)

    hash_kv_passes = calibrate(hash_kv, prm.sample_s, prm.max_passes)
    ref_passes = hash_ref_passes = 0
    if have_ref:
        hash_ref_passes = calibrate(hash_ref, prm.sample_s, prm.max_passes)
        tree = RadixTree()
        ref_apply(tree, ref_stores, probe)
        mismatches = sum(tree.find_matches(q).scores != e for q, e in zip(wl.queries, expected))
        if mismatches:
            problems.append(f"reference and kvemu disagree on {mismatches} of {n_q} queries")
        ref_passes = calibrate(lambda p: ref_find_pass(tree, wl.queries, p), prm.sample_s, prm.max_passes)
        ref_apply(tree, ref_removals, probe)
        if tree.dump_tree_as_events():
            problems.append("reference tree not empty after the removal workload")
        del tree

    best = {k: math.inf for k in ("store", "find", "remove", "hash", "rstore", "rfind", "rremove", "rhash")}

    def kv_round() -> None:
        ix = PrefixIndex()
        best["store"] = min(best["store"], timed(lambda: kv_store(ix, wl.stores)))
        best["find"] = min(best["find"], timed(lambda: kv_find_pass(ix, wl.queries, kv_passes)))
        best["remove"] = min(best["remove"], timed(lambda: kv_remove(ix, wl.removals)))
        best["hash"] = min(best["hash"], timed(lambda: hash_kv(hash_kv_passes)))

    def ref_round() -> None:
        tr = RadixTree()
        best["rstore"] = min(best["rstore"], timed(lambda: ref_apply(tr, ref_stores, probe)))
        best["rfind"] = min(best["rfind"], timed(lambda: ref_find_pass(tr, wl.queries, ref_passes)))
        best["rremove"] = min(best["rremove"], timed(lambda: ref_apply(tr, ref_removals, probe)))
        best["rhash"] = min(best["rhash"], timed(lambda: hash_ref(hash_ref_passes)))

    start = perf_counter()
    for r in range(prm.repeats):
        sides = [kv_round, ref_round] if have_ref else [kv_round]
        if r % 2:
            sides.reverse()
        for side in sides:
            side()
        if perf_counter() - start > prm.budget_s:
            note(f"index rounds stopped by the time budget after {r + 1} of {prm.repeats}")
            break

    rates = {  # operations per second, best run
        "hashing": n_hash_blocks * hash_kv_passes / best["hash"],
        "store events": n_store / best["store"],
        "removal events": n_remove / best["remove"],
        "find_matches": n_q * kv_passes / best["find"],
    }
    ref_rates = {}
    if have_ref:
        ref_rates = {
            "hashing": n_hash_blocks * hash_ref_passes / best["rhash"],
            "store events": n_store / best["rstore"],
            "removal events": n_remove / best["rremove"],
            "find_matches": n_q * ref_passes / best["rfind"],
        }
    else:
        print("reference: not installed", flush=True)
    for name, ours in rates.items():
        unit = "blocks per s" if name == "hashing" else "per s"
        emit(name, fmt_rate(ours), unit)
        if name in ref_rates:
            emit(f"reference {name}", fmt_rate(ref_rates[name]), unit)
            emit_ratio(name, ours, ref_rates[name])
    return problems


def bench_latency(wl: Workload, prm: Params) -> None:
    """Per-call find_matches latency on the populated index (kvemu only)."""
    idx = PrefixIndex()
    kv_store(idx, wl.stores)
    find = idx.find_matches
    queries = wl.queries
    samples: list[float] = []
    gc.collect()
    deadline = perf_counter() + max(1.0, prm.budget_s / 4)
    while len(samples) < prm.latency_calls and perf_counter() < deadline:
        for q in queries:
            t0 = perf_counter()
            find(q)
            samples.append(perf_counter() - t0)
    samples.sort()
    emit("find_matches p50", f"{percentile(samples, 50) * 1e6:.2f}", "us")
    emit("find_matches p99", f"{percentile(samples, 99) * 1e6:.2f}", "us")


def build_core(wl: Workload) -> RoutingCore:
    core = RoutingCore(block_size=BLOCK_SIZE, seed=0)
    for w in range(WORKERS):
        core.add_worker(WorkerSpec(worker_id=w, dp_size=DP_SIZE))
    store = core.index.store
    for wid, rank, parent, lh, bh in wl.stores:
        store(wid, lh, bh, parent_hash=parent, dp_rank=rank)
    # Two live requests booked per rank (pinned there), one of them past its prefill.
    rng = random.Random(1)
    n = 0
    for (wid, rank), held in sorted(wl.placements.items()):
        for j in range(2):
            p = rng.choice(held) if held else rng.randrange(len(wl.prompt_tokens))
            rid = f"live-{n}"
            n += 1
            req = core.prepare(wl.prompt_tokens[p], request_id=rid)
            sel = core.select(req, core.eligibility().pin(wid, rank).build())
            core.book(rid, sel, req)
            if j:
                core.prefill_complete(rid)
    return core


def bench_selection(wl: Workload, prm: Params) -> None:
    """tokens -> hashes -> index -> load -> cost -> pick, through RoutingCore (kvemu only)."""
    core = build_core(wl)
    prepare, select = core.prepare, core.select
    toks = wl.query_tokens

    def run(passes: int) -> None:
        for _ in range(passes):
            for t in toks:
                select(prepare(t))

    passes = calibrate(run, prm.sample_s, prm.max_passes)
    best = math.inf
    start = perf_counter()
    for _ in range(prm.select_repeats):  # best of N
        best = min(best, timed(lambda: run(passes)))
        if perf_counter() - start > prm.budget_s / 2:
            break
    emit("full selection", fmt_rate(len(toks) * passes / best), "per s")


def bench_memory(wl: Workload) -> None:
    """tracemalloc peak while building the index from (binary-encoded) events, per million entries.

    The events are decoded inside the traced region so the index pays for the hash ints it keeps,
    as a router that decodes engine events would. MB = 10**6 bytes.
    """
    encoded = [
        (wid, rank, parent, array("Q", lh).tobytes(), array("Q", bh).tobytes()) for wid, rank, parent, lh, bh in wl.stores
    ]
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        idx = PrefixIndex()
        store = idx.store
        for wid, rank, parent, lb, bb in encoded:
            lh = array("Q")
            lh.frombytes(lb)
            bh = array("Q")
            bh.frombytes(bb)
            store(wid, lh.tolist(), bh.tolist(), parent_hash=parent, dp_rank=rank)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    entries = idx.current_size
    emit("peak memory per million entries", f"{(peak - base) / entries:.1f}", "MB")


def main(argv: list[str] | None = None) -> int:
    """Print every figure; 0, or 1 when the reference and kvemu disagreed on the workload."""
    ap = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CI smoke run (< 10 s)")
    args = ap.parse_args(argv)
    prm = QUICK if args.quick else FULL
    t0 = perf_counter()
    wl = build_workload(prm.prompts)
    problems = bench_index(wl, prm)
    bench_latency(wl, prm)
    bench_selection(wl, prm)
    bench_memory(wl)
    note(f"done in {perf_counter() - t0:.1f} s")
    return verdict("index", problems)


if __name__ == "__main__":
    sys.exit(main())

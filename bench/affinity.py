"""Session-affinity and policy-queue throughput.

Prints, one per line:
  affinity cycles: N per s          (try_acquire + commit + release on a bound session, 10,000 live sessions)
  affinity first binds: N per s     (try_acquire + commit + release of a new session, then expiry)
  queue enqueue+release: N per s    (push + pop_ready, 16 ranks, fcfs, all ranks freeing up)
  queue enqueue+release wspt with pins: N per s
Each figure is the best of several rounds (a round is bounded in count), on one core, virtual time.
Run: python -m bench.affinity [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time

from kvemu import ManualClock, PolicyQueue, QueueClass, QueueEntry, SessionAffinity, seconds_to_ns

RANKS = [(w, r) for w in range(8) for r in range(2)]


def best_rate(fn, ops: int, rounds: int) -> float:
    """Best operations per second over ``rounds`` runs of ``fn`` (each performing ``ops`` operations)."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return ops / best


def affinity_cycles(sessions: int, cycles: int, rounds: int) -> float:
    clock = ManualClock()
    table = SessionAffinity.with_manual_clock(clock, ttl_secs=300, max_entries=max(65_536, sessions))
    names = [f"session-{i}" for i in range(sessions)]
    for i, s in enumerate(names):
        table.release(table.commit(table.try_acquire(s), RANKS[i % len(RANKS)]))
    order = [names[(i * 7919) % sessions] for i in range(cycles)]
    acquire, commit, release = table.try_acquire, table.commit, table.release

    def run() -> None:
        for s in order:
            hold = acquire(s)
            release(commit(hold, hold.target))
            clock.advance(1000)

    return best_rate(run, cycles, rounds)


def affinity_first_binds(count: int, rounds: int) -> float:
    def run() -> None:
        clock = ManualClock()
        table = SessionAffinity.with_manual_clock(clock, ttl_secs=1, max_entries=count + 1)
        for i in range(count):
            hold = table.try_acquire(f"s{i}")
            table.release(table.commit(hold, RANKS[i % len(RANKS)]))
        table.advance_clock(clock.now_ns() + seconds_to_ns(2))
        assert len(table) == 0

    return best_rate(run, count, rounds)


def queue_cycles(count: int, rounds: int, policy: str, pins: bool) -> float:
    load = dict.fromkeys(RANKS, 1_000)

    def run() -> None:
        q = PolicyQueue(classes=[QueueClass(busy_threshold=500, policy=policy)], prefill_tokens=load.__getitem__)
        for k in RANKS:
            load[k] = 1_000
        for i in range(count):
            pin = RANKS[i % len(RANKS)] if pins and i % 4 == 0 else None
            q.push(QueueEntry(f"r{i}", ranks=RANKS, arrival_ns=i, isl=1000 + i % 700, pin=pin))
        for k in RANKS:
            load[k] = 0
        released = 0
        while q.pop_ready() is not None:
            released += 1
        assert released == count

    return best_rate(run, count, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller, for smoke tests")
    args = parser.parse_args()
    scale, rounds = (10, 3) if args.quick else (1, 7)
    print(f"affinity cycles: {affinity_cycles(10_000, 200_000 // scale, rounds):.0f} per s")
    print(f"affinity first binds: {affinity_first_binds(100_000 // scale, rounds):.0f} per s")
    print(f"queue enqueue+release: {queue_cycles(50_000 // scale, rounds, 'fcfs', False):.0f} per s")
    print(f"queue enqueue+release wspt with pins: {queue_cycles(50_000 // scale, rounds, 'wspt', True):.0f} per s")


if __name__ == "__main__":
    main()

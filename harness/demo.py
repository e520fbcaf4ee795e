"""A small, deterministic demo of KV-aware routing decisions on virtual time.

Multi-turn chat sessions share a system prompt; each turn extends the previous one. The "engines"
here are minimal stand-ins (they cache every routed prompt and finish after a fixed time) so that the
demo shows the policy core alone: which rank each request goes to, its cached prefix and its cost.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import TextIO

from kvemu.clock import ManualClock
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore

from harness.text import counted

__all__ = ["run_demo"]


def run_demo(
    out: TextIO,
    *,
    workers: int = 4,
    dp_size: int = 2,
    sessions: int = 6,
    turns: int = 4,
    block_size: int = 16,
    seed: int = 0,
    show: int = 12,
) -> dict[str, float]:
    """Route ``sessions × turns`` requests and print the first decisions and a summary; returns it."""
    clock = ManualClock()
    core = RoutingCore(block_size=block_size, clock=clock, seed=seed)
    for w in range(workers):
        core.add_worker(WorkerSpec(worker_id=w, dp_size=dp_size, block_size=block_size))
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(8 * block_size)]
    histories = {s: list(system) for s in range(sessions)}
    arrivals = sorted((t * 5_000_000_000 + rng.randrange(1_000_000_000), s) for s in range(sessions) for t in range(turns))
    live: list[tuple[int, str]] = []
    per_rank: Counter[tuple[int, int]] = Counter()
    matched = total = 0
    out.write(f"{'time':>8}  {'request':<10} {'isl':>5}  {'rank':<6} {'cached':>6}  {'cost':>7}  candidates\n")
    for n, (t_ns, s) in enumerate(arrivals):
        clock.advance_to(max(t_ns, clock.now_ns()))
        for done_ns, rid in list(live):
            if done_ns <= clock.now_ns():
                core.free(rid)
                live.remove((done_ns, rid))
        histories[s] += [rng.randrange(32_000) for _ in range(rng.randrange(2, 6) * block_size)]
        rid = f"s{s}-t{n}"
        req = core.prepare(histories[s], request_id=rid, session_id=str(s))
        sel = core.select(req)
        core.book(rid, sel, req)
        core.index.store(sel.worker_id, req.local_hashes, req.seq_hashes, dp_rank=sel.dp_rank)  # idempotent
        core.prefill_complete(rid)
        live.append((clock.now_ns() + 2_000_000_000, rid))
        per_rank[sel.key] += 1
        matched += sel.overlap_blocks
        total += len(req.local_hashes)
        if n < show:
            costs = " ".join(f"{w}/{r}:{c:.0f}" for (w, r), c in zip(sel.evaluation.ranks, sel.evaluation.costs))
            out.write(
                f"{clock.now_ns() / 1e9:7.2f}s  {rid:<10} {req.isl:>5}  {sel.worker_id}/{sel.dp_rank:<4} "
                f"{sel.overlap_blocks:>6}  {sel.cost:7.1f}  {costs}\n"
            )
    summary = {
        "requests": float(len(arrivals)),
        "prefix_blocks_reused_ratio": matched / total if total else 0.0,
        "ranks_used": float(len(per_rank)),
    }
    out.write(f"... {counted(len(arrivals), 'request')} routed on {counted(workers, 'worker')} x "
              f"{counted(dp_size, 'DP rank')}\n")
    out.write(f"prefix blocks found cached at routing time: {matched}/{total} ({summary['prefix_blocks_reused_ratio']:.1%})\n")
    out.write("requests per rank: " + ", ".join(f"{w}/{r}={c}" for (w, r), c in sorted(per_rank.items())) + "\n")
    return summary

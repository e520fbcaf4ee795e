"""A cluster's pools as one: composing the pool routers behind their front, and reading them as one view.

Shared by the in-process cluster (``harness.run.cluster``, virtual or live) and the router process
(``harness.procs.router``): an aggregated cluster has one router, a disaggregated one a prefill and a decode
router chained by a ``DisaggRouter``. Worker ids are unique across pools (prefill first, then decode), so a
worker id names its pool's router.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvemu.clock import Clock
from kvemu.disagg import DECODE, PREFILL, DisaggRouter
from kvemu.hooks import Hooks
from kvemu.replica_front import Front
from kvemu.runtime.router import Router
from workers.config import SpeculativeConfig

from harness.report.run_data import Sample
from harness.scenario import ClusterSpec

__all__ = ["AGGREGATED", "pool_sizes", "speculative_settings", "routing_block_size", "worker_type_of", "compose_pools", "owner", "samples", "kv_stats",
           "affinity_stats"]

AGGREGATED = "aggregated"


def pool_sizes(spec: ClusterSpec) -> dict[str, dict[str, int]]:
    """``pool -> {"workers", "dp_size", "kv_blocks"}`` (KV blocks: a rank's capacity) as the report's
    ``RunData.pools`` wants it."""
    return {pool: {"workers": n, "dp_size": dp, "kv_blocks": engine.num_gpu_blocks}
            for pool, (n, dp, engine) in spec.pools().items()}


def speculative_settings(spec: ClusterSpec) -> SpeculativeConfig | None:
    """The decoding pool's speculative decoding (``RunData.speculative``): the aggregated pool's, or the decode
    pool's; None when it decodes one token a pass."""
    pools = spec.pools()
    engine = pools[DECODE if DECODE in pools else AGGREGATED][2]
    cfg: SpeculativeConfig | None = engine.speculative
    return cfg


def routing_block_size(spec: ClusterSpec) -> int:
    """The block size the report and the recorder count in: the first pool's (aggregated, or prefill: the pool
    that matches prompt prefixes)."""
    return next(iter(spec.pools().values()))[2].block_size


def worker_type_of(spec: ClusterSpec, pool: str) -> str:
    """The type a worker of ``pool`` registers as (an aggregated pool's is ``cluster.worker_type``)."""
    return spec.worker_type if pool == AGGREGATED else pool


def compose_pools(spec: ClusterSpec, make: Callable[[str], Router], *, clock: Clock, hooks: Hooks,
                  retry_limit: int) -> tuple[dict[str, Router], Front]:
    """Each pool's router (``make(pool)``) and the front requests go to: the router of an aggregated cluster,
    or a ``DisaggRouter`` over the prefill and decode routers (told which decode rank pulled its KV)."""
    routers = {pool: make(pool) for pool in spec.pools()}
    if not spec.disaggregated:
        return routers, routers[AGGREGATED]
    front = DisaggRouter(routers[PREFILL], routers[DECODE], clock=clock, hooks=hooks, retry_limit=retry_limit)
    routers[DECODE].on_kv_pulled = front.on_kv_pulled
    return routers, front


def owner(routers: Iterable[Router], worker_id: int) -> Router | None:
    """The router a worker is registered with, if any."""
    return next((r for r in routers if worker_id in r.workers), None)


def engine_group_usage(workers: Mapping[int, Any]) -> dict[tuple[int, int], dict[int, int]]:
    """Blocks held per KV cache group of every hybrid engine among in-process workers (``worker_id -> actor``)."""
    out: dict[tuple[int, int], dict[int, int]] = {}
    for wid, actor in workers.items():
        for core in getattr(getattr(actor, "worker", None), "cores", ()):
            usage = getattr(core, "group_usage", None)
            groups = usage() if usage is not None else None
            if groups is not None:
                out[(wid, core.dp_rank)] = {g: n for g, (_, _, n) in enumerate(groups)}
    return out


def samples(routers: Mapping[str, Router], now_ns: int,
            held: Mapping[tuple[int, int], dict[int, int]] | None = None) -> list[Sample]:
    """One sample of every registered rank of every pool (``pool -> router``).

    A rank's KV blocks are the blocks its router's index holds for it, except on decode ranks: they publish no
    KV events (their KV arrives by transfer), so their router's active blocks (booked prompts and outputs, what
    the decode router places by) are what they hold.
    """
    out = []
    for pool, router in routers.items():
        load = router.load
        for key in router.rank_keys():
            rl = load.rank(key)
            groups = None
            if pool == DECODE:
                blocks = round(rl.active_decode_blocks) if rl else 0
            else:
                blocks, groups = router.indexed_blocks(key)
            out.append(Sample(now_ns, key[0], key[1], rl.active_requests if rl else 0, blocks, pool, groups,
                              held.get(key) if held else None))
    return out


def kv_stats(routers: Iterable[Router]) -> dict[int, dict[str, int]]:
    """KV-event counters per worker id, over every pool."""
    return {w: s.as_dict() for r in routers for w, s in sorted(r.kv_stats.items())}


def affinity_stats(routers: Iterable[Router]) -> dict[str, int] | None:
    """Session-affinity counters summed over the pools (each binds sessions once); None without affinity."""
    tables = [r.affinity.stats.as_dict() for r in routers if r.affinity is not None]
    return {k: sum(t[k] for t in tables) for k in tables[0]} if tables else None

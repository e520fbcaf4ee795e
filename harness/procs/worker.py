"""The worker process (``kvemu worker``): one mock engine serving one router over ZeroMQ.

Each worker serves the pool its ``--worker-type`` names (``worker_pool``), publishes its KV events and, with
``--http``, serves OpenAI clients directly; with no ``--router`` it serves them alone (a member of
``kvemu fleet``: another router in front of it), and what its engines did per request (``/kvemu/requests``).
With ``--router`` repeated it serves every replica of one router (``router.replicas``) over one link
(``ReplicaEnds``).
It shuts down cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import uuid

import anyio
import msgspec

from kvemu.clock import NS_PER_S, WallClock
from kvemu.runtime.loop import run_live
from kvemu.runtime.replica_link import ReplicaEnds
from kvemu.runtime.transport import NoRouterEnd, WorkerEnd, ZmqWorkerEnd
from kvemu.wire import security
from kvemu.wire.publisher import KvEventPublisher
from workers.actor.actor import WorkerActor, WorkerRejected
from workers.mock_worker import MockWorker

from harness.run.factories import engine_config
from harness.run.pools import AGGREGATED, worker_type_of
from harness.scenario import Scenario, ScenarioError
from harness.tuning import tune_gc
from harness.procs.engine_truth import EngineTruth
from harness.procs.protocol import HttpOptions, log_start


def build_worker(scenario: Scenario, worker_id: int, pool: str, dp_size: int, kv_events: str,
                 kv_replay: str | None, end: WorkerEnd,
                 own_engine: bool = False) -> tuple[WorkerActor, list[KvEventPublisher]]:
    """One live worker of ``pool``: its engine ranks, a KV-event publisher per rank (bound on ``kv_events``, port
    + rank; ``kv_replay`` likewise, or none) and its actor on ``end`` (a router's link, or ``NoRouterEnd``);
    ``own_engine``: its engine may differ from the router's scenario on purpose (``Register.own_engine``)."""
    spec = scenario.cluster
    cfg = msgspec.structs.replace(engine_config(spec, pool), dp_size=dp_size)
    mock = MockWorker(cfg, worker_id=worker_id)
    pubs: list[KvEventPublisher] = []
    try:
        for r in range(dp_size):
            pubs.append(KvEventPublisher(kv_events, replay_endpoint=kv_replay, dp_rank=r, bind=True,
                                         vllm_version=spec.kv_events_version, hash_form=spec.kv_events_hash_form,
                                         block_hashes=spec.kv_events_block_hashes))
    except BaseException:
        for p in pubs:
            p.close(drain_timeout_s=0)
        raise
    actor = WorkerActor(mock, end, WallClock(), pubs, mode="live", heartbeat_interval_s=spec.heartbeat_interval_s,
                        kv_endpoints=[reachable(p.endpoint) for p in pubs],
                        kv_replay_endpoints=[reachable(p.replay_endpoint) if p.replay_endpoint else "" for p in pubs],
                        worker_type=worker_type_of(spec, pool))
    if own_engine:  # (its Register says so: the router takes it despite settings other than its pool's)
        actor.register_msg = msgspec.structs.replace(actor.register_msg, own_engine=True)
    return actor, pubs


async def sample_load(truth: EngineTruth, actor: WorkerActor, interval_s: float) -> None:
    """Record each live rank's load every ``interval_s`` until cancelled (``/kvemu/load``)."""
    while True:
        truth.sample(actor.clock.now_ns(), actor.worker.cores, actor.dead_ranks.__contains__)
        await anyio.sleep(interval_s)


def router_link(routers: list[str], worker_id: int, heartbeat_interval_s: float) -> WorkerEnd:
    """A worker's link: to its router, to no router (``NoRouterEnd``), or to every router replica as one link
    (``ReplicaEnds``, keeping each replica hearing from it while another keeps it busy)."""
    if not routers:
        return NoRouterEnd()
    if len(routers) == 1:
        return ZmqWorkerEnd(routers[0], worker_id)
    return ReplicaEnds([ZmqWorkerEnd(r, worker_id) for r in routers], WallClock().now_ns,
                       round(heartbeat_interval_s * NS_PER_S))


async def _serve_worker(scenario: Scenario, routers: list[str], worker_id: int, pool: str, dp_size: int,
                        kv_events: str, kv_replay: str | None, grace_s: float, http: HttpOptions | None = None,
                        own_engine: bool = False) -> None:
    end = router_link(routers, worker_id, scenario.cluster.heartbeat_interval_s)
    router = ", ".join(routers)
    actor, pubs = build_worker(scenario, worker_id, pool, dp_size, kv_events, kv_replay, end, own_engine)
    actor.on_unanswered = lambda waited_s: print(
        f"kvemu worker: worker {worker_id}: no answer from the router at {router} after {waited_s:g} s: is it running "
        f"there, and does it have the same {security.SECRET_ENV} as this worker? (still trying for "
        f"{actor.register_timeout_s - waited_s:g} s)", file=sys.stderr, flush=True)
    actor.on_chaos = lambda msg, why: print(json.dumps({"event": "chaos_applied", "worker_id": worker_id,
                                                        "action": msg.action, "dp_rank": msg.dp_rank, "error": why}),
                                            file=sys.stderr, flush=True)
    server = None
    truth = EngineTruth(worker_id)  # served with its HTTP routes: what its engines did, per request and rank
    if http is not None:
        from kvemu.http.server import HttpServer

        from harness.procs.frontdoor import worker_door, worker_listening

        app = worker_door(scenario, actor, tokenizer=http.tokenizer, model=http.model, truth=truth,
                          limits=http.admission, handoff_secret=security.secret(security.HANDOFF_SECRET_ENV))
        server = HttpServer(app, http.listen, http.server)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            if server is not None:
                await tg.start(server.serve)
                worker_listening(app, server.url)
                tg.start_soon(sample_load, truth, actor, LOAD_SAMPLE_S)
            log_start("worker", worker_id=worker_id, pool=pool, router=routers[0] if routers else None,
                      **({"routers": routers} if len(routers) > 1 else {}), kv_events=[p.endpoint for p in pubs],
                      kv_replay=[p.replay_endpoint for p in pubs], dp_size=dp_size,
                      block_size=actor.register_msg.block_size,
                      **({"http": server.url} if server is not None else {}))
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            await actor.shutdown(grace_s)
            await anyio.sleep(0.05)  # let the deregistration leave
            tg.cancel_scope.cancel()
    finally:
        if server is not None:
            from harness.procs.frontdoor import worker_closing

            with anyio.move_on_after(5.0, shield=True):
                await worker_closing(app)
        for p in pubs:
            p.close(drain_timeout_s=0.2)
        await end.aclose()


LOAD_SAMPLE_S = 0.1
"""How often a worker with no kvemu router records its ranks' load (``/kvemu/load``)."""


def reachable(endpoint: str) -> str:
    """A bound wildcard endpoint as a peer can connect to it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("tcp://*", "tcp://127.0.0.1")


def worker_pool(scenario: Scenario, worker_type: str | None) -> str:
    """The pool a ``kvemu worker --worker-type`` serves: the aggregated pool by default, or the pool it names of
    a disaggregated cluster (where it is required). ``ScenarioError`` naming the flag otherwise."""
    pools = list(scenario.cluster.pools())
    if worker_type is None and len(pools) == 1:
        return pools[0]
    if worker_type in pools:
        return worker_type
    choices = " or ".join(f"--worker-type {p}" for p in pools)
    if worker_type is None:
        raise ScenarioError(f"the scenario's cluster is disaggregated (cluster.prefill, cluster.decode): say which "
                            f"pool this worker serves with {choices}")
    raise ScenarioError(f"--worker-type {worker_type}: the scenario's cluster has no {worker_type} pool (its pools: "
                        f"{', '.join(pools)}); " + ("drop --worker-type" if pools == [AGGREGATED] else f"use {choices}"))


def worker_main(scenario: Scenario, router: str | list[str] | None, *, worker_id: int | None, dp_size: int | None,
                kv_events: str, kv_replay: str | None, grace_s: float = 10.0, http: HttpOptions | None = None,
                worker_type: str | None = None, own_engine: bool = False) -> int:
    """``kvemu worker``: serve one router until SIGTERM (and OpenAI clients directly when ``http`` is given; with
    no ``router``, them alone: a member of ``kvemu fleet``, another router in front of it);
    ``worker_type`` picks the pool (its engine and DP size) of a disaggregated cluster (``worker_pool``); several
    routers: the replicas of one router (``router.replicas``), each registering and dispatching to this worker;
    ``own_engine``: register even with engine settings other than the router's scenario (a straggler, a test)."""
    pool = worker_pool(scenario, worker_type)
    routers = [router] if isinstance(router, str) else list(router or [])
    tune_gc()
    wid = worker_id if worker_id is not None else uuid.uuid4().int % (1 << 31)
    try:
        run_live(lambda: _serve_worker(scenario, routers, wid, pool, dp_size or scenario.cluster.pools()[pool][1],
                                       kv_events, kv_replay, grace_s, http, own_engine))
    except BaseException as exc:  # the router refused it (a squatted id...) or never answered: one line, no traceback
        rejected = exc.split(WorkerRejected)[0] if isinstance(exc, BaseExceptionGroup) else exc
        while isinstance(rejected, BaseExceptionGroup) and rejected.exceptions:
            rejected = rejected.exceptions[0]
        if not isinstance(rejected, WorkerRejected):
            raise
        print(f"kvemu worker: {rejected}", file=sys.stderr, flush=True)
        return 1
    return 0

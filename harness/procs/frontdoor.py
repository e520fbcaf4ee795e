"""The OpenAI servers of kvemu's processes: the router's front door, and a worker's own vLLM-like server."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec

from kvemu.clock import Clock
from kvemu.http import DEFAULT_MODEL
from kvemu.http.admission import Admission, AdmissionLimits
from kvemu.http.app import OpenAIApp
from kvemu.http.asgi import Receive, Scope, Send
from kvemu.http.backend import RouterBackend
from kvemu.http.info import RankLoad, ServerInfo
from kvemu.http.metrics import FrontMetrics, RouterCollector
from kvemu.http.reply import respond
from kvemu.http.tokenizer import TextTokenizer, load_tokenizer
from kvemu.hooks import Hooks
from kvemu.records import EngineRecord
from kvemu.runtime.router import Router

from workers.config import EngineConfig
from workers.actor.actor import WorkerActor

from harness.run.factories import engine_config, replica_front
from harness.procs.engine_truth import EngineTruth, Unsettled
from harness.procs.replica_backend import ReplicaCollector, RouterLink, RouterProcesses
from harness.scenario import Scenario
from harness.workload.build import output_lengths

__all__ = ["cluster_kv_tokens", "front_door", "replicas_front_door", "worker_door", "worker_listening", "worker_closing"]

# a server tokenizes the prompts of one loop turn in one call: spreading that call over threads only competes
# with the engines and the event loop for the same cores
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _with_kv(limits: AdmissionLimits | None, kv_tokens: int) -> AdmissionLimits:
    """``limits`` knowing the KV cache behind the server (``AdmissionLimits.kv_tokens``), unless they say it."""
    limits = limits or AdmissionLimits()
    return limits if limits.kv_tokens is not None else msgspec.structs.replace(limits, kv_tokens=kv_tokens)


def cluster_kv_tokens(scenario: Scenario) -> int:
    """The KV cache, in tokens, of the cluster's decoding ranks (the aggregated pool's, or the decode pool's):
    where a long stream's output accumulates."""
    pools = scenario.cluster.pools()
    pool = "decode" if "decode" in pools else "aggregated"
    workers, dp_size, _ = pools[pool]
    return workers * dp_size * engine_config(scenario.cluster, pool).capacity_tokens


def front_door(scenario: Scenario, router: Callable[[], Router], hooks: Hooks, clock: Clock, *,
               tokenizer: str | None = None, model: str = DEFAULT_MODEL,
               forget: Callable[[str], None] | None = None, truth: EngineTruth | None = None,
               front: Callable[[], Any] | None = None, limits: AdmissionLimits | None = None) -> OpenAIApp:
    """The ASGI app serving OpenAI routes through ``router`` (a getter: chaos may replace the router), or
    through ``front`` (the router replicas' front door) when given; ``forget`` is told every request id that
    ended (a recorder drops its copy); ``limits``: how many requests run and wait at once."""
    engine = engine_config(scenario.cluster)
    backend = RouterBackend(router, hooks, max_model_len=engine.capacity_tokens, block_size=engine.resolved_block_size,
                            forget=forget, front=front)
    admission = Admission(_with_kv(limits, cluster_kv_tokens(scenario)))
    metrics = FrontMetrics(model, (RouterCollector(router, hooks), admission))
    tok = load_tokenizer(tokenizer)
    return OpenAIApp(backend, tok, model=model, clock=clock, metrics=metrics, output_lengths=output_lengths(scenario),
                     info=_server_info(engine, tok if tokenizer else None),
                     extra_routes=truth.routes() if truth is not None else None, admission=admission)


def replicas_front_door(scenario: Scenario, links: list[RouterLink], clock: Clock, *, tokenizer: str | None = None,
                        model: str = DEFAULT_MODEL,
                        limits: AdmissionLimits | None = None) -> tuple[OpenAIApp, RouterProcesses]:
    """The ASGI app of ``kvemu front``, and its backend: OpenAI routes over router processes (``links``, one per
    replica, spread by ``router.replica_front``), with each replica's requests and state in ``/metrics``."""
    engine = engine_config(scenario.cluster)
    backend = RouterProcesses(links, replica_front(scenario), clock, max_model_len=engine.capacity_tokens,
                              block_size=engine.resolved_block_size)
    tok = load_tokenizer(tokenizer)
    admission = Admission(_with_kv(limits, cluster_kv_tokens(scenario)))
    app = OpenAIApp(backend, tok, model=model, clock=clock,
                    metrics=FrontMetrics(model, (ReplicaCollector(backend), admission)),
                    output_lengths=output_lengths(scenario), info=_server_info(engine, tok if tokenizer else None),
                    admission=admission)
    return app, backend


def worker_door(scenario: Scenario, actor: WorkerActor, *, tokenizer: str | None = None,
                model: str = DEFAULT_MODEL, truth: EngineTruth | None = None,
                limits: AdmissionLimits | None = None, handoff_secret: str | None = None) -> OpenAIApp:
    """The ASGI app a worker serves for its own ranks, with vLLM's metrics (``X-data-parallel-rank`` pins);
    with ``truth``, also what its engines did per request (whoever sent it: a client, a router over HTTP or
    kvemu's router over ZeroMQ) and per rank (``/kvemu/requests``, ``/kvemu/load``). A prefill or decode
    worker takes another router's disaggregated legs (``harness.procs.kv_handoff``, proven with
    ``handoff_secret`` when given; ``worker_listening`` tells it where the server listens)."""
    from harness.procs.kv_handoff import KvHandoff
    from harness.procs.worker_backend import WorkerBackend
    from workers.actor.metrics import VllmMetrics

    metrics = VllmMetrics(model, lambda: actor.worker.cores)
    actor.on_sent_times = metrics.token_gaps
    if truth is None:
        actor.on_end = metrics.finished
    else:
        def ended(rec: EngineRecord, reason: str) -> None:
            metrics.finished(rec, reason)
            truth.ended(rec, reason)
        actor.on_end = ended
    engine = actor.worker.config
    tok = load_tokenizer(tokenizer)
    capacity = engine.capacity_tokens

    def loads() -> list[RankLoad]:
        return [RankLoad(c.dp_rank, c.num_running, c.num_waiting, round(c.kv_usage * capacity))
                for c in actor.worker.cores]

    info = _server_info(engine, tok if tokenizer else None, dp_ranks=tuple(actor.worker.dp_ranks), loads=loads,
                        disaggregation_mode="null" if actor.worker_type == "aggregated" else actor.worker_type)
    handoff = KvHandoff(actor, secret=handoff_secret) if actor.worker_type in ("prefill", "decode") else None
    if handoff is not None:
        metrics.registry.register(handoff)
    admission = Admission(_with_kv(limits, capacity * len(actor.worker.cores)))
    metrics.registry.register(admission)
    async def unsettled(scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /kvemu/unsettled``: what the engines still work for (a lanes barrier waits for 0)."""
        await respond(send, 200, msgspec.json.encode(Unsettled(actor.worker.unsettled(actor.clock.now_ns()))))

    routes = {**(truth.routes() if truth is not None else {}), **(handoff.routes() if handoff is not None else {}),
              ("GET", "/kvemu/unsettled"): unsettled}
    return OpenAIApp(WorkerBackend(actor, truth, handoff), tok, model=model, clock=actor.clock, metrics=metrics,
                     output_lengths=output_lengths(scenario), rank_header="x-data-parallel-rank", info=info,
                     extra_routes=routes, handoff=handoff, admission=admission)


def worker_listening(app: OpenAIApp, url: str) -> None:
    """Tell a worker's app where its server listens (a prefill worker's ``kv_transfer_params`` name it); its handoff
    says then if it runs without a secret."""
    from harness.procs.kv_handoff import KvHandoff

    if isinstance(app.handoff, KvHandoff):
        app.handoff.listening(url)


async def worker_closing(app: OpenAIApp) -> None:
    """A worker's app is done: deliver the KV releases it still owes prefill workers."""
    from harness.procs.kv_handoff import KvHandoff

    if isinstance(app.handoff, KvHandoff):
        await app.handoff.aclose()


def _server_info(engine: EngineConfig, tok: TextTokenizer | None, **kw: Any) -> ServerInfo:
    """What a server built on ``engine``'s ranks says of itself (``tok``: a tokenizer.json given, else None)."""
    return ServerInfo(kv_tokens_per_rank=engine.capacity_tokens, max_running_requests=engine.max_num_seqs,
                      engine=engine.backend, tokenizer=tok.name if tok is not None else None, **kw)

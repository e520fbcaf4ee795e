"""Prometheus metrics of the HTTP front end under Dynamo's frontend names, plus the router's view.

``FrontMetrics`` counts what the HTTP layer sees (requests by endpoint, type and status; in-flight;
time to first token as the client gets it; inter-token latency, input and output lengths).
``RouterCollector`` reads the router at scrape time: the policy queue, per-rank active decode blocks and
prefill tokens, kvemu's routing truth (cached tokens predicted vs found) and the KV-event counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvemu.clock import NS_PER_S
from kvemu.records import RequestRecord
from kvemu.hooks import HookEvent, Hooks, Routed
from kvemu.runtime.router import Router

__all__ = ["FrontMetrics", "RouterCollector", "LATENCY_BUCKETS", "REGRET_BUCKETS"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_PREFIX = "dynamo_frontend"
REGRET_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""Upper bounds of the regret-ratio histogram (Dynamo's ``router_kv_hit_rate`` steps of 0.05)."""


class FrontMetrics:
    """The front end's own counters and histograms, in a registry of their own."""

    def __init__(self, model: str, collectors: tuple[Any, ...] = ()) -> None:
        self.model = model
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{_PREFIX}_requests", "Requests the frontend finished, by endpoint, type and status",
                                ["model", "endpoint", "request_type", "status"], registry=r)
        self.inflight = Gauge(f"{_PREFIX}_inflight_requests", "Requests being served", ["model"], registry=r)
        self.ttft = Histogram(f"{_PREFIX}_time_to_first_token_seconds", "Time to first token as the client got it",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{_PREFIX}_inter_token_latency_seconds", "Mean inter-token latency of each request",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram(f"{_PREFIX}_request_duration_seconds", "Request duration as the client saw it",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.isl = Histogram(f"{_PREFIX}_input_sequence_tokens", "Prompt length", ["model"], buckets=_TOKEN_BUCKETS,
                             registry=r)
        self.osl = Histogram(f"{_PREFIX}_output_sequence_tokens", "Output length", ["model"], buckets=_TOKEN_BUCKETS,
                             registry=r)
        self._inflight = self.inflight.labels(model)
        self._ttft = self.ttft.labels(model)
        self._itl = self.itl.labels(model)
        self._duration = self.duration.labels(model)
        self._isl = self.isl.labels(model)
        self._osl = self.osl.labels(model)
        for c in collectors:
            r.register(c)

    def started(self) -> None:
        """A generation request was accepted for serving."""
        self._inflight.inc()

    def refused(self, endpoint: str, stream: bool) -> None:
        """A generation request was refused before it started (bad request, unknown model)."""
        self.requests.labels(self.model, endpoint, "stream" if stream else "unary", "error").inc()

    def ended(self, endpoint: str, stream: bool, status: str, first_ns: int | None, arrived_ns: int, now_ns: int,
              records: list[RequestRecord | None], prompt_lens: list[int]) -> None:
        """A generation request ended (``status``: success, error or cancelled)."""
        self._inflight.dec()
        self.requests.labels(self.model, endpoint, "stream" if stream else "unary", status).inc()
        if status != "success":
            return
        self._duration.observe((now_ns - arrived_ns) / NS_PER_S)
        first = records[0] if records else None
        if first_ns is not None:
            self._ttft.observe((first_ns - arrived_ns) / NS_PER_S)
        elif first is not None and first.first_token_ns is not None:  # a whole response: the router's view
            self._ttft.observe((first.first_token_ns - first.arrival_ns) / NS_PER_S)
        for rec, isl in zip(records, prompt_lens):
            if rec is None:
                continue
            self._isl.observe(isl)
            self._osl.observe(rec.output_tokens)
            n = rec.output_tokens
            if n > 1 and rec.first_token_ns is not None and rec.completion_ns is not None:
                self._itl.observe((rec.completion_ns - rec.first_token_ns) / (n - 1) / NS_PER_S)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RouterCollector:
    """The router's state at scrape time, and its routing truth counted from its hooks."""

    def __init__(self, router: Callable[[], Router], hooks: Hooks) -> None:
        self._router = router
        self.predicted_cached_tokens = 0
        self.engine_cached_tokens = 0
        self.completed = 0
        self.failed: dict[str, int] = {}
        self.lost_blocks = 0
        self.recoverable = {"peer": 0, "cache_owner": 0, "shared": 0}
        self.unrecoverable_blocks = 0
        self.regret_buckets = [0] * len(REGRET_BUCKETS)
        self.regret_sum = 0.0
        self.regret_count = 0
        hooks.subscribe(self._on_end, "completed", "failed")
        hooks.subscribe(self._on_routed, "routed")

    def _on_routed(self, ev: HookEvent) -> None:
        bs = self._router().core.block_size
        if isinstance(ev.details, Routed):
            self.predicted_cached_tokens += ev.details.overlap_blocks * bs
        rec = ev.record
        if rec is None or rec.truth_overlap_blocks is None or rec.truth_best_overlap_blocks is None:
            return
        lost = rec.truth_best_overlap_blocks - rec.truth_overlap_blocks
        novel = max(rec.isl // bs - rec.truth_best_overlap_blocks, 0)
        self.unrecoverable_blocks += novel
        if lost > 0:  # (Dynamo's proposal: the ratio of a request that lost something, in (0, 1])
            self.lost_blocks += lost
            self.recoverable[rec.regret_source or "shared"] += lost
            ratio = lost / (novel + lost)
            self.regret_sum += ratio
            self.regret_count += 1
            for i, bound in enumerate(REGRET_BUCKETS):
                if ratio <= bound:
                    self.regret_buckets[i] += 1

    def _on_end(self, ev: HookEvent) -> None:
        rec = ev.record
        if ev.kind == "failed":
            reason = ((rec.failure if rec is not None else None) or "unknown").split(":", 1)[0]
            self.failed[reason] = self.failed.get(reason, 0) + 1
            return
        self.completed += 1
        self.engine_cached_tokens += (rec.engine.cached_tokens if rec is not None else None) or 0

    def collect(self) -> Iterator[Any]:
        router = self._router()
        core = router.core
        queue = router.queue
        g = GaugeMetricFamily(f"{_PREFIX}_queued_requests", "Requests waiting in the router's policy queue")
        g.add_metric([], len(queue) if queue is not None else 0)
        yield g
        blocks = GaugeMetricFamily(f"{_PREFIX}_worker_active_decode_blocks",
                                   "Active KV blocks the router counts on each rank", labels=["worker_id", "dp_rank"])
        prefill = GaugeMetricFamily(f"{_PREFIX}_worker_active_prefill_tokens",
                                    "Prefill tokens the router counts on each rank", labels=["worker_id", "dp_rank"])
        for key in core.registry.rank_keys():
            rl = core.load.rank(key)
            labels = [str(key[0]), str(key[1])]
            blocks.add_metric(labels, rl.active_decode_blocks if rl is not None else 0)
            prefill.add_metric(labels, rl.active_prefill_tokens if rl is not None else 0)
        yield blocks
        yield prefill
        c = CounterMetricFamily("kvemu_router_cached_tokens", "Prompt tokens cached: as the router predicted at each "
                                "routing decision, and as the engines found them in completed requests",
                                labels=["source"])
        c.add_metric(["predicted"], self.predicted_cached_tokens)
        c.add_metric(["engine"], self.engine_cached_tokens)
        yield c
        yield from self._regret()
        done = CounterMetricFamily("kvemu_router_requests", "Requests the router ended", labels=["outcome"])
        done.add_metric(["completed"], self.completed)
        for reason in sorted(self.failed):
            done.add_metric([f"failed:{reason}"], self.failed[reason])
        yield done
        kv = CounterMetricFamily("kvemu_kv_events", "KV-event stream counters per worker",
                                 labels=["worker_id", "counter"])
        for wid, stats in sorted(router.kv_stats.items()):
            for name, value in stats.as_dict().items():
                kv.add_metric([str(wid), name], value)
        yield kv

    def _regret(self) -> Iterator[Any]:
        """Routing regret against the engines' truth (Dynamo's locality-metrics proposal, under kvemu's names)."""
        lost = CounterMetricFamily("kvemu_router_overlap_blocks_lost", "Prompt blocks a better eligible rank had "
                                   "cached than the chosen one, at each routing decision")
        lost.add_metric([], self.lost_blocks)
        yield lost
        rec = CounterMetricFamily("kvemu_router_recoverable_prefill_blocks", "Lost blocks by where they were cached: "
                                  "another rank of the chosen worker, the session's last rank, another rank",
                                  labels=["source_class"])
        for name, value in self.recoverable.items():
            rec.add_metric([name], value)
        yield rec
        unrec = CounterMetricFamily("kvemu_router_unrecoverable_prefill_blocks", "Prompt blocks no eligible rank "
                                    "had cached at the routing decision")
        unrec.add_metric([], self.unrecoverable_blocks)
        yield unrec
        h = HistogramMetricFamily("kvemu_router_overlap_regret_ratio", "lost / (novel + lost) of each request that "
                                  "lost blocks")
        # (the counts are cumulative already: a ratio counts in every bucket whose bound is at least it)
        h.add_metric([], [(str(b), n) for b, n in zip(REGRET_BUCKETS, self.regret_buckets)]
                     + [("+Inf", self.regret_count)], sum_value=self.regret_sum)
        yield h


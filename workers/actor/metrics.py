"""A worker's Prometheus metrics under vLLM's names and labels (``model_name``, ``engine`` = DP rank).

Counters and histograms are observed when a request ends on the worker (dispatched by the router or
sent to the worker's own HTTP server); the gauges are read from the engine cores at scrape time.
Histogram buckets are vLLM's defaults, so dashboards and recording rules written for vLLM work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvemu.clock import NS_PER_S
from kvemu.records import EngineRecord
from workers.rank_engine import RankEngine

__all__ = ["VllmMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "REQUEST_LATENCY_BUCKETS"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


class VllmMetrics:
    """vLLM's engine metrics for the ranks of one worker; ``cores`` is read at every scrape."""

    def __init__(self, model: str, cores: Callable[[], Sequence[RankEngine]]) -> None:
        self.model = model
        self._cores = cores
        r = self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions", labels, registry=r)
        self.success = Counter("vllm:request_success", "Requests finished", [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", labels, buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time requests spent waiting", labels,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        r.register(_Gauges(self))
        self._ranks: dict[int, _Rank] = {}
        for core in cores():  # every series exists from the start, at 0, as vLLM exports them
            self._rank(core.dp_rank)

    def started(self) -> None:
        """The HTTP layer's request hooks: a worker counts requests in its engines (``finished``), not there."""

    def refused(self, endpoint: str, stream: bool) -> None:
        """See ``started``."""

    def ended(self, *args: Any) -> None:
        """See ``started``."""

    def _rank(self, rank: int) -> _Rank:
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank(self, (self.model, str(rank)))
        return r

    def token_gaps(self, rec: EngineRecord, times: Sequence[int]) -> None:
        """Observe the inter-token gaps of ``times``, consecutive token times of ``rec`` (a live worker tells
        them as it drops them, the rest at ``finished``)."""
        observe = self._rank(rec.dp_rank or 0).itl.observe
        for a, b in zip(times, times[1:]):
            observe((b - a) / NS_PER_S)

    def finished(self, rec: EngineRecord, reason: str) -> None:
        """A request ended on a rank (``reason``: ``length``, ``stop`` or ``abort``)."""
        r = self._rank(rec.dp_rank or 0)
        success = r.success.get(reason)
        if success is None:
            success = r.success[reason] = self.success.labels(self.model, str(rec.dp_rank or 0), reason)
        success.inc()
        facts = rec.engine
        if facts.admitted_ns is not None:
            r.prefix_queries.inc(rec.isl)
            r.prefix_hits.inc(facts.cached_tokens or 0)
            r.prompt_tokens.inc(rec.isl)
            r.queue.observe((facts.admitted_ns - rec.arrival_ns) / NS_PER_S)
        if rec.output_tokens:
            r.generation_tokens.inc(rec.output_tokens)
        if facts.preemptions:
            r.preemptions.inc(facts.preemptions)
        if rec.first_token_ns is not None:
            r.ttft.observe((rec.first_token_ns - rec.arrival_ns) / NS_PER_S)
            times = rec.token_times_ns
            self.token_gaps(rec, times)
            end = rec.completion_ns if rec.completion_ns is not None else (times[-1] if times else None)
            if end is not None:
                r.e2e.observe((end - rec.arrival_ns) / NS_PER_S)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Rank:
    """One rank's labelled children, looked up once (``labels()`` costs more than the observation)."""

    def __init__(self, m: VllmMetrics, labels: tuple[str, str]) -> None:
        self.success: dict[str, Any] = {reason: m.success.labels(*labels, reason) for reason in ("stop", "length", "abort")}
        self.prefix_queries = m.prefix_queries.labels(*labels)
        self.prefix_hits = m.prefix_hits.labels(*labels)
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.generation_tokens = m.generation_tokens.labels(*labels)
        self.preemptions = m.preemptions.labels(*labels)
        self.ttft = m.ttft.labels(*labels)
        self.itl = m.itl.labels(*labels)
        self.e2e = m.e2e.labels(*labels)
        self.queue = m.queue.labels(*labels)


class _Gauges:
    def __init__(self, owner: VllmMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Any]:
        owner = self._owner
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in model execution batches", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be processed", labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent)", labels=labels)
        spec = [CounterMetricFamily(f"vllm:spec_decode_num_{name}", doc, labels=labels) for name, doc in (
            ("drafts", "Decode passes that verified drafts, per request"), ("draft_tokens", "Draft tokens verified"),
            ("accepted_tokens", "Draft tokens accepted"))]
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts accepted per position",
                                      labels=[*labels, "position"])
        speculative = False
        for core in owner._cores():
            key = [owner.model, str(core.dp_rank)]
            running.add_metric(key, core.num_running)
            waiting.add_metric(key, core.num_waiting)
            usage.add_metric(key, core.kv_usage)
            draws = core.spec
            if draws is not None:  # vLLM exports these only with speculative decoding on
                speculative = True
                for family, value in zip(spec, (draws.drafts, draws.draft_tokens, draws.accepted)):
                    family.add_metric(key, value)
                for pos, value in enumerate(draws.accepted_per_pos):
                    per_pos.add_metric([*key, str(pos)], value)
        yield running
        yield waiting
        yield usage
        if speculative:
            yield from spec
            yield per_pos

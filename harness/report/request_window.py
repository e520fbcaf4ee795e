"""The requests of the last window (arrived, completed, failed) and their latency percentiles, from the hooks."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kvemu.autoscale.snapshot import Percentiles
from kvemu.clock import NS_PER_MS
from kvemu.records import RequestRecord
from kvemu.hooks import HookEvent, Hooks

from harness.report.stats import percentile

__all__ = ["RequestWindow", "percentiles"]


def percentiles(values_ns: list[int]) -> Percentiles | None:
    """p50/p90/p99 of ``values_ns`` in ms (the report's definition), or None when there are none."""
    if not values_ns:
        return None
    s = sorted(values_ns)
    return Percentiles(p50=percentile(s, 50) / NS_PER_MS, p90=percentile(s, 90) / NS_PER_MS,
                       p99=percentile(s, 99) / NS_PER_MS, count=len(s))


class RequestWindow:
    """Hook observer keeping when requests arrived, completed and failed; reads their records (the recorder's)
    only when asked, by then complete. Entries older than the window are dropped at each ``prune``."""

    def __init__(self, hooks: Hooks, records: Mapping[str, RequestRecord]) -> None:
        self.records = records
        self.arrived_total = 0
        self.ended_total = 0
        self.arrivals: deque[int] = deque()
        self.completions: deque[tuple[int, str]] = deque()
        self.failures: deque[int] = deque()
        hooks.subscribe(self._on_event, "request_arrived", "completed", "failed")

    def _on_event(self, ev: HookEvent) -> None:
        if ev.kind == "request_arrived":
            self.arrived_total += 1
            self.arrivals.append(ev.time_ns)
            return
        self.ended_total += 1
        if ev.kind == "completed":
            self.completions.append((ev.time_ns, ev.request_id or ""))
        else:
            self.failures.append(ev.time_ns)

    @property
    def in_flight(self) -> int:
        """Requests arrived and not ended."""
        return self.arrived_total - self.ended_total

    def prune(self, now_ns: int, window_ns: int) -> None:
        """Forget what happened at or before ``now_ns - window_ns``."""
        cutoff = now_ns - window_ns
        for q in (self.arrivals, self.failures):
            while q and q[0] <= cutoff:
                q.popleft()
        while self.completions and self.completions[0][0] <= cutoff:
            self.completions.popleft()

    def latencies(self) -> tuple[list[int], list[int], list[int]]:
        """TTFT, every inter-token gap and E2E (ns) of the requests completed in the window."""
        ttft: list[int] = []
        itl: list[int] = []
        e2e: list[int] = []
        for _, rid in self.completions:
            rec = self.records.get(rid)
            if rec is None or rec.completion_ns is None:
                continue
            e2e.append(rec.completion_ns - rec.arrival_ns)
            times = rec.token_times_ns
            first = rec.first_token_ns if rec.first_token_ns is not None else (times[0] if times else None)
            if first is not None:
                ttft.append(first - rec.arrival_ns)
            itl.extend(b - a for a, b in zip(times, times[1:]))
        return ttft, itl, e2e

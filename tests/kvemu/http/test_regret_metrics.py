"""The front door's routing-regret counters, from the records the router's ``routed`` hook carries."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvemu.hooks import HookEvent, HookKind, Hooks, Routed
from kvemu.http.metrics import RouterCollector
from kvemu.records import RequestRecord


class _Regret:
    """Just the collector's regret families (the rest reads a live router)."""

    def __init__(self, collector: RouterCollector) -> None:
        self.collector = collector

    def collect(self):
        return self.collector._regret()


def _routed(hooks: Hooks, isl: int, chosen: int | None, best: int | None, source: str | None) -> None:
    rec = RequestRecord(request_id="r", isl=isl, truth_overlap_blocks=chosen, truth_best_overlap_blocks=best,
                        regret_source=source)
    details = Routed(attempt=0, reason="kv", cost=0.0, overlap_blocks=chosen or 0, best_overlap_blocks=best or 0,
                     candidates=[])
    hooks.emit(HookEvent(HookKind.ROUTED, 0, "r", 0, 0, details, record=rec))


def test_regret_counters_follow_the_truth_on_each_routed_request():
    hooks = Hooks()
    router = SimpleNamespace(core=SimpleNamespace(block_size=16))
    collector = RouterCollector(lambda: router, hooks)  # type: ignore[arg-type,return-value]
    _routed(hooks, 160, 2, 6, "peer")        # 10 blocks: lost 4, novel 4 -> ratio 0.5
    _routed(hooks, 160, 0, 9, "cache_owner")  # lost 9, novel 1 -> 0.9
    _routed(hooks, 160, 5, 5, None)          # nothing lost, novel 5
    _routed(hooks, 160, None, None, None)    # no truth (another process): not counted
    registry = CollectorRegistry()
    registry.register(_Regret(collector))  # type: ignore[arg-type]
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    total = lambda name: {tuple(sorted(s.labels.items())): s.value for s in fams[name].samples  # noqa: E731
                          if s.name.endswith("_total")}
    assert total("kvemu_router_overlap_blocks_lost") == {(): 13}
    assert total("kvemu_router_recoverable_prefill_blocks") == {
        (("source_class", "peer"),): 4, (("source_class", "cache_owner"),): 9, (("source_class", "shared"),): 0}
    assert total("kvemu_router_unrecoverable_prefill_blocks") == {(): 10}
    h = {(s.name, s.labels.get("le")): s.value for s in fams["kvemu_router_overlap_regret_ratio"].samples}
    assert h[("kvemu_router_overlap_regret_ratio_count", None)] == 2
    assert h[("kvemu_router_overlap_regret_ratio_bucket", "0.45")] == 0
    assert h[("kvemu_router_overlap_regret_ratio_bucket", "0.5")] == 1
    assert h[("kvemu_router_overlap_regret_ratio_bucket", "0.9")] == 2
    assert abs(h[("kvemu_router_overlap_regret_ratio_sum", None)] - 1.4) < 1e-9

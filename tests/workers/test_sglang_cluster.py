"""The SGLang flavour in a virtual cluster: its workers publish eviction-only KV events lazily and the router
syncs them before every decision, which must change nothing the router decides or the engines do."""

from __future__ import annotations

import json

import pytest

import workers.actor.actor
from harness.run.runner import run_scenario
from harness.scenario import parse_scenario
from workers.config import EngineConfig
from workers.request import Request
from workers.sglang.engine import SglangEngineCore

SCENARIO = {
    "name": "sglang-kv",
    "cluster": {"workers": 3, "dp_size": 2, "engine": {"backend": "sglang", "num_gpu_blocks": 4096}},
    "router": {"policy": "kv"},
    "workload": {"kind": "synthetic", "rate_rps": 40, "turns": 3, "think_time_s": 0.05, "system_prefix_tokens": 256,
                 "num_prefix_groups": 4, "isl": {"kind": "constant", "mean": 600}, "osl": {"kind": "constant", "mean": 40}},
    "run": {"mode": "virtual", "seed": 5, "max_requests": 120},
}


def outcomes(defer: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple], dict]:
    if not defer:
        monkeypatch.setattr(workers.actor.actor.WorkerActor, "defer_kv_events", lambda self: None)
    data = run_scenario(parse_scenario(json.dumps(SCENARIO)), None).data
    recs = sorted((r.request_id, r.worker_id, r.dp_rank, r.predicted_overlap_blocks, r.first_token_ns,
                   r.completion_ns, r.engine.reused_tokens, r.failure) for r in data.records)
    return recs, data.kv_stats


def test_lazy_eviction_events_change_no_decision(monkeypatch):
    lazy, lazy_kv = outcomes(True, monkeypatch)
    eager, eager_kv = outcomes(False, monkeypatch)
    assert len(lazy) == 120 and all(r[-1] is None for r in lazy)
    assert any(r[3] for r in lazy)  # the router did find cached prefixes (1-token blocks)
    assert lazy == eager  # same ranks, same predicted overlaps, same times, same reuse
    assert lazy_kv == eager_kv


def test_a_deferring_core_reports_only_completions_and_starts():
    """With defer_kv_events the next event skips decode passes that only evict; advancing there gives the same
    passes and events as stepping through them."""
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=1200)

    def reqs():
        return [Request(request_id="a", token_ids=list(range(1, 1001)), max_tokens=1, arrival_ns=0),
                Request(request_id="b", token_ids=list(range(5001, 5101)), max_tokens=400, arrival_ns=10**8)]

    lazy, eager = SglangEngineCore(cfg), SglangEngineCore(cfg)
    lazy.defer_kv_events = True
    for core in (lazy, eager):
        for r in reqs():
            core.add_request(r)
    runs = {}
    for name, core in (("lazy", lazy), ("eager", eager)):
        wakes, batches = 0, []
        while (t := core.next_event_ns()) is not None:
            wakes += 1
            batches += [(b.ts, [type(e).__name__ for e in b.events]) for b in core.advance_to(t).kv_batches]
        runs[name] = wakes, batches, core.passes
    assert runs["lazy"][1] == runs["eager"][1] and runs["lazy"][2] == runs["eager"][2]
    evicting = sum(1 for _, kinds in runs["eager"][1] if "BlockRemoved" in kinds)
    assert evicting == 300  # b grows into the 300 pages a left cached, one page (token) a pass
    assert runs["lazy"][0] < runs["eager"][0] - evicting + 10


def test_the_router_sees_the_evictions_made_since_it_last_decided(monkeypatch):
    """A decode on worker 0 evicts a cached prompt page by page (its only visible effect: KV events its worker
    defers); a request for that prompt routed mid-way is predicted the overlap an eager worker would have
    told the router by then."""
    import anyio

    from harness.run.cluster import cluster
    from kvemu import ManualClock
    from kvemu.hooks import Hooks
    from kvemu.runtime.loop import run_virtual
    from kvemu.messages import ClientRequest

    scenario = parse_scenario(json.dumps({
        "cluster": {"workers": 2, "engine": {"backend": "sglang", "num_gpu_blocks": 1200}},
        "router": {"policy": "kv"}, "run": {"mode": "virtual", "seed": 1}}))
    prompt = list(range(1, 1001))

    def predicted() -> int:
        clock = ManualClock()

        async def main():
            async with cluster(scenario, clock, Hooks()) as c:
                await c.router.handle(ClientRequest(request_id="a", tokens=prompt, max_tokens=1, worker_id=0))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(c.router.handle, ClientRequest(request_id="b", tokens=list(range(5001, 5151)),
                                                                 max_tokens=900, worker_id=0))
                    await anyio.sleep(4.0)  # b has grown past the free pages into a's
                    return await c.router.handle(ClientRequest(request_id="c", tokens=prompt, max_tokens=1,
                                                               worker_id=0))

        rec = run_virtual(main, clock)
        assert rec.failure is None
        return rec.predicted_overlap_blocks

    lazy = predicted()
    monkeypatch.setattr(workers.actor.actor.WorkerActor, "defer_kv_events", lambda self: None)
    assert lazy == predicted()
    assert 0 < lazy < 1000  # evictions had reached the router: only part of the prompt was still there

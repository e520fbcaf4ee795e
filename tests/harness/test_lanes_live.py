"""Lanes over HTTP (``kvemu loadgen --http``): the warm-up's barrier asks the workers whether they settled, and
at the deadline a request still open has its stream closed, so the worker aborts it and frees its KV. Live, on
127.0.0.1 only."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvemu import WallClock
from kvemu.hooks import Hooks
from kvemu.http.server import HttpServer
from kvemu.http.tokenizer import builtin_tokenizer
from kvemu.runtime.loop import run_live

from harness.workload.agentic_corpus import corpus_rows
from harness.run.cluster import cluster
from harness.workload.lanes import DEADLINE_REASON
from harness.procs.engine_truth import EngineTruth
from harness.procs.frontdoor import worker_door
from harness.procs.http_loadgen import HttpTarget, _play
from harness.scenario import parse_scenario
from harness.workload.sessions import Played

from tests.harness.trace_files import write


def test_at_the_deadline_open_requests_are_aborted_at_the_worker_and_their_kv_freed(tmp_path: Path):
    write(tmp_path / "c.jsonl", corpus_rows(4))
    lanes = {"lanes": 2, "duration_s": 1.0, "grace_s": 0, "snapshot_seed": 3, "warmup": True, "warmup_requests": 2,
             "tree_idle_cap_s": 0.05, "global_idle_cap_s": 0.05}  # (no long waits on recorded tool times)
    sc = parse_scenario(  # decode 20 times slower than the model: a turn of ~100 tokens outlives the deadline
        "name: lanes-live\ncluster: {workers: 1, engine: {block_size: 64, decode_speedup_ratio: 0.05}}\n"
        f"workload: {{kind: trace, trace: c.jsonl, lanes: {json.dumps(lanes)}}}\nrun: {{mode: live, seed: 1}}\n",
        base_dir=tmp_path)

    async def main():
        async with cluster(sc, WallClock(), Hooks()) as c:
            actor = c.workers[min(c.workers)]
            truth = EngineTruth(actor.worker_id)
            server = HttpServer(worker_door(sc, actor, truth=truth), "127.0.0.1:0")
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                try:
                    with anyio.fail_after(60):
                        target = HttpTarget(server.url, model="kvemu", tokenizer=builtin_tokenizer())
                        played = Played()
                        records, finished, stopped = await _play(sc, target, played, [server.url])
                        core = actor.worker.cores[0]
                        held = core.pool.num_active_blocks
                        unsettled = actor.worker.unsettled(actor.clock.now_ns())
                        async with httpx.AsyncClient(base_url=server.url) as http:
                            metrics = (await http.get("/metrics")).text
                        return records, played, held, unsettled, metrics, truth.records_page().records
                finally:
                    tg.cancel_scope.cancel()

    records, played, held, unsettled, metrics, engine = run_live(main)
    report = played.lanes
    assert report is not None and report.unsettled_server_requests == 0  # the barrier asked the worker over HTTP
    cancelled = {r.request_id for r in records if r.failure == DEADLINE_REASON}
    assert cancelled and len(cancelled) == report.requests_cancelled
    assert all(played.phases[rid] == "profile" for rid in cancelled)
    # the worker aborted them: no KV held, nothing left to do, and its engine records and metrics say so
    assert held == 0 and unsettled == 0
    aborted = {r.request_id for r in engine if r.failure == "client_disconnected"}
    assert aborted == cancelled
    value = {(s.name, s.labels.get("finished_reason")): s.value
             for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert value[("vllm:request_success_total", "abort")] == len(cancelled)


"""``kvemu loadgen`` on lanes against real router and worker processes: at the deadline the requests still
open are cancelled at the router (``CancelRequest``), their worker aborts them, and their records say
``lanes_deadline``."""

from __future__ import annotations

import json

import anyio
import httpx

from harness.workload.agentic_corpus import corpus_rows
from harness.procs.loadgen import _loadgen
from harness.procs.up import Children
from harness.scenario import load_scenario
from tests.harness.trace_files import write


def test_lanes_cancel_their_open_requests_at_the_router_and_the_worker_aborts_them(tmp_path):
    write(tmp_path / "c.jsonl", corpus_rows(4))
    lanes = {"lanes": 2, "duration_s": 1.0, "grace_s": 0, "tree_idle_cap_s": 0.05, "global_idle_cap_s": 0.05}
    path = tmp_path / "s.yaml"
    path.write_text("name: lanes-procs\ncluster: {workers: 1, engine: {block_size: 64, decode_speedup_ratio: 0.05}}\n"
                    f"workload: {{kind: trace, trace: c.jsonl, lanes: {json.dumps(lanes)}}}\n"
                    "run: {mode: live, seed: 2}\n")
    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(path)])
        worker = kids.start("w0", ["worker", "--router", router["listen"], "--worker-id", "0", "--config", str(path),
                                   "--http", "127.0.0.1:0"])

        async def main():
            with anyio.fail_after(60):
                summary, _ = await _loadgen(load_scenario(path), router["listen"], tmp_path / "out", 1)
                async with httpx.AsyncClient(base_url=worker["http"]) as http:
                    unsettled = (await http.get("/kvemu/unsettled")).json()["requests"]
                    while unsettled:  # (the aborts may reach the worker after the router answered)
                        await anyio.sleep(0.01)
                        unsettled = (await http.get("/kvemu/unsettled")).json()["requests"]
                    engine = (await http.get("/kvemu/requests")).json()["records"]
            return summary, engine

        summary, engine = anyio.run(main)
    finally:
        kids.stop_all()
    rows = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").open()]
    cancelled = {r["request_id"] for r in rows if r["failure"] == "lanes_deadline"}
    assert cancelled and len(cancelled) == summary.kvemu.lanes.requests_cancelled
    aborted = {r["request_id"].split("/", 1)[1] for r in engine if r["failure"] == "lanes_deadline"}
    assert aborted == cancelled  # the worker's own records: aborted for that reason

"""A worker's own vLLM-like HTTP server: rank pins, vLLM's metric names, and Dynamo's router in front of it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvemu import WallClock
from kvemu.http.server import HttpServer
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_live

from harness.run.cluster import cluster
from harness.procs.frontdoor import worker_door
from harness.scenario import parse_scenario
from harness.procs.up import cli_command, cli_env
from workers.actor.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

SCENARIO = """
name: worker-http
cluster:
  workers: 1
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 2048, speedup_ratio: 50, decode_speedup_ratio: 50}
router: {policy: kv}
run: {mode: live, seed: 5}
"""
BS = 16


def serve_worker(body, overrides: list[str] | None = None):
    """Run ``body(http, actor)`` against worker 0's own HTTP server in a live in-process cluster."""
    sc = parse_scenario(SCENARIO, overrides=overrides)
    clock = WallClock()

    async def main():
        async with cluster(sc, clock, Hooks()) as c:
            actor = c.workers[min(c.workers)]
            server = HttpServer(worker_door(sc, actor), "127.0.0.1:0")
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                try:
                    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                        with anyio.fail_after(60):
                            return await body(http, actor)
                finally:
                    tg.cancel_scope.cancel()

    return run_live(main)


def test_the_rank_header_pins_and_round_robin_spreads():
    async def body(http, actor):
        pinned, spread = [], []
        for rank in (1, 0, 1):
            r = await http.post("/v1/completions", headers={"X-data-parallel-rank": str(rank)},
                                json={"model": "kvemu", "prompt": "pin this", "max_tokens": 2,
                                      "nvext": {"extra_fields": ["worker_id"]}})
            pinned.append((rank, r.json()["nvext"]["worker_id"]["decode_dp_rank"]))
        for i in range(4):
            r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": f"spread {i}", "max_tokens": 2,
                                                         "nvext": {"extra_fields": ["worker_id"]}})
            spread.append(r.json()["nvext"]["worker_id"]["decode_dp_rank"])
        bad = await http.post("/v1/completions", headers={"X-data-parallel-rank": "7"},
                              json={"model": "kvemu", "prompt": "x", "max_tokens": 2})
        return pinned, spread, bad.status_code, bad.json()["error"]["message"]

    pinned, spread, status, message = serve_worker(body)
    assert all(want == got for want, got in pinned)
    assert sorted(spread) == [0, 0, 1, 1]
    assert status == 400 and message == "x-data-parallel-rank: 7 is not a rank of this server (its ranks: 0, 1)"


def test_sglangs_body_rank_pins_and_a_bad_rank_is_a_400_naming_its_field():
    async def body(http, actor):
        async def post(rank_field, headers=None):
            return await http.post("/v1/completions", headers=headers or {},
                                   json={"model": "kvemu", "prompt": "pin this", "max_tokens": 2,
                                         "nvext": {"extra_fields": ["worker_id"]}, **rank_field})
        pinned = []
        for rank in (1, 1, 0):
            r = await post({"data_parallel_rank": rank})
            pinned.append(r.json()["nvext"]["worker_id"]["decode_dp_rank"])
        agree = await post({"data_parallel_rank": 1}, {"X-data-parallel-rank": "1"})
        bad = [await post(field, headers) for field, headers in (
            ({"data_parallel_rank": 2}, None), ({"data_parallel_rank": -1}, None), ({"data_parallel_rank": True}, None),
            ({"data_parallel_rank": 1.0}, None), ({"data_parallel_rank": "1"}, None),
            ({"data_parallel_rank": 0}, {"X-data-parallel-rank": "1"}),
            ({"nvext": {"dp_rank": 0, "extra_fields": []}}, {"X-data-parallel-rank": "1"}))]
        return pinned, agree.json()["nvext"]["worker_id"]["decode_dp_rank"], [
            (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) for r in bad]

    pinned, agreed, bad = serve_worker(body)
    assert pinned == [1, 1, 0] and agreed == 1
    assert bad[0] == (400, "data_parallel_rank", "data_parallel_rank: 2 is not a rank of this server (its ranks: 0, 1)")
    assert [(status, param) for status, param, _ in bad[1:5]] == [(400, "data_parallel_rank")] * 4
    assert bad[5] == (400, "data_parallel_rank", "data_parallel_rank: 0 disagrees with x-data-parallel-rank: 1; "
                                                  "give one rank")
    assert bad[6][:2] == (400, "nvext.dp_rank")


def test_a_worker_describes_itself_as_vllm_and_sglang_servers_do():
    """What sglang-router and vllm-router read of a worker before routing to it: its DP size, page (block) size,
    model and context length, per-rank load, and the token ids of a text prompt (vLLM's render)."""
    async def body(http, actor):
        got = {path: (await http.get(path)) for path in (
            "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models", "/get_load",
            "/health", "/health_generate")}
        ids = (await http.post("/tokenize", json={"prompt": "render me, please"})).json()["tokens"]
        chat_ids = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()["tokens"]
        render = await http.post("/v1/completions/render", json={"model": "kvemu", "max_tokens": 5,
                                                                 "prompt": ["render me, please", "render me, please"]})
        render_ids = await http.post("/v1/completions/render", json={"prompt": [7, 8]})
        render_chat = await http.post("/v1/chat/completions/render",
                                      json={"model": "kvemu", "messages": [{"role": "user", "content": "hi"}]})
        wrong_model = await http.post("/v1/completions/render", json={"model": "other", "prompt": "x"})
        return got, ids, chat_ids, render, render_ids.json(), render_chat, wrong_model

    got, ids, chat_ids, render, render_ids, render_chat, wrong_model = serve_worker(body)
    assert {path: r.status_code for path, r in got.items()} == dict.fromkeys(got, 200)
    info = got["/server_info"].json()
    assert info == got["/get_server_info"].json()
    assert {k: info[k] for k in ("dp_size", "page_size", "block_size", "model_path", "served_model_name",
                                 "tokenizer_path", "max_model_len", "context_length", "max_total_num_tokens",
                                 "disaggregation_mode")} == {
        "dp_size": 2, "page_size": BS, "block_size": BS, "model_path": "kvemu", "served_model_name": "kvemu",
        "tokenizer_path": "kvemu", "max_model_len": 2048 * BS, "context_length": 2048 * BS,
        "max_total_num_tokens": 2048 * BS, "disaggregation_mode": "null"}
    model = got["/model_info"].json()
    assert model == got["/get_model_info"].json()
    assert model["model_path"] == "kvemu" and model["is_generation"] is True
    assert [m["id"] for m in got["/v1/models"].json()["data"]] == ["kvemu"]
    assert got["/get_load"].json() == [{"dp_rank": r, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
                                       for r in (0, 1)]
    assert render.status_code == 200 and render_chat.status_code == 200
    prompts = render.json()
    assert [p["token_ids"] for p in prompts] == [ids, ids]
    assert len({p["request_id"] for p in prompts}) == 2
    assert all(p["model"] == "kvemu" and p["sampling_params"]["max_tokens"] == 5 for p in prompts)
    assert [p["token_ids"] for p in render_ids] == [[7, 8]]
    assert render_chat.json()["token_ids"] == chat_ids
    assert wrong_model.status_code == 404


def test_get_load_counts_each_ranks_requests_and_kv_tokens():
    async def body(http, actor):
        async with http.stream("POST", "/v1/completions", headers={"X-data-parallel-rank": "1"},
                               json={"model": "kvemu", "prompt": list(range(1, 1 + 4 * BS)), "max_tokens": 20000,
                                     "ignore_eos": True, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
            return (await http.get("/get_load")).json()

    load = serve_worker(body)
    assert load[0] == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert load[1]["dp_rank"] == 1 and load[1]["num_reqs"] == 1 and load[1]["num_waiting_reqs"] == 0
    assert load[1]["num_tokens"] >= 4 * BS


def test_vllm_metrics_count_what_the_engines_did():
    prompt = list(range(1, 1 + 6 * BS))

    async def body(http, actor):
        outs = []
        for _ in range(3):  # the same prompt on rank 0: the second and third find 5 blocks cached
            r = await http.post("/v1/completions", headers={"X-data-parallel-rank": "0"},
                                json={"model": "kvemu", "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
            outs.append(r.json()["usage"])
        stream = await http.post("/v1/chat/completions", headers={"X-data-parallel-rank": "1"},
                                 json={"model": "kvemu", "messages": [{"role": "user", "content": "hello there"}],
                                       "max_tokens": 3, "ignore_eos": True, "stream": True})
        assert stream.text.endswith("data: [DONE]\n\n")
        return outs, (await http.get("/metrics")).text

    outs, text = serve_worker(body)
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in outs] == [0, 5 * BS, 5 * BS]
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    r0 = (("engine", "0"), ("model_name", "kvemu"))
    r1 = (("engine", "1"), ("model_name", "kvemu"))
    assert value[("vllm:prompt_tokens_total", r0)] == 3 * len(prompt)
    assert value[("vllm:prefix_cache_queries_total", r0)] == 3 * len(prompt)
    assert value[("vllm:prefix_cache_hits_total", r0)] == sum(u["prompt_tokens_details"]["cached_tokens"] for u in outs)
    assert value[("vllm:generation_tokens_total", r0)] == 12 and value[("vllm:generation_tokens_total", r1)] == 3
    assert value[("vllm:request_success_total", (*r0[:1], ("finished_reason", "length"), r0[1]))] == 3
    assert value[("vllm:num_preemptions_total", r1)] == 0  # every series exists from the start, as in vLLM
    assert value[("vllm:request_success_total", (*r1[:1], ("finished_reason", "abort"), r1[1]))] == 0
    assert value[("vllm:num_requests_running", r0)] == 0 and value[("vllm:num_requests_waiting", r1)] == 0
    assert 0 < value[("vllm:kv_cache_usage_perc", r0)] <= 1 or value[("vllm:kv_cache_usage_perc", r0)] == 0
    assert value[("vllm:time_to_first_token_seconds_count", r0)] == 3
    assert value[("vllm:inter_token_latency_seconds_count", r0)] == 3 * 3
    buckets = {name: sorted({float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket")} - {float("inf")})
               for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                            "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")}
    assert buckets["vllm:time_to_first_token_seconds"] == list(TTFT_BUCKETS)
    assert buckets["vllm:inter_token_latency_seconds"] == list(ITL_BUCKETS)
    assert buckets["vllm:e2e_request_latency_seconds"] == list(REQUEST_LATENCY_BUCKETS)
    assert buckets["vllm:request_queue_time_seconds"] == list(REQUEST_LATENCY_BUCKETS)
    assert not any(name.startswith("vllm:spec_decode") for name in fams)  # vLLM exports them only when speculating


def test_a_speculating_worker_exports_vllms_draft_counters():
    async def body(http, actor):
        r = await http.post("/v1/completions", headers={"X-data-parallel-rank": "0"},
                            json={"model": "kvemu", "prompt": list(range(1, 40)), "max_tokens": 7, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 7
        return (await http.get("/metrics")).text

    text = serve_worker(body, ["cluster.engine.decode_speedup_ratio=1",
                               "cluster.engine.speculative={method: mtp, num_speculative_tokens: 2, acceptance_rates: 1}"])
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
    r0 = (("engine", "0"), ("model_name", "kvemu"))
    # 1 token at the prefill's end, then passes of 3, 3: two drafts of 2 tokens, all accepted
    assert value[("vllm:spec_decode_num_drafts_total", r0)] == 2
    assert value[("vllm:spec_decode_num_draft_tokens_total", r0)] == 4
    assert value[("vllm:spec_decode_num_accepted_tokens_total", r0)] == 4
    assert [value[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (r0[0], r0[1], ("position", str(p))))]
            for p in (0, 1)] == [2, 2]
    assert value[("vllm:spec_decode_num_drafts_total", (("engine", "1"), ("model_name", "kvemu")))] == 0


def test_a_cancelled_direct_request_is_counted_as_aborted_and_frees_its_blocks():
    async def body(http, actor):
        async with http.stream("POST", "/v1/completions", headers={"X-data-parallel-rank": "1"},
                               json={"model": "kvemu", "prompt": "a long answer please", "max_tokens": 20000,
                                     "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
        with anyio.fail_after(10):
            while any(core.num_unfinished for core in actor.worker.cores) or actor.local:
                await anyio.sleep(0.01)
        core = actor.worker.core(1)
        core.check_invariants()
        return (await http.get("/metrics")).text, core.pool.free + len(core.pool.cached) == core.pool.num_blocks

    text, freed = serve_worker(body)
    assert freed
    value = {(s.name, s.labels.get("engine"), s.labels.get("finished_reason")): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
    assert value[("vllm:request_success_total", "1", "abort")] == 1


@pytest.mark.reference
def test_dynamo_selection_service_routes_to_kvemu_workers_and_predicts_their_cache(tmp_path, dynamo_core):
    """Dynamo's SelectionService watches two kvemu workers' KV events (vLLM wire format), picks the rank
    that cached a prompt, and that rank's engine finds exactly the overlap Dynamo predicted."""
    scenario = tmp_path / "two.yaml"
    scenario.write_text(SCENARIO.replace("workers: 1", "workers: 2"))
    proc = subprocess.Popen(cli_command("serve", str(scenario), "--http", "127.0.0.1:0", "--worker-http"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        workers = {w["worker_id"]: w for w in info["worker_info"]}
        result = asyncio.run(_select_and_serve(dynamo_core, workers))
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    predicted_tokens, cached_tokens, chosen, cached_on = result
    assert chosen == cached_on
    assert predicted_tokens == 10 * BS and cached_tokens == predicted_tokens


async def _select_and_serve(dynamo, workers):
    svc = dynamo.SelectionService()
    try:
        for wid, w in workers.items():
            await svc.upsert_worker({"worker_id": wid, "model_name": "m", "endpoint": w["http"], "block_size": BS,
                                     "data_parallel_start_rank": 0, "data_parallel_size": 2,
                                     "kv_events_endpoints": dict(enumerate(w["kv_events"]))})
        async with httpx.AsyncClient(timeout=10) as http:
            async def run(wid, rank, tokens):
                r = await http.post(f"{workers[wid]['http']}/v1/completions",
                                    headers={"X-data-parallel-rank": str(rank)},
                                    json={"model": "kvemu", "prompt": tokens, "max_tokens": 2, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            async def seen(tokens):
                scores = await svc.overlap_scores({"model_name": "m", "token_ids": tokens})
                return {(w["worker_id"], w["dp_rank"]): w["device_blocks"] for w in scores["workers"]
                        if w["device_blocks"]}

            # every rank's stream connected: probe each until Dynamo has applied one of its stores
            ranks = [(wid, r) for wid in sorted(workers) for r in (0, 1)]
            deadline = time.monotonic() + 20
            for i, key in enumerate(ranks):
                n = 0
                while True:
                    probe = [30000 + 1000 * i + n] * BS * 2
                    await run(*key, probe)
                    await asyncio.sleep(0.05)
                    if key in await seen(probe):
                        break
                    n += 1
                    assert time.monotonic() < deadline, f"Dynamo never saw rank {key}'s KV events"
            cached_on = ranks[-1]
            prompt = list(range(100, 100 + 10 * BS))
            await run(*cached_on, prompt)
            while (await seen(prompt)).get(cached_on) != 10:
                await asyncio.sleep(0.02)
                assert time.monotonic() < deadline + 10
            follow_up = prompt + list(range(5000, 5000 + 3 * BS))
            sel = await svc.select({"model_name": "m", "token_ids": follow_up})
            chosen = (sel["worker_id"], sel["dp_rank"])
            predicted = sel["overlap"]["gpu"]
            cached = await run(*chosen, follow_up)
            return predicted, cached, chosen, cached_on
    finally:
        svc.shutdown()

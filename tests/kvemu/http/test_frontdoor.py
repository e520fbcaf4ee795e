"""The OpenAI front door driven by real clients: the openai SDK and raw HTTP, against a live cluster on 127.0.0.1."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvemu import WallClock
from kvemu.http.server import HttpServer
from kvemu.http.tokenizer import builtin_tokenizer
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_live

from harness.run.cluster import cluster
from harness.procs.frontdoor import front_door, worker_door
from harness.scenario import default_scenario_text, parse_scenario

FAST = """
name: http
cluster:
  workers: 2
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 4096, speedup_ratio: 50, decode_speedup_ratio: 50}
router: {policy: kv, affinity: {enabled: true, ttl_secs: 60}}
workload: {osl: {mean: 6, std: 0, kind: constant, low: 1, high: 64}}
run: {mode: live, seed: 3}
"""
PROMPT = "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun by the river bank " * 3


def serve(body, scenario: str = FAST, server: str = "uvicorn", overrides: list[str] | None = None):
    """Run ``body(client, http, cluster)`` against a front door over a live in-process cluster."""
    sc = parse_scenario(scenario, overrides=overrides)
    hooks = Hooks()
    clock = WallClock()

    async def main():
        async with cluster(sc, clock, hooks) as c:
            app = front_door(sc, lambda: c.router, hooks, clock)
            http_server = HttpServer(app, "127.0.0.1:0", server)
            async with anyio.create_task_group() as tg:
                await tg.start(http_server.serve)
                client = openai.AsyncOpenAI(base_url=f"{http_server.url}/v1", api_key="none", max_retries=0)
                async with httpx.AsyncClient(base_url=http_server.url, timeout=30) as http:
                    try:
                        with anyio.fail_after(60):
                            return await body(client, http, c)
                    finally:
                        await client.close()
                        tg.cancel_scope.cancel()

    return run_live(main)


def test_streaming_chat_and_completions_as_vllm_sends_them():
    async def body(client, http, c):
        chunks = [ch async for ch in await client.chat.completions.create(
            model="kvemu", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        text = [ch async for ch in await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=4,
                                                                      stream=True)]
        whole = await client.completions.create(model="kvemu", prompt=[PROMPT, "another prompt entirely"],
                                                max_tokens=3, extra_body={"ignore_eos": True})
        raw = await http.post("/v1/completions", json={"model": "kvemu", "prompt": PROMPT, "max_tokens": 2,
                                                       "stream": True})
        return chunks, text, whole, raw

    chunks, text, whole, raw = serve(body)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 1 and content[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].delta.content for ch in content)
    assert len(builtin_tokenizer().encode(streamed)) == 5  # a client re-tokenizing the text counts the same
    assert usage.usage.prompt_tokens == len(builtin_tokenizer().encode(builtin_tokenizer().chat_prompt([("user", PROMPT)])))
    assert text[0].object == "text_completion" and text[-1].choices[0].finish_reason in ("stop", "length")
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 6
    lines = raw.text.split("\n\n")
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines if line) and lines[-2] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["logprobs"] is None


def test_output_length_follows_the_scenario_unless_ignore_eos():
    async def body(client, http, c):
        free = await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=50)
        capped = await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=3)
        forced = await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=20,
                                                 extra_body={"ignore_eos": True, "min_tokens": 2})
        floor = await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=50,
                                                extra_body={"min_tokens": 9})
        return free, capped, forced, floor

    free, capped, forced, floor = serve(body)
    assert free.usage.completion_tokens == 6 and free.choices[0].finish_reason == "stop"  # the scenario's osl
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    assert forced.usage.completion_tokens == 20 and forced.choices[0].finish_reason == "length"
    assert floor.usage.completion_tokens == 9


def test_sessions_stick_to_one_rank_and_a_repeated_prefix_is_cached():
    async def body(client, http, c):
        history = [{"role": "system", "content": PROMPT}]
        served, cached = [], []
        for turn in range(4):
            history.append({"role": "user", "content": f"question number {turn} about foxes"})
            resp = await client.chat.completions.create(
                model="kvemu", messages=history, max_tokens=8, extra_headers={"X-Dynamo-Session-ID": "conv-1"},
                extra_body={"nvext": {"extra_fields": ["worker_id", "timing"]}})
            nv = resp.model_extra["nvext"]
            served.append((nv["worker_id"]["decode_worker_id"], nv["worker_id"]["decode_dp_rank"]))
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
            assert nv["timing"]["cached_tokens"] == cached[-1]
            history.append({"role": "assistant", "content": resp.choices[0].message.content})
        return served, cached

    served, cached = serve(body)
    assert len(set(served)) == 1, served  # every turn of the session on one rank
    assert cached[0] == 0 and all(x > 0 for x in cached[1:]), cached
    # the previous answer is part of the next prompt: its decode blocks hit too, so hits grow turn by turn
    assert cached[3] > cached[2] > cached[1], cached


def test_pins_from_headers_and_nvext():
    async def body(client, http, c):
        out = []
        for worker, rank in sorted(c.router.core.registry.rank_keys()):
            resp = await http.post("/v1/completions", headers={"x-worker-instance-id": str(worker), "x-dp-rank": str(rank)},
                                   json={"model": "kvemu", "prompt": "pin me", "max_tokens": 2,
                                         "nvext": {"extra_fields": ["worker_id"]}})
            by_header = resp.json()["nvext"]["worker_id"]
            resp = await http.post("/v1/completions", json={
                "model": "kvemu", "prompt": "pin me too", "max_tokens": 2,
                "nvext": {"backend_instance_id": worker, "dp_rank": rank, "extra_fields": ["worker_id"]}})
            by_body = resp.json()["nvext"]["worker_id"]
            out.append(((worker, rank), (by_header["decode_worker_id"], by_header["decode_dp_rank"]),
                        (by_body["decode_worker_id"], by_body["decode_dp_rank"])))
        return out

    for want, by_header, by_body in serve(body):
        assert by_header == want and by_body == want


def test_errors_have_vllm_form_and_status():
    async def body(client, http, c):
        seen = {}
        cases = {
            "max_tokens_zero": {"model": "kvemu", "prompt": "x", "max_tokens": 0},
            "bad_type": {"model": "kvemu", "prompt": "x", "max_tokens": "many"},
            "bad_role": {"model": "kvemu", "messages": [{"role": "wizard", "content": "x"}]},
            "too_long": {"model": "kvemu", "prompt": [5] * 10, "max_tokens": 10 ** 7},
            "bad_id": {"model": "kvemu", "prompt": [10 ** 9]},
            "unknown_model": {"model": "gpt-9", "prompt": "x"},
            "unknown_worker": {"model": "kvemu", "prompt": "x", "nvext": {"backend_instance_id": 999}},
        }
        for name, payload in cases.items():
            path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
            r = await http.post(path, json=payload)
            seen[name] = (r.status_code, r.json()["error"])
        r = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        seen["not_json"] = (r.status_code, r.json()["error"])
        try:
            await client.completions.create(model="gpt-9", prompt="x")
        except openai.NotFoundError as exc:
            seen["sdk"] = (exc.status_code, exc.body)
        return seen

    seen = serve(body)
    for name in ("max_tokens_zero", "bad_type", "bad_role", "too_long", "bad_id", "not_json"):
        assert seen[name][0] == 400 and seen[name][1]["type"] == "BadRequestError", (name, seen[name])
    assert seen["max_tokens_zero"][1]["param"] == "max_tokens" and "max_tokens" in seen["max_tokens_zero"][1]["message"]
    assert seen["bad_type"][1]["param"] == "max_tokens"
    assert "maximum context length" in seen["too_long"][1]["message"]
    assert seen["unknown_model"][0] == 404 and seen["unknown_model"][1]["code"] == 404
    assert seen["unknown_worker"][0] == 503 and seen["unknown_worker"][1]["type"] == "ServiceUnavailableError"
    assert seen["sdk"][0] == 404


def test_the_policy_queue_turns_requests_away_with_429():
    queued = FAST.replace("router: {policy: kv,", "router: {policy: kv, router_queue_threshold: 0.0, "
                          "router_queue_limit_per_worker: 1,").replace("speedup_ratio: 50", "speedup_ratio: 1")

    async def body(client, http, c):
        statuses = []

        async def one(i):
            r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": [i + 1] * 3000, "max_tokens": 2})
            statuses.append(r.status_code if r.status_code != 429 else (429, r.json()["error"]["type"]))

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
        return statuses

    statuses = serve(body, queued)
    assert (429, "RateLimitError") in statuses and 200 in statuses, statuses
    assert set(statuses) <= {200, (429, "RateLimitError")}


def test_a_client_that_leaves_mid_stream_cancels_the_request_in_the_engine():
    slow = FAST.replace("speedup_ratio: 50", "speedup_ratio: 1")

    async def body(client, http, c):
        stream = await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=4000, stream=True,
                                                 extra_headers={"X-Dynamo-Session-ID": "leaver"},
                                                 extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        with anyio.fail_after(10):  # the router frees the request, the engine drops it
            while len(c.router.core.load) or any(core.num_unfinished for w in c.workers.values()
                                                   for core in w.worker.cores):
                await anyio.sleep(0.01)
        for w in c.workers.values():
            for core in w.worker.cores:
                core.check_invariants()
                assert core.num_running == 0 and core.pool.free + len(core.pool.cached) == core.pool.num_blocks
        leases = c.router.affinity.active_leases("leaver")
        text = (await http.get("/metrics")).text
        return leases, text

    leases, text = serve(body, slow)
    assert leases == 0
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert metrics[("dynamo_frontend_inflight_requests", (("model", "kvemu"),))] == 0
    assert metrics[("dynamo_frontend_requests_total", (("endpoint", "completions"), ("model", "kvemu"),
                                                       ("request_type", "stream"), ("status", "cancelled")))] == 1
    assert metrics[("kvemu_router_requests_total", (("outcome", "failed:client_disconnected"),))] == 1


def test_metrics_count_what_was_served():
    async def body(client, http, c):
        for i in range(5):
            await client.completions.create(model="kvemu", prompt=f"{PROMPT} {i}", max_tokens=3)
        await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        return (await http.get("/metrics")).text

    families = {f.name: f for f in text_string_to_metric_families(serve(body))}
    ok = [s for s in families["dynamo_frontend_requests"].samples
          if s.name.endswith("_total") and s.labels["status"] == "success"]
    assert sum(s.value for s in ok) == 5
    err = [s for s in families["dynamo_frontend_requests"].samples
           if s.name.endswith("_total") and s.labels["status"] == "error"]
    assert sum(s.value for s in err) == 1
    ttft = [s for s in families["dynamo_frontend_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft[0].value == 5
    done = {s.labels["outcome"]: s.value for s in families["kvemu_router_requests"].samples if s.name.endswith("_total")}
    assert done == {"completed": 5}
    ranks = {(s.labels["worker_id"], s.labels["dp_rank"]) for s in families["dynamo_frontend_worker_active_decode_blocks"].samples}
    assert len(ranks) == 4


def test_models_health_tokenize_detokenize():
    async def body(client, http, c):
        models = await client.models.list()
        health = await http.get("/health")
        tok = (await http.post("/tokenize", json={"model": "kvemu", "prompt": "Hello, world"})).json()
        detok = (await http.post("/detokenize", json={"model": "kvemu", "tokens": tok["tokens"]})).json()
        bad = await http.post("/detokenize", json={"tokens": [-1]})
        unnamed = await http.post("/v1/completions", json={"prompt": "no model named", "max_tokens": 2})
        assert unnamed.status_code == 200 and unnamed.json()["model"] == "kvemu"  # the served one, as vLLM does
        missing = await http.get("/v2/nothing")
        wrong = await http.get("/v1/completions")
        return models, health.status_code, tok, detok, bad.status_code, missing.status_code, wrong.status_code

    models, health, tok, detok, bad, missing, wrong = serve(body)
    assert [m.id for m in models.data] == ["kvemu"]
    assert health == 200
    assert tok["count"] == len(tok["tokens"]) == 5  # hel lo , wor ld
    assert detok["prompt"] == "hel lo , wor ld"
    assert (bad, missing, wrong) == (400, 404, 405)


def test_the_front_door_describes_itself_as_its_workers_do_with_one_rank():
    """The front door and a worker's own server answer the metadata routes from one definition: the same model,
    block size and context; the front door is one endpoint (``dp_size`` 1, it picks ranks itself: a body rank is
    an engine field it ignores), and only a worker has per-rank load."""
    sc = parse_scenario(FAST)

    async def body(client, http, c):
        actor = c.workers[min(c.workers)]
        worker = httpx.AsyncClient(transport=httpx.ASGITransport(app=worker_door(sc, actor)), base_url="http://w")
        async with worker:
            out = {}
            for path in ("/v1/models", "/server_info", "/model_info", "/get_load"):
                out[path] = [(r.status_code, r.json()) for r in (await http.get(path), await worker.get(path))]
            ignored = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "data_parallel_rank": 9})
            render = await http.post("/v1/completions/render", json={"prompt": "Hello, world"})
        return out, ignored.status_code, render.json()

    out, ignored, render = serve(body)
    (front_status, front), (worker_status, own) = out["/v1/models"]
    assert front_status == worker_status == 200
    assert [{k: v for k, v in m.items() if k != "created"} for m in front["data"]] == \
        [{k: v for k, v in m.items() if k != "created"} for m in own["data"]]
    assert out["/model_info"][0] == out["/model_info"][1]
    (_, front), (_, own) = out["/server_info"]
    assert front["dp_size"] == 1 and own["dp_size"] == 2
    assert {k: v for k, v in front.items() if k != "dp_size"} == {k: v for k, v in own.items() if k != "dp_size"}
    assert out["/get_load"][0][0] == 404 and len(out["/get_load"][1][1]) == 2
    assert ignored == 200
    assert [r["token_ids"] for r in render] == [builtin_tokenizer().encode("Hello, world")]


@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_head_answers_every_get_route_as_vllm_does(server):
    if server == "granian":
        pytest.importorskip("granian")
    # aiperf 0.13 probes the server's /metrics with HEAD (then GET only if HEAD is not 200), as a
    # Prometheus-minded client may; vLLM (starlette) answers HEAD on every GET route: GET's status and
    # headers, no body. A POST route still says 405.
    async def body(client, http, c):
        out = {}
        for path in ("/metrics", "/health", "/v1/models"):
            get, head = await http.get(path), await http.head(path)
            out[path] = (get.status_code, get.headers.get("content-type"), head.status_code,
                         head.headers.get("content-type"), head.content)
        out["post"] = (await http.head("/v1/completions")).status_code
        out["missing"] = (await http.head("/v2/nothing")).status_code
        return out

    out = serve(body, server=server)
    for path in ("/metrics", "/health", "/v1/models"):
        get_status, get_type, head_status, head_type, head_body = out[path]
        assert (head_status, head_type, head_body) == (get_status, get_type, b""), (path, out[path])
    assert out["/metrics"][2] == 200
    assert (out["post"], out["missing"]) == (405, 404)


@pytest.mark.parametrize("path", ["tok"])
def test_tokenizer_export_loads_with_the_tokenizers_library(tmp_path, path):
    from tokenizers import Tokenizer

    from kvemu.http.tokenizer import export_builtin, load_tokenizer

    export_builtin(tmp_path / path)
    loaded = Tokenizer.from_file(str(tmp_path / path / "tokenizer.json"))
    text = "Agents call tools; tools answer. 42 times!"
    assert loaded.encode(text, add_special_tokens=False).ids == builtin_tokenizer().encode(text)
    assert load_tokenizer(tmp_path / path).encode(text) == builtin_tokenizer().encode(text)
    config = json.loads((tmp_path / path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in config


def test_the_readme_client_examples_work_as_written():
    import re
    import shutil
    import subprocess
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "docs" / "openai.md").read_text()
    snippet = next(b for b in re.findall(r"```py\n(.*?)```", readme, flags=re.S) if "from openai import OpenAI" in b)
    curl = next(b for b in re.findall(r"```sh\n(.*?)```", readme, flags=re.S) if "127.0.0.1:8000/v1/chat" in b)
    curl = curl[curl.index("curl"):curl.index("kill")].replace("\\\n", " ")

    async def body(client, http, c):
        port = http.base_url.port
        printed = []
        code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        await anyio.to_thread.run_sync(lambda: exec(code, {"print": lambda *a: printed.append(a)}))
        out = None
        if shutil.which("curl") and shutil.which("bash"):
            out = await anyio.to_thread.run_sync(lambda: subprocess.run(
                ["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")], capture_output=True, text=True,
                timeout=30).stdout)
        return printed, out

    # the scenario `kvemu serve` runs by default (the quickstart: 64-token KV blocks), live as kvemu serve runs it
    printed, out = serve(body, default_scenario_text(), overrides=["run.mode=live"])
    # two calls sharing a long system prompt: the first finds nothing cached, the second the prompt's full blocks
    # (a prompt shorter than one block, as the snippet once had, never shows a cached token)
    assert len(printed) == 2, printed
    (first_len, first_cached), (second_len, second_cached) = printed
    assert first_cached == 0 and second_cached > 0, printed
    assert second_cached % 64 == 0 and second_cached <= second_len, printed
    expected = re.findall(r"^# (\d+) (\d+)", snippet, flags=re.M)  # the output the README shows
    assert [tuple(map(int, e)) for e in expected] == printed, (expected, printed)
    if out is not None:
        reply = json.loads(out)
        assert reply["object"] == "chat.completion" and set(reply["nvext"]) == {"worker_id", "timing"}


def test_granian_serves_the_same_stream_and_cancels_the_same_way():
    pytest.importorskip("granian")

    async def body(client, http, c):
        chunks = [ch async for ch in await client.chat.completions.create(
            model="kvemu", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        stream = await client.completions.create(model="kvemu", prompt=PROMPT, max_tokens=20000, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
        with anyio.fail_after(10):
            while len(c.router.core.load) or any(core.num_unfinished for w in c.workers.values()
                                                   for core in w.worker.cores):
                await anyio.sleep(0.01)
        return chunks

    chunks = serve(body, FAST.replace("speedup_ratio: 50", "speedup_ratio: 1"), server="granian")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 5


def test_prompts_arriving_together_are_tokenized_together_and_each_gets_its_own_ids():
    tok = builtin_tokenizer()
    texts = [f"{PROMPT[: 40 + 7 * i]} número {i} <|user|> ÉTÉ" for i in range(24)]
    assert tok.encode_many(texts) == [tok.encode(t) for t in texts]

    async def body(client, http, c):
        results = {}

        async def one(i):
            r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": texts[i], "max_tokens": 2,
                                                         "stream": i % 2 == 1, "stream_options": {"include_usage": True}})
            if i % 2:
                usage = json.loads([line for line in r.text.split("\n\n") if '"usage"' in line][-1][6:])["usage"]
            else:
                usage = r.json()["usage"]
            results[i] = usage["prompt_tokens"]

        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)
        return results

    assert serve(body) == {i: len(tok.encode(t)) for i, t in enumerate(texts)}


def test_request_fields_as_clients_send_them():
    async def body(client, http, c):
        parts = await http.post("/v1/chat/completions", json={
            "model": "kvemu", "max_completion_tokens": 3, "ignore_eos": True,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "first part"},
                                                      {"type": "text", "text": "second part"}]}]})
        image = await http.post("/v1/chat/completions", json={
            "model": "kvemu", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
        completion = await http.post("/v1/completions", json={"model": "kvemu", "prompt": "x",
                                                               "max_completion_tokens": 4, "ignore_eos": True})
        continuous = await http.post("/v1/completions", json={
            "model": "kvemu", "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        return parts.json(), image, completion.json(), continuous.text

    parts, image, completion, continuous = serve(body)
    tok = builtin_tokenizer()
    want = tok.chat_prompt([("system", "be brief"), ("user", "first part\nsecond part")])
    assert parts["usage"]["prompt_tokens"] == len(tok.encode(want)) and parts["usage"]["completion_tokens"] == 3
    assert image.status_code == 400 and "text parts" in image.json()["error"]["message"]
    assert completion["usage"]["completion_tokens"] == 4
    events = [json.loads(e[6:]) for e in continuous.split("\n\n") if e.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert all(e.get("usage") for e in events) and counts == sorted(counts) and counts[-1] == 40


def test_benchmark_clients_requests_as_they_send_them():
    # the bodies and headers aiperf 0.13.0, guidellm 0.8.1 and inference-perf 0.7.0 sent to `kvemu serve`
    # (captured by a logging proxy), and the parts of the answer each reads: SSE chunks with the text, a
    # last chunk with choices [] and usage (aiperf reads prompt_tokens_details.cached_tokens), data: [DONE]
    sid = "6b1ab22c-9a43-4255-9bf5-3d490b6c502d"
    aiperf_headers = {"user-agent": "aiperf/0.13.0", "x-request-id": "37cedfd8-1e93-4896-846a-d9b0ddbfef0e",
                      "x-correlation-id": sid, "accept": "text/event-stream", "x-session-affinity": sid,
                      "x-dynamo-session-id": sid}  # the last with --session-header X-Dynamo-Session-ID
    aiperf = {"messages": [{"role": "user", "content": PROMPT}], "model": "kvemu", "stream": True,
              "max_completion_tokens": 8, "ignore_eos": True, "stream_options": {"include_usage": True}}
    aiperf_probe = {"messages": [{"role": "user", "content": "Lo"}], "max_tokens": 1, "model": "kvemu"}
    guidellm = {"model": "kvemu", "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "max_completion_tokens": 8, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "1 0 " + PROMPT}]}]}
    inference_perf = {"model": "kvemu", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True,
                      "stream_options": {"include_usage": True}}

    async def body(client, http, c):
        out = {"probe": await http.post("/v1/chat/completions", json=aiperf_probe)}
        for name, path, req, headers in (
                ("aiperf", "/v1/chat/completions", aiperf, aiperf_headers),
                ("aiperf-again", "/v1/chat/completions", aiperf, {**aiperf_headers, "x-request-id": "second"}),
                ("guidellm", "/v1/chat/completions", guidellm, {}),
                ("inference-perf", "/v1/completions", inference_perf, {})):
            out[name] = await http.post(path, json=req, headers=headers)
        return out

    out = serve(body)
    probe = out.pop("probe")
    assert probe.status_code == 200 and probe.json()["usage"]["completion_tokens"] == 1
    cached = {}
    for name, resp in out.items():
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream"), name
        assert resp.text.endswith("data: [DONE]\n\n"), name
        events = [json.loads(e[6:]) for e in resp.text.split("\n\n") if e.startswith("data: {")]
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8, (name, last)
        assert last["usage"]["prompt_tokens"] > 0
        cached[name] = last["usage"]["prompt_tokens_details"]["cached_tokens"]
        text = "".join(ch["choices"][0]["delta"].get("content", "") if "delta" in ch["choices"][0]
                       else ch["choices"][0]["text"] for ch in chunks)
        assert text and chunks[-1]["choices"][0]["finish_reason"] == "length", name
        if name == "guidellm":  # continuous_usage_stats: every chunk counts what was written so far
            assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert out["aiperf"].text.count('"id":"37cedfd8-1e93-4896-846a-d9b0ddbfef0e"') > 0  # x-request-id names it
    assert cached["aiperf"] == 0 and cached["aiperf-again"] > 0  # the same session's repeated prompt hits


def test_sibling_groups_and_agent_session_headers_bind_like_dynamo():
    async def body(client, http, c):
        async def rank(headers, text):
            r = await http.post("/v1/completions", headers=headers, json={
                "model": "kvemu", "prompt": text, "max_tokens": 2, "nvext": {"extra_fields": ["worker_id"]}})
            w = r.json()["nvext"]["worker_id"]
            return w["decode_worker_id"], w["decode_dp_rank"]

        siblings = [await rank({"X-Dynamo-Session-ID": f"sub-{i}", "X-Dynamo-Parent-Session-ID": "parent-1"},
                               f"sub agent {i} works on its own part of the task") for i in range(6)]
        fallback = [await rank({"x-session-id": "agent-9"}, f"turn {i} of a plain agent") for i in range(4)]
        bare = [await rank({"session-id": "agent-10"}, f"turn {i} of another agent") for i in range(4)]
        return siblings, fallback, bare

    siblings, fallback, bare = serve(body)
    assert len(set(siblings)) == 1 and len(set(fallback)) == 1 and len(set(bare)) == 1


def test_routing_hints_map_as_dynamo_takes_them():
    from kvemu.http.errors import ApiError
    from kvemu.http.protocol import CompletionRequest, decode_body, hints_of

    body = {"prompt": "x", "priority": 3, "nvext": {"backend_instance_id": 4, "dp_rank": 1, "extra_fields": ["timing"],
                                                    "agent_hints": {"priority": 7, "osl": 120}}}
    parsed = decode_body(json.dumps(body).encode(), CompletionRequest)
    h = hints_of(parsed, {})
    assert (h.worker_id, h.dp_rank, h.priority, h.engine_priority, h.osl, h.extra_fields) == (4, 1, 7, 3, 120, ("timing",))
    h = hints_of(parsed, {"x-worker-instance-id": "9", "x-dp-rank": "0", "x-dynamo-session-id": "s",
                          "x-session-id": "ignored", "x-parent-session-id": "p"})
    assert (h.worker_id, h.dp_rank, h.session_id, h.parent_session_id) == (9, 0, "s", "p")  # headers win
    for headers in ({"x-dp-rank": "one"}, {"x-worker-instance-id": "-2"}, {"x-dynamo-session-id": "s" * 300}):
        with pytest.raises(ApiError) as err:
            hints_of(parsed, headers)
        assert err.value.status == 400


def test_an_in_process_front_door_spreads_over_router_replicas():
    """``kvemu serve --in-process`` with ``router.replicas``: requests go through the replicas' front door (here by
    session hash: a session's turns reach one replica, sessions spread), streamed and cancellable as with one."""
    sc = parse_scenario(FAST, overrides=["router.replicas=3", "router.replica_front=session"])
    hooks = Hooks()
    clock = WallClock()

    async def main():
        async with cluster(sc, clock, hooks) as c:
            app = front_door(sc, lambda: c.router, hooks, clock, front=lambda: c.front)
            http_server = HttpServer(app, "127.0.0.1:0", "uvicorn")
            async with anyio.create_task_group() as tg:
                await tg.start(http_server.serve)
                client = openai.AsyncOpenAI(base_url=f"{http_server.url}/v1", api_key="none", max_retries=0)
                try:
                    with anyio.fail_after(60):
                        for s in range(6):
                            for turn in range(2):
                                resp = await client.completions.create(
                                    model="kvemu", prompt=f"{PROMPT} session {s} turn {turn}", max_tokens=4,
                                    extra_headers={"X-Dynamo-Session-ID": f"conv-{s}"})
                                assert resp.usage.completion_tokens == 4
                    return dict(c.front.replica_of), c.front.open
                finally:
                    await client.close()
                    tg.cancel_scope.cancel()

    replica_of, still_open = run_live(main)
    assert len(replica_of) == 12 and not still_open
    by_session = {}
    for i in replica_of.values():
        by_session.setdefault(i, 0)
        by_session[i] += 1
    assert len(by_session) > 1 and all(n % 2 == 0 for n in by_session.values())  # whole sessions per replica

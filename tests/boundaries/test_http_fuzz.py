"""Property-based fuzzing of the front door's and a worker's HTTP endpoints over a real socket on 127.0.0.1 (issue
#43): hostile methods, paths, headers and bodies (random, and valid requests with one field swapped for a hostile
value) each get a well-formed answer below 500 (or a declared 503), and the server keeps answering /health."""

from __future__ import annotations

import threading

import anyio
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu import WallClock
from kvemu.hooks import Hooks
from kvemu.http.server import HttpServer
from kvemu.runtime.loop import run_live

from harness.run.cluster import cluster
from harness.procs.frontdoor import front_door, worker_door
from harness.scenario import parse_scenario

from tests.boundaries.test_decoder_fuzz import json_hostile, json_plain, INF

SCENARIO = """
name: http-fuzz
cluster:
  workers: 1
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 2048, speedup_ratio: 200, decode_speedup_ratio: 200}
router: {policy: kv}
workload: {osl: {mean: 4, std: 0, kind: constant, low: 1, high: 8}}
run: {mode: live, seed: 7}
"""
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/completions/render",
         "/v1/chat/completions/render", "/health", "/metrics", "/v1/models", "/server_info", "/get_load",
         "/kvemu/unsettled", "/nope", "/v1/completions/../health", "//v1//completions"]
HEADERS = ["x-request-id", "x-dynamo-session-id", "x-session-id", "x-parent-session-id", "x-worker-instance-id",
           "x-dp-rank", "x-data-parallel-rank", "content-type", "content-length", "transfer-encoding"]
VALID = {"model": "kvemu", "prompt": "hello there, general kenobi", "max_tokens": 3, "stream": False,
         "messages": [{"role": "user", "content": "hi"}], "tokens": [1, 2, 3],
         "nvext": {"agent_hints": {"priority": 1, "osl": 3}}, "priority": 0}


class Doors:
    """A live in-process cluster serving its front door and worker 0's own door on 127.0.0.1 (in a thread)."""

    def __init__(self) -> None:
        self.urls: dict[str, str] = {}
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            run_live(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported by the test that waits for it
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        sc = parse_scenario(SCENARIO)
        hooks, clock = Hooks(), WallClock()
        async with cluster(sc, clock, hooks) as c:
            servers = {"front": HttpServer(front_door(sc, lambda: c.router, hooks, clock), "127.0.0.1:0"),
                       "worker": HttpServer(worker_door(sc, c.workers[min(c.workers)]), "127.0.0.1:0")}
            async with anyio.create_task_group() as tg:
                for name, server in servers.items():
                    await tg.start(server.serve)
                    self.urls[name] = server.url
                self.ready.set()
                while not self.stop.is_set():
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()


@pytest.fixture(scope="module")
def doors():
    d = Doors()
    d.thread.start()
    assert d.ready.wait(60) and d.error is None, d.error
    yield d
    d.stop.set()
    d.thread.join(30)


def _body(fields: dict) -> bytes:
    return msgspec.json.encode(fields).replace(f'"{INF}"'.encode(), b"1e999")


@st.composite
def valid_mutated(draw: st.DrawFn) -> bytes:
    """A valid body with one field swapped for a hostile value (or a hostile field added)."""
    body = dict(VALID)
    key = draw(st.sampled_from([*VALID, "n", "min_tokens", "max_completion_tokens", "seed", "kv_transfer_params",
                                "bootstrap_room", "logprobs", "data_parallel_rank", "echo", "stream_options"]))
    body[key] = draw(st.one_of(json_hostile, json_plain))
    return _body(body)


requests = st.tuples(
    st.sampled_from(["GET", "POST", "POST", "POST", "HEAD", "PUT", "DELETE"]),
    st.one_of(st.sampled_from(PATHS), st.text(alphabet="/abcdefghijklmnopqrstuvwxyz.%?=&", max_size=30)
              .map(lambda p: "/" + p)),
    st.dictionaries(st.sampled_from(HEADERS), st.one_of(
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
        st.sampled_from(["-1", "0", "1", "99999999999999999999999", "1_0", "x" * 300, "chunked", "application/json"])),
        max_size=3),
    st.one_of(valid_mutated(), st.binary(max_size=64), json_plain.map(msgspec.json.encode),
              st.just(_body(VALID))),
)
DECLARED = {503}
"""The only 5xx a door may answer: it is overloaded or has no worker (with a reason in the body)."""


@pytest.mark.parametrize("door", ["front", "worker"])
def test_every_hostile_request_gets_a_well_formed_answer_and_health_stays_up(doors, door):
    url = doors.urls[door]
    seen: list[int] = []
    with httpx.Client(base_url=url, timeout=20) as http:

        @settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(req=requests)
        def fuzz(req: tuple[str, str, dict[str, str], bytes]) -> None:
            method, path, headers, body = req
            headers = {k: v for k, v in headers.items() if k not in ("content-length", "transfer-encoding")}
            try:
                r = http.request(method, path, headers=headers, content=body if method in ("POST", "PUT") else None)
            except (httpx.InvalidURL, httpx.LocalProtocolError):
                return  # (a path or header value httpx itself will not send)
            seen.append(r.status_code)
            assert r.status_code < 500 or r.status_code in DECLARED, (method, path, headers, body, r.status_code,
                                                                        r.text[:300])
            if r.status_code >= 400 and method != "HEAD" and r.headers.get("content-type", "").startswith(
                    "application/json"):
                assert "error" in r.json() or "detail" in r.json(), r.text[:300]
            assert http.get("/health").status_code == 200

        fuzz()
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen), sorted(set(seen))

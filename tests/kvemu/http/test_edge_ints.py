"""#27, the HTTP edge under hostile integers, pins and nesting: every integer a client sends is bounded to what
the wire carries (a 400 naming the field), a rank pin without its worker is a 400, a body nested too deep is a
400 without a traceback, and none of them leaves anything held (flights, the inflight gauge) or fences a worker."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from tests.kvemu.http.test_frontdoor import PROMPT, serve
from tests.kvemu.http.test_worker_server import serve_worker

BIG = 10**30
DEEP = b"[" * 1200 + b"]" * 1200

BODY_INTS = {  # field path -> body; each carries an integer no wire carries
    "priority": {"priority": BIG},
    "max_tokens": {"max_tokens": BIG},
    "max_completion_tokens": {"max_completion_tokens": -BIG},
    "min_tokens": {"min_tokens": BIG},
    "n": {"n": BIG},
    "seed": {"seed": BIG},
    "nvext.backend_instance_id": {"nvext": {"backend_instance_id": BIG}},
    "nvext.dp_rank": {"nvext": {"backend_instance_id": 0, "dp_rank": 1 << 40}},
    "nvext.agent_hints.priority": {"nvext": {"agent_hints": {"priority": BIG}}},
    "nvext.agent_hints.osl": {"nvext": {"agent_hints": {"osl": BIG}}},
}
HEADER_INTS = {
    "x-worker-instance-id": {"x-worker-instance-id": str(BIG)},
    "x-dp-rank": {"x-worker-instance-id": "0", "x-dp-rank": str(1 << 40)},
}


async def _attacks(http, rank_header="x-dp-rank"):
    seen = {}
    for field, extra in BODY_INTS.items():
        r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": PROMPT, **extra})
        seen[field] = (r.status_code, r.json()["error"]["param"])
    for field, headers in HEADER_INTS.items():
        headers = {k.replace("x-dp-rank", rank_header): v for k, v in headers.items()}
        r = await http.post("/v1/completions", headers=headers, json={"model": "kvemu", "prompt": PROMPT})
        seen[field] = (r.status_code, r.json()["error"]["param"])
    r = await http.post("/v1/completions", headers={"x-worker-instance-id": "0", rank_header: "1_0"},
                        json={"model": "kvemu", "prompt": PROMPT})
    seen["underscore"] = (r.status_code, r.json()["error"]["param"])
    for where, body in (("prompt", b'{"model": "kvemu", "prompt": ' + DEEP + b"}"),
                        ("unknown field", b'{"model": "kvemu", "prompt": "x", "extra": ' + DEEP + b"}"),
                        ("chat", b'{"model": "kvemu", "messages": [], "logprobs": ' + DEEP + b"}")):
        path = "/v1/chat/completions" if where == "chat" else "/v1/completions"
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
        seen[f"deep {where}"] = (r.status_code, r.json()["error"]["message"])
    return seen


def _inflight(text):
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams["dynamo_frontend_inflight_requests"].samples)


def test_front_door_bounds_every_integer_and_holds_nothing_for_a_refused_request(caplog):
    async def body(client, http, c):
        workers = sorted(c.router.workers)
        seen = await _attacks(http)
        for _ in range(3):  # the filer's three requests that used to get a worker removed
            r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": PROMPT, "priority": BIG})
            assert r.status_code == 400
        r = await http.post("/v1/completions", headers={"x-dp-rank": "1"},
                            json={"model": "kvemu", "prompt": PROMPT, "max_tokens": 2})
        seen["bare x-dp-rank"] = (r.status_code, r.json()["error"]["param"])
        r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": PROMPT, "max_tokens": 2,
                                                     "nvext": {"dp_rank": 1}})
        seen["bare nvext.dp_rank"] = (r.status_code, r.json()["error"]["param"])
        held = dict(c.router.lifecycle.flights)
        gauge = _inflight((await http.get("/metrics")).text)
        ok = await http.post("/v1/completions", json={"model": "kvemu", "prompt": PROMPT, "max_tokens": 2,
                                                      "priority": -(1 << 63)})
        return seen, held, gauge, workers, sorted(c.router.workers), ok.status_code, c.router.lifecycle.unacked

    with caplog.at_level(logging.WARNING):
        seen, held, gauge, before, after, ok, unacked = serve(body)
    for field in [*BODY_INTS, *HEADER_INTS]:
        assert seen[field] == (400, field), (field, seen[field])
    assert seen["underscore"] == (400, "x-dp-rank")
    assert seen["bare x-dp-rank"] == (400, "x-dp-rank") and seen["bare nvext.dp_rank"] == (400, "nvext.dp_rank")
    for where in ("prompt", "unknown field", "chat"):
        assert seen[f"deep {where}"] == (400, "the request body nests too deeply")
    assert held == {} and gauge == 0 and unacked == {}
    assert after == before and ok == 200  # no worker fenced: the cluster still serves
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged for a client's mistake


def test_a_workers_own_server_bounds_the_same_integers_and_nesting():
    async def body(http, actor):
        seen = await _attacks(http, rank_header="X-data-parallel-rank")
        bare = await http.post("/v1/completions", headers={"X-data-parallel-rank": "1"},
                               json={"model": "kvemu", "prompt": PROMPT, "max_tokens": 2})
        return seen, bare.status_code, dict(actor.local), dict(actor._records)

    seen, bare, local, records = serve_worker(body)
    for field in [*BODY_INTS, *HEADER_INTS]:
        want = "x-data-parallel-rank" if field == "x-dp-rank" else field
        assert seen[field] == (400, want), (field, seen[field])
    for where in ("prompt", "unknown field", "chat"):
        assert seen[f"deep {where}"] == (400, "the request body nests too deeply")
    assert bare == 200 and local == {} and records == {}  # a worker's own rank header needs no worker id

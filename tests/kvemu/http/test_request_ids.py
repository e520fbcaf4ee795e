"""#27: a reused ``X-Request-Id`` is refused without touching the request it collides with: the open stream keeps
every token and ends with ``[DONE]``, at the front door and on a worker's own server."""

from __future__ import annotations

import json

from tests.kvemu.http.test_frontdoor import PROMPT, serve
from tests.kvemu.http.test_worker_server import serve_worker

SLOW = ["cluster.engine.speedup_ratio=1", "cluster.engine.decode_speedup_ratio=1"]
"""Engine time as a GPU's: the first request streams for about two seconds, so a loaded machine's pause between
its first chunk and the colliding request cannot outlast it (at 10x it ran 0.2 s, and a clean-clone run once
found it already ended)."""
N = 300


async def _collide(http, is_open):
    """Stream ``N`` tokens under one id; once it is running, send a second request with the same id."""
    body = {"model": "kvemu", "prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-request-id": "same-id"}
    texts, usage, done, dup, open_then = [], None, False, None, None
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                texts.append(chunk["choices"][0]["text"])
            elif "usage" in chunk:
                usage = chunk["usage"]["completion_tokens"]
            if dup is None:
                open_then = is_open()
                r = await http.post("/v1/completions", headers=headers,
                                    json={"model": "kvemu", "prompt": "another", "max_tokens": 2})
                dup = (r.status_code, r.json()["error"]["message"])
    return len("".join(texts).split()), usage, done, dup, open_then


def test_a_reused_request_id_at_the_front_door_leaves_the_open_stream_whole():
    async def body(client, http, c):
        got = await _collide(http, lambda: "same-id" in c.router.lifecycle.flights)
        return got, dict(c.router.lifecycle.flights)

    (words, usage, done, dup, open_then), held = serve(body, overrides=SLOW)
    assert open_then  # the collision happened while the first request ran
    assert dup[0] == 400 and "duplicate_request_id" in dup[1]
    assert (words, usage, done) == (N, N, True)
    assert held == {}


def test_a_reused_request_id_on_a_workers_own_server_leaves_the_open_stream_whole():
    async def body(http, actor):
        return await _collide(http, lambda: "same-id" in actor.local), dict(actor.local)

    (words, usage, done, dup, open_then), local = serve_worker(body, overrides=SLOW)
    assert open_then
    assert dup[0] == 400 and "duplicate_request_id" in dup[1]
    assert (words, usage, done) == (N, N, True)
    assert local == {}

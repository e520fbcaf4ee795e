"""The KV handoff against a hostile client and a hostile peer (issue #43): a link model that cannot be priced, a
forged or malformed source, a stolen room and a request that makes its engine pass fail each end with a 4xx (or
a recorded reason), and the fleet goes on serving.

Live tests run a single-process ``kvemu fleet`` (real HTTP on 127.0.0.1, real asyncio) and act as vllm-router and
sglang-router do (``tests/harness/test_kv_handoff.py``); the router-side ones run kvemu's own router in virtual
time."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import httpx
import msgspec
import pytest

from harness.procs import kv_handoff
from harness.procs.fleet import Fleet, FleetInfo
from harness.procs.kv_handoff import peer_url, prompt_digest
from kvemu.http.errors import ApiError
from harness.scenario import load_scenario
from kvemu import transfer
from kvemu.messages import Finished, decode_worker_message, encode
from kvemu.transfer import MAX_TRANSFER_S, KvTransfer
from tests.harness.test_kv_handoff import PROMPT, SCENARIO, _eventually, _held_tokens, _leg, _run
from workers.config import EngineConfig
from workers.mock_worker import MockWorker
from workers.request import Request

HOSTILE = KvTransfer(source_worker_id=0, bandwidth_gbps=1e-300, bytes_per_token=2**40)
"""The link model that overflowed ``transfer_delay_ns`` (``round(inf)``) inside the decode engine's pass (a struct
built in code is not validated: what a peer's message decoded without bounds gave)."""


async def _prefill(client: httpx.AsyncClient, url: str, rid: str, prompt: list[int] = PROMPT) -> dict:
    r = await client.post(f"{url}/v1/completions", headers={"X-Request-Id": rid},
                          json=_leg({"kv_transfer_params": {"do_remote_decode": True}}, prompt=prompt, max_tokens=1))
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


async def _handoff_works(client: httpx.AsyncClient, pre: str, dec: str, rid: str) -> None:
    """A whole vLLM-style handoff, prefill then decode, answers 200 with its 4 tokens and frees the KV."""
    params = await _prefill(client, pre, rid)
    r = await client.post(f"{dec}/v1/completions", headers={"X-Request-Id": rid},
                          json=_leg({"kv_transfer_params": params}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4

    async def freed() -> bool:
        return await _held_tokens(client, pre) == 0
    await _eventually(freed)


async def _records(client: httpx.AsyncClient, url: str) -> list[dict]:
    return (await client.get(f"{url}/kvemu/requests")).json()["records"]


# ------------------------------------------------------------------ 1. a link model that cannot be priced


def test_an_unpriceable_link_model_is_a_400_naming_the_field_and_the_fleet_keeps_serving(tmp_path):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        params = await _prefill(client, pre.url, "a")
        forged = {**params, "kvemu_source": {**params["kvemu_source"], "bandwidth_gbps": HOSTILE.bandwidth_gbps,
                                             "bytes_per_token": HOSTILE.bytes_per_token}}
        t0 = time.monotonic()
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "a"},
                              json=_leg({"kv_transfer_params": forged}))
        assert time.monotonic() - t0 < 2
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "kv_transfer_params.kvemu_source.bandwidth_gbps"
        assert await _records(client, dec.url) == []  # nothing ran
        # the same leg as the prefill worker answered it still runs; so do later ones, on both pools
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "a"},
                              json=_leg({"kv_transfer_params": params}))
        assert r.status_code == 200, r.text
        await _handoff_works(client, pre.url, dec.url, "b")

    _run(tmp_path, body)


SLOW_LINK = SCENARIO.replace("kv_transfer_bandwidth: 25.0, kv_transfer_bytes_per_token: 131072",
                             "kv_transfer_bandwidth: 0.0001, kv_transfer_bytes_per_token: 1073741824")
"""A prefill pool whose link would move the 64-token prompt in ~687,000 s (the bounds of each field admit it)."""


def test_a_transfer_slower_than_the_bound_is_refused_up_front_not_reserved_for_days(tmp_path):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        params = await _prefill(client, pre.url, "slow")
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "slow"},
                              json=_leg({"kv_transfer_params": params}))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "kv_transfer_params.kvemu_source"
        assert f"more than the {MAX_TRANSFER_S:g} s" in error["message"]
        assert await _records(client, dec.url) == []
        assert 'kvemu_kv_handoff_refused_total{reason="kv_transfer_params.kvemu_source"} 1.0' in (
            await client.get(f"{dec.url}/metrics")).text

        async def freed() -> bool:  # the KV the refused leg had claimed is freed now, not at the hold timeout
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)

    _run(tmp_path, body, SLOW_LINK)


def test_an_engine_refuses_a_decode_leg_whose_transfer_it_cannot_price_by_field():
    worker = MockWorker(EngineConfig(block_size=16, num_gpu_blocks=64))
    bad = Request(request_id="x", token_ids=list(range(32)), max_tokens=4,
                  kv_transfer=HOSTILE)
    outcome = worker.dispatch(bad)
    assert not outcome.accepted and outcome.field == "kv_transfer" and "more than the" in outcome.message
    assert worker.advance_to(10**12) and worker.idle  # nothing was queued; the engine runs on


# ------------------------------------------------------------------ 2. a fake prefill peer over ZeroMQ


def test_a_finished_message_with_an_out_of_bounds_link_model_does_not_decode():
    bad = encode(Finished(request_id="r", times_ns=[1], kv_transfer=HOSTILE))
    with pytest.raises(msgspec.ValidationError, match="bandwidth_gbps"):
        decode_worker_message(bad)
    good = Finished(request_id="r", times_ns=[1], kv_transfer=KvTransfer(source_worker_id=0, bandwidth_gbps=25.0,
                                                                         bytes_per_token=131072))
    assert decode_worker_message(encode(good)) == good


def test_the_router_forwards_no_link_model_it_cannot_price_and_no_source_but_the_legs_own():
    """Registered prefill peers whose ``Finished`` says what no decode rank can price, or names the other prefill
    worker's KV: the first requests end ``kv_transfer_failed`` without a decode leg, the second ones are freed
    where they ran, and once the peers say the truth again every request completes."""
    from tests.harness.test_disagg import no_leaks, req, run_requests

    async def lie(c) -> None:  # noqa: ANN001 - a harness.cluster.Cluster
        prefill = sorted(wid for wid, pool in c.worker_pool.items() if pool == "prefill")
        honest = {wid: c.workers[wid]._transfer for wid in prefill}
        for wid in prefill:
            c.workers[wid]._transfer = msgspec.structs.replace(HOSTILE, source_worker_id=wid)
        await anyio.sleep(1.0)
        for wid, other in zip(prefill, prefill[::-1]):  # each names the other's KV
            c.workers[wid]._transfer = msgspec.structs.replace(honest[wid], source_worker_id=other)
        await anyio.sleep(1.0)
        for wid in prefill:
            c.workers[wid]._transfer = honest[wid]

    requests = [(0.1 * i, req(f"a{i}", 200, base=1000 * i)) for i in range(4)]
    requests += [(1.1 + 0.1 * i, req(f"b{i}", 200, base=50_000 + 1000 * i)) for i in range(4)]
    requests += [(2.1 + 0.1 * i, req(f"c{i}", 200, base=90_000 + 1000 * i)) for i in range(4)]
    out = run_requests(requests, chaos=lie)
    records = out["records"]
    for i in range(4):
        assert records[f"a{i}"].failure.startswith("kv_transfer_failed: the prefill worker's link model")
        assert records[f"a{i}"].first_token_ns is None  # no decode rank ran it
        assert records[f"b{i}"].failure is None and records[f"c{i}"].failure is None
    no_leaks(out)  # every held copy was freed on the worker that held it


# ------------------------------------------------------------------ 3. a forged source


def _listener() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock, sock.getsockname()[1]


@pytest.mark.parametrize("field, value", [
    ("remote_host", "127.0.0.1:{port}/any/path?q="),
    ("remote_host", "127.0.0.1/x#"),
    ("remote_host", "a" * 254),
    ("remote_port", 0),
])
def test_a_source_whose_address_is_not_a_host_and_port_is_refused_and_nothing_is_fetched(tmp_path, field, value):
    sock, port = _listener()

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        params = await _prefill(client, pre.url, "f")
        forged = {**params, field: value.format(port=port) if isinstance(value, str) else value}
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": forged}))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"kv_transfer_params.{field}"
        with pytest.raises(BlockingIOError):
            sock.accept()  # the decode worker connected to nothing
        assert await _records(client, dec.url) == [] and await _held_tokens(client, pre.url) == 64

    try:
        _run(tmp_path, body)
    finally:
        sock.close()


@pytest.mark.parametrize("host, url", [
    ("127.0.0.1", "http://127.0.0.1:8000/p"), ("::1", "http://[::1]:8000/p"),
    ("prefill-0.local", "http://prefill-0.local:8000/p"),
    ("127.0.0.1:1/x?q=", None), ("[::1]", None), ("fe80::1%eth0", None), ("a_b", None), (" 1.2.3.4", None),
    ("1.2.3.4\n", None), ("a" * 64, None), ("a." * 127, None), ("", None),
])
def test_a_peer_url_is_built_only_from_a_host_and_a_port(host, url):
    if url is not None:
        assert peer_url(host, 8000, "/p", host_field="h", port_field="p") == url
    else:
        with pytest.raises(ApiError) as caught:
            peer_url(host, 8000, "/p", host_field="h", port_field="p")
        assert caught.value.status == 400 and caught.value.param == "h"
    for port in (0, 65536):
        with pytest.raises(ApiError, match="p: a port in 1..65535"):
            peer_url("127.0.0.1", port, "/p", host_field="h", port_field="p")


def test_a_forged_source_is_a_400_with_its_reason_never_a_200_without_a_prefill(tmp_path):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        params = await _prefill(client, pre.url, "real")
        cases = {  # what a stranger can make up, and what the prefill worker says to each
            "kv_transfer_params.remote_request_id": {**params, "remote_request_id": "never-prefilled"},
            "kv_transfer_params.kvemu_release_token": {**params, "kvemu_release_token": "guess"},
        }
        for param, forged in cases.items():
            r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": forged}))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # the right token for another prompt: the digest does not match
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": params},
                                                                      prompt=PROMPT[::-1]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        # a source at a server that is not a prefill worker (the decode worker's own)
        port = int(dec.url.rsplit(":", 1)[1])
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": {**params,
                                                                                                "remote_port": port}}))
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("kv_transfer_params."), r.text
        assert await _records(client, dec.url) == []  # no decode ran without its prefill
        # the real leg, once; a second decode leg of the same KV is refused
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "real"},
                              json=_leg({"kv_transfer_params": params}))
        assert r.status_code == 200, r.text
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "again"},
                              json=_leg({"kv_transfer_params": params}))
        assert r.status_code == 400, r.text
        assert [t["request_id"] for t in await _records(client, dec.url)] == ["real"]

    _run(tmp_path, body)


# ------------------------------------------------------------------ 4. a stolen room


def test_a_room_is_handed_only_to_its_decode_leg_and_a_failed_claim_leaves_it(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_handoff, "ROOM_TIMEOUT_S", 10.0)
    monkeypatch.setattr(kv_handoff, "ROOM_POLL_S", 0.5)

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        port = int(pre.url.rsplit(":", 1)[1])
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 77}
        r = await client.post(f"{pre.url}/v1/completions", headers={"X-Request-Id": "s"}, json=_leg(room))
        assert r.status_code == 200
        for query in ("room=77", f"room=77&digest={prompt_digest(PROMPT[::-1])}", "room=77&digest=" + "0" * 32):
            thief = await client.get(f"{pre.url}/kvemu/kv/room?{query}")
            assert thief.status_code == 403 and "release" not in thief.text, thief.text
        t0 = time.monotonic()
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "s"}, json=_leg(room))
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 5  # it found its room at once

        async def freed() -> bool:
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)
        # a decode leg of another prompt naming the room is refused; nothing runs
        r = await client.post(f"{pre.url}/v1/completions", headers={"X-Request-Id": "t"},
                              json=_leg({**room, "bootstrap_room": 78}))
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({**room, "bootstrap_room": 78},
                                                                      prompt=PROMPT[::-1]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text
        assert [t["request_id"] for t in await _records(client, dec.url)] == ["s"]

    _run(tmp_path, body)


# ------------------------------------------------------------------ 5. a request whose pass fails


POISON_TOKENS = 48
"""The prompt length the injected fault picks: a transfer of that many tokens raises inside the engine's pass."""


def _poison(monkeypatch) -> None:
    """Make the engine's pass (``transfer_delay_ns``, called by the scheduler) raise for that prompt length; the
    admission check (``transfer_refusal``) still passes it. Patched in ``kvemu.transfer``, which is never compiled,
    so it takes in the mypyc build too."""
    real = transfer._delay

    def delay(link: KvTransfer, tokens: int) -> float:
        if tokens == POISON_TOKENS and sys._getframe(1).f_code.co_name == "transfer_delay_ns":
            raise OverflowError("cannot convert float infinity to integer")
        return real(link, tokens)
    monkeypatch.setattr(transfer, "_delay", delay)


def test_a_live_decode_worker_ends_a_request_whose_pass_fails_with_engine_error_and_serves_on(tmp_path, monkeypatch):
    _poison(monkeypatch)

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        poison = PROMPT[:POISON_TOKENS]
        params = await _prefill(client, pre.url, "p", prompt=poison)
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "p"},
                              json=_leg({"kv_transfer_params": params}, prompt=poison))
        assert r.status_code == 500, r.text
        assert "engine_error: OverflowError" in r.json()["error"]["message"]
        (rec,) = await _records(client, dec.url)
        assert rec["request_id"] == "p" and rec["failure"].startswith("engine_error: OverflowError")

        async def freed() -> bool:  # its prefill copy is released all the same
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)
        await _handoff_works(client, pre.url, dec.url, "after")  # the same rank serves the next leg
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({}))  # and plain requests
        assert r.status_code == 200, r.text

    _run(tmp_path, body)


def test_in_virtual_time_a_request_whose_pass_fails_ends_with_engine_error_and_the_others_complete(monkeypatch):
    from tests.harness.test_disagg import no_leaks, req, run_requests

    _poison(monkeypatch)
    requests = [(0.01 * i, req(f"r{i}", 200 + 50 * i, base=1000 * i)) for i in range(6)]
    requests.append((0.5, req("poison", POISON_TOKENS, base=99_000)))
    requests += [(1.0 + 0.01 * i, req(f"late{i}", 200 + 50 * i, base=50_000 + 1000 * i)) for i in range(6)]
    out = run_requests(requests)
    records = out["records"]
    assert records["poison"].failure.startswith("engine_error: OverflowError")
    late = [r for rid, r in records.items() if rid.startswith("late")]
    assert len(late) == 6 and all(r.failure is None and r.output_tokens == r.max_tokens for r in late)
    no_leaks(out)

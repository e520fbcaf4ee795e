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

import anyio
import httpx
import msgspec
import pytest

from harness.procs import kv_handoff
from harness.procs.fleet import FleetInfo
from harness.procs.kv_handoff import peer_url, prompt_digest
from kvemu.http.errors import ApiError
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


# ------------------------------------------------------------------ 6. a confirmer outside the fleet


FAST = KvTransfer(source_worker_id=0, bandwidth_gbps=1e6, bytes_per_token=1)
LINK = msgspec.to_builtins(FAST)
"""The link model a stranger's confirmer would give: the fastest the bounds admit (free decode, at once)."""


class FakePrefill:
    """A tiny 127.0.0.1 HTTP server that answers every claim and every room with a well-formed yes carrying
    ``proof`` (None: none), as a client's own listener would; with ``relay``, it passes each claim on to that
    real prefill worker and its answer back with a faster link model. It counts what it is asked, by path."""

    def __init__(self, proof: str | None = None, relay: str | None = None) -> None:
        self.proof = proof
        self.relay = relay
        self.hits: dict[str, int] = {}
        self.port = 0

    async def __aenter__(self) -> FakePrefill:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    def params(self, rid: str = "never-prefilled") -> dict:
        """``kv_transfer_params`` naming this server as the prefill worker."""
        return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": self.port,
                "remote_request_id": rid, "kvemu_release_token": "made-up", "kvemu_source": LINK}

    async def _answer(self, method: str, path: str, body: bytes) -> dict:
        if path == "/kvemu/kv/claim" and self.relay is not None:
            async with httpx.AsyncClient() as client:
                real = (await client.post(f"{self.relay}{path}", content=body,
                                          headers={"content-type": "application/json"})).json()
            real["kvemu_source"]["bandwidth_gbps"] = 1e6  # the answer's own proof, another link model
            return real
        proof = {} if self.proof is None else {"proof": self.proof}
        if path == "/kvemu/kv/room":  # (its params at the top too: what a decode worker read before proofs)
            return {**self.params(), "kv_transfer_params": self.params(), **proof}
        return {"kvemu_source": LINK, "released": True, **proof}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, target, _ = head[0].split(" ", 2)
            length = next((int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(length)
            path = target.split("?", 1)[0]
            self.hits[path] = self.hits.get(path, 0) + 1
            out = msgspec.json.encode(await self._answer(method, path, body))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n\r\n%s" % (len(out), out))
            await writer.drain()
        finally:
            writer.close()


async def _refused_for(client: httpx.AsyncClient, dec: str, reason: str) -> int:
    metrics = (await client.get(f"{dec}/metrics")).text
    line = f'kvemu_kv_handoff_refused_total{{reason="{reason}"}} '
    return next((int(float(x.split()[-1])) for x in metrics.splitlines() if x.startswith(line)), 0)


def _other_fleets_proof(rid: str, token: str) -> str:
    """A well-formed proof of exactly what the decode worker checks, under a secret that is not the fleet's."""
    return kv_handoff.handoff_proof(b"another fleet", "claim-answer", rid, token, prompt_digest(PROMPT),
                                    msgspec.json.encode(FAST))


@pytest.mark.parametrize("proof", [None, "0" * 64, "Z" * 64, "other"])
def test_a_decode_leg_whose_confirmer_is_not_a_worker_of_the_fleet_is_refused_and_nothing_runs(tmp_path, proof):
    """Before, any listener a client named that said yes to ``POST /kvemu/kv/claim`` got its leg decoded (200,
    no prefill, the listener's link model); now its answer must carry the fleet's proof: 400 ``claim.proof``,
    counted, nothing reserved, nothing run, no release sent to it."""
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        shown = _other_fleets_proof("never-prefilled", "made-up") if proof == "other" else proof
        async with FakePrefill(shown) as fake:
            t0 = time.monotonic()
            r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": fake.params()}))
            assert time.monotonic() - t0 < 5
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "claim.proof" and "not a prefill worker of this fleet" in error["message"]
            assert fake.hits == {"/kvemu/kv/claim": 1}  # asked once; nothing to free there
        assert await _records(client, dec.url) == [] and await _held_tokens(client, dec.url) == 0
        assert await _refused_for(client, dec.url, "claim.proof") == 1
        await _handoff_works(client, pre.url, dec.url, "genuine")  # the fleet's own handoff still runs

    _run(tmp_path, body)


@pytest.mark.parametrize("proof", [None, "0" * 64])
def test_a_decode_leg_whose_bootstrap_server_is_not_a_worker_of_the_fleet_is_refused(tmp_path, proof):
    """SGLang style: a stranger's bootstrap server hands a made-up room (and then confirms its claim); before, the
    decode worker served it; now the room answer must carry the fleet's proof: 400 ``room.proof``, no claim sent."""
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (dec, _) = info.pool("decode")
        async with FakePrefill(proof) as fake:
            r = await client.post(f"{dec.url}/v1/completions", json=_leg({
                "bootstrap_host": "127.0.0.1", "bootstrap_port": fake.port, "bootstrap_room": 7}))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "room.proof"
            assert fake.hits == {"/kvemu/kv/room": 1}
        assert await _records(client, dec.url) == [] and await _held_tokens(client, dec.url) == 0
        assert await _refused_for(client, dec.url, "room.proof") == 1

    _run(tmp_path, body)


def test_a_genuine_claim_answer_relayed_with_another_link_model_is_refused(tmp_path):
    """A client's listener in the middle passes the real prefill worker's claim answer on with a faster link: the
    proof covers the link model, so the decode worker refuses it (before: it decoded at the forged speed)."""
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        params = await _prefill(client, pre.url, "m")
        async with FakePrefill(relay=pre.url) as relay:
            r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "m"},
                                  json=_leg({"kv_transfer_params": {**params, "remote_port": relay.port}}))
            assert r.status_code == 400 and r.json()["error"]["param"] == "claim.proof", r.text
            assert relay.hits == {"/kvemu/kv/claim": 1}
        assert await _records(client, dec.url) == []

    _run(tmp_path, body)


def test_only_a_worker_of_the_fleet_can_claim_kv_or_take_a_room(tmp_path, monkeypatch):
    """A client holding a leg's token and prompt (the router copied them) claims the KV or takes the room itself,
    without the fleet's proof: 403 ``proof``, counted, and the real decode leg still gets it (before: the client's
    claim took it, and the decode leg was refused)."""
    monkeypatch.setattr(kv_handoff, "ROOM_POLL_S", 0.5)

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        params = await _prefill(client, pre.url, "c")
        claim = {"request_id": "c", "token": params["kvemu_release_token"], "digest": prompt_digest(PROMPT)}
        for extra in ({}, {"proof": "0" * 64}):
            r = await client.post(f"{pre.url}/kvemu/kv/claim", json={**claim, **extra})
            assert r.status_code == 403 and r.json()["error"]["param"] == "proof", r.text
        r = await client.post(f"{pre.url}/kvemu/kv/claim", json={**claim, "proof": "x" * 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "proof", r.text
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "c"},
                              json=_leg({"kv_transfer_params": params}))
        assert r.status_code == 200, r.text

        port = int(pre.url.rsplit(":", 1)[1])
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 41}
        assert (await client.post(f"{pre.url}/v1/completions", headers={"X-Request-Id": "r"},
                                  json=_leg(room))).status_code == 200
        for shown in ("", "&proof=" + "0" * 64):
            r = await client.get(f"{pre.url}/kvemu/kv/room?room=41&digest={prompt_digest(PROMPT)}{shown}")
            assert r.status_code == 403 and r.json()["error"]["param"] == "proof", r.text
        r = await client.post(f"{dec.url}/v1/completions", headers={"X-Request-Id": "r"}, json=_leg(room))
        assert r.status_code == 200, r.text
        metrics = (await client.get(f"{pre.url}/metrics")).text
        assert 'kvemu_kv_handoff_refused_total{reason="claim_proof"} 2.0' in metrics
        assert 'kvemu_kv_handoff_refused_total{reason="room_proof"} 2.0' in metrics

    _run(tmp_path, body)


FIELDS: list[str | int | bytes | None] = ["req-1", "token-1", "d" * 32, msgspec.json.encode(FAST), 41, None]
"""What a room answer's proof covers (request id, token, digest, link model, room, a field left out)."""
TAMPERED: list[str | int | bytes | None] = ["req-2", "token-", "e" * 32,
                                            msgspec.json.encode(msgspec.structs.replace(FAST, bandwidth_gbps=9e5)),
                                            42, ""]


@pytest.mark.parametrize("i", range(len(FIELDS)))
def test_a_proof_covers_each_of_its_fields_and_no_two_field_lists_encode_alike(i):
    key = b"fleet secret"
    proof = kv_handoff.handoff_proof(key, "room-answer", *FIELDS)
    assert len(proof) == kv_handoff.PROOF_CHARS and int(proof, 16) >= 0
    assert kv_handoff.handoff_proof(key, "room-answer", *FIELDS) == proof  # (a function of the values alone)
    assert kv_handoff.handoff_proof(key, "room-answer", *FIELDS[:i], TAMPERED[i], *FIELDS[i + 1:]) != proof
    assert kv_handoff.handoff_proof(b"another fleet", "room-answer", *FIELDS) != proof
    assert kv_handoff.handoff_proof(key, "claim-answer", *FIELDS) != proof  # another purpose
    # a character moved across a boundary, or a value of another type, is another message
    value = FIELDS[i]
    retyped = value.encode() if isinstance(value, str) else value.decode() if isinstance(value, bytes) else \
        str(value) if isinstance(value, int) else b""
    assert kv_handoff.handoff_proof(key, "room-answer", *FIELDS[:i], retyped, *FIELDS[i + 1:]) != proof
    assert kv_handoff.handoff_proof(key, "room-answer", "req-1t", "oken-1", *FIELDS[2:]) != proof


@pytest.mark.process_supervision
def test_a_fleet_of_processes_gives_its_workers_the_handoff_secret_in_their_environment_only(tmp_path):
    """``kvemu fleet --processes`` makes a handoff secret and hands it to its worker processes in their environment:
    the same for all, never on a command line (/proc/PID/cmdline), in its output or in any file; a handoff between
    the processes runs under it and a stranger's confirmer is refused. A worker started alone without it says so in
    one line at start."""
    from harness.procs.up import cli_env
    from kvemu.wire.security import HANDOFF_SECRET_ENV, SECRET_ENV
    from tests.end_to_end.test_run_secret import Proc, children

    path = tmp_path / "pd.yaml"
    path.write_text(SCENARIO.replace("workers: 2", "workers: 1"))
    env = {k: v for k, v in cli_env().items() if k not in (HANDOFF_SECRET_ENV, SECRET_ENV)}
    fleet = Proc(["fleet", str(path), "--processes"], tmp_path / "fleet.err", env)
    try:
        info = msgspec.convert(fleet.line("fleet"), FleetInfo)
        kids = children(fleet.proc.pid)
        environs = [dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
                    for pid in kids]
        made = {e.get(HANDOFF_SECRET_ENV) for e in environs}
        assert len(kids) == 2 and len(made) == 1 and None not in made, made
        shared = made.pop()
        assert shared is not None and len(shared) >= 40
        assert all(SECRET_ENV not in e for e in environs)  # (the KV-event sockets stay plain for other routers)
        for pid in [fleet.proc.pid, *kids]:
            assert shared not in open(f"/proc/{pid}/cmdline").read()

        async def main() -> None:
            (pre,), (dec,) = info.pool("prefill"), info.pool("decode")
            async with httpx.AsyncClient(timeout=30) as client, FakePrefill() as fake:
                await _handoff_works(client, pre.url, dec.url, "across-processes")
                r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": fake.params()}))
                assert r.status_code == 400 and r.json()["error"]["param"] == "claim.proof", r.text
        anyio.run(main)
    finally:
        err = fleet.stop()
    assert shared not in err and not any(shared in line for line in fleet.lines)
    assert "KV handoff" not in err, err[-3000:]
    for f in tmp_path.rglob("*"):
        assert not f.is_file() or shared.encode() not in f.read_bytes(), f

    alone = Proc(["worker", "--worker-type", "decode", "--worker-id", "3", "--http", "127.0.0.1:0", "--kv-events",
                  "tcp://127.0.0.1:0", "--config", str(path)], tmp_path / "alone.err", env)
    try:
        url = alone.line("started")["http"]
    finally:
        err = alone.stop()
    lines = [line for line in err.splitlines() if "KV handoff" in line]
    assert lines == [f"kvemu: the KV handoff of decode worker 3 at {url} runs without a secret: a decode leg may name "
                     f"any server to confirm its claim, so a client can have this worker decode a prompt no prefill "
                     f"ran, at a link model of its choosing; set {HANDOFF_SECRET_ENV} to the same secret for every "
                     f"prefill and decode worker (kvemu fleet does)"], err[-3000:]

"""A disaggregated fleet takes another router's legs over HTTP: vLLM's (prefill answers ``kv_transfer_params``,
the decode leg brings them back) and SGLang's (both legs at once, one bootstrap room). The prefill worker
holds the KV until the decode worker has pulled it and frees it then, or after a timeout nobody claimed it.

The "router" here is the test itself, sending what vllm-router and sglang-router send (their PD modes, run for
real in ``tests/end_to_end/test_fleet_routers.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest

from harness.procs import kv_handoff
from harness.procs.fleet import Fleet, FleetInfo
from harness.scenario import load_scenario

SCENARIO = """
name: pd-handoff
cluster:
  prefill:
    workers: 1
    dp_size: 2
    engine: {block_size: 16, num_gpu_blocks: 512, speedup_ratio: 50, decode_speedup_ratio: 50,
             kv_transfer_bandwidth: 25.0, kv_transfer_bytes_per_token: 131072}
  decode:
    workers: 2
    engine: {block_size: 16, num_gpu_blocks: 512, speedup_ratio: 50, decode_speedup_ratio: 50}
workload: {kind: synthetic, rate_rps: 1, turns: 1}
run: {mode: live, duration_s: 1, seed: 1}
"""
PROMPT = list(range(100, 164))  # 64 tokens: four full blocks


def _run(tmp_path, body: Callable[[FleetInfo, httpx.AsyncClient], Awaitable[None]], text: str = SCENARIO) -> None:
    path = tmp_path / "pd.yaml"
    path.write_text(text)
    scenario = load_scenario(path)

    async def main() -> None:
        async with anyio.create_task_group() as tg, httpx.AsyncClient(timeout=30) as client:
            info = await tg.start(Fleet(scenario).run)
            try:
                with anyio.fail_after(60):
                    await body(info, client)
            finally:
                tg.cancel_scope.cancel()

    anyio.run(main)


async def _held_tokens(client: httpx.AsyncClient, url: str) -> int:
    return sum(r["num_tokens"] for r in (await client.get(f"{url}/get_load")).json())


def _leg(extra: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"model": "kvemu", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **kw, **extra}


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(200):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never happened")


def test_vllm_style_the_decode_leg_pulls_the_prefill_legs_kv_and_frees_it(tmp_path):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        rid = {"X-Request-Id": "___prefill_addr_x___decode_addr_y_1"}  # vllm-router's own id, on both legs
        r = await client.post(f"{pre.url}/v1/completions", headers={**rid, "X-data-parallel-rank": "1"},
                              json=_leg({"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                                "remote_engine_id": None}}, max_tokens=1))
        assert r.status_code == 200, r.text
        answer = r.json()
        params = answer["kv_transfer_params"]
        assert answer["usage"]["completion_tokens"] == 1
        assert params["do_remote_prefill"] and not params["do_remote_decode"]
        assert params["kvemu_source"]["source_worker_id"] == pre.worker_id
        assert params["kvemu_source"]["source_dp_rank"] == 1 and params["kvemu_source"]["bandwidth_gbps"] == 25.0
        assert f"http://{params['remote_host']}:{params['remote_port']}" == pre.url
        assert await _held_tokens(client, pre.url) == 64  # held for the decode leg

        r = await client.post(f"{dec.url}/v1/completions", headers=rid,
                              json=_leg({"kv_transfer_params": params}, max_tokens=4))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4

        async def freed() -> bool:
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)
        again = await client.post(f"{pre.url}/kvemu/kv/release",
                                  json={"request_id": params["remote_request_id"], "token": params["kvemu_release_token"]})
        assert again.status_code == 404  # freed once, by the decode worker

        async def acknowledged() -> bool:  # the decode worker counts the release when the prefill worker answers
            return "kvemu_kv_handoff_released_total 1.0" in (await client.get(f"{dec.url}/metrics")).text
        await _eventually(acknowledged)
        assert "kvemu_kv_handoff_release_failures_total 0.0" in (await client.get(f"{dec.url}/metrics")).text
        assert "kvemu_kv_handoff_held 0.0" in (await client.get(f"{pre.url}/metrics")).text

        # the prefill worker still has the prompt cached: the next prefill leg on that rank finds it
        r = await client.post(f"{pre.url}/v1/completions", headers={"X-Request-Id": "p2", "X-data-parallel-rank": "1"},
                              json=_leg({"kv_transfer_params": {"do_remote_decode": True}}, max_tokens=1))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # all but the last block's token
        truth = (await client.get(f"{dec.url}/kvemu/requests")).json()["records"]
        assert [(t["request_id"], t["output_tokens"]) for t in truth] == [(rid["X-Request-Id"], 4)]

    _run(tmp_path, body)


def test_the_release_takes_only_the_token_it_was_handed_and_bad_legs_are_refused_by_field(tmp_path):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        r = await client.post(f"{pre.url}/v1/completions", headers={"X-Request-Id": "a"},
                              json=_leg({"kv_transfer_params": {"do_remote_decode": True}}))
        params = r.json()["kv_transfer_params"]
        wrong = await client.post(f"{pre.url}/kvemu/kv/release", json={"request_id": "a", "token": "guess"})
        assert wrong.status_code == 403 and await _held_tokens(client, pre.url) == 64  # nothing freed
        missing = {k: v for k, v in params.items() if k != "kvemu_source"}
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": missing}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.kvemu_source"
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({"kv_transfer_params": {"do_remote_decode": True}}))
        assert r.status_code == 400 and "decode worker" in r.json()["error"]["message"]
        r = await client.post(f"{pre.url}/v1/completions", json=_leg({"kv_transfer_params": params}))
        assert r.status_code == 400 and "prefill worker" in r.json()["error"]["message"]
        r = await client.post(f"{pre.url}/v1/completions", json=_leg({"kv_transfer_params": {"remote_port": 70000}}))
        assert r.status_code == 400 and "remote_port" in r.json()["error"]["message"]
        assert await _held_tokens(client, pre.url) == 64
        ok = await client.post(f"{pre.url}/kvemu/kv/release", json={"request_id": "a", "token": params["kvemu_release_token"]})
        assert ok.status_code == 200 and await _held_tokens(client, pre.url) == 0

    _run(tmp_path, body)


def test_kv_no_decode_leg_claims_is_freed_after_the_hold_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_handoff, "HOLD_TIMEOUT_S", 0.3)

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,) = info.pool("prefill")
        r = await client.post(f"{pre.url}/v1/completions", json=_leg({"kv_transfer_params": {"do_remote_decode": True}}))
        assert r.status_code == 200 and await _held_tokens(client, pre.url) == 64

        async def freed() -> bool:
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)
        assert "kvemu_kv_handoff_expired_total 1.0" in (await client.get(f"{pre.url}/metrics")).text

    _run(tmp_path, body)


def test_sglang_style_both_legs_at_once_meet_in_the_bootstrap_room(tmp_path):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        port = int(pre.url.rsplit(":", 1)[1])
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 2**62 + 3}
        head = {"X-Request-Id": "s1"}
        # the decode leg first: it waits for its room, as SGLang's decode server waits for the KV
        decode = asyncio.ensure_future(client.post(f"{dec.url}/v1/completions", headers=head, json=_leg(room)))
        await asyncio.sleep(0.1)
        prefill = await client.post(f"{pre.url}/v1/completions", headers=head, json=_leg(room))
        assert prefill.status_code == 200 and prefill.json()["usage"]["completion_tokens"] == 1
        r = await decode
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4

        async def freed() -> bool:
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)
        truth = (await client.get(f"{pre.url}/kvemu/requests")).json()["records"]
        assert [(t["request_id"], t["dp_rank"]) for t in truth] == [("s1", (2**62 + 3) % 2)]  # the room's rank

    _run(tmp_path, body)


def test_a_decode_leg_whose_prefill_leg_never_comes_ends_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_handoff, "ROOM_TIMEOUT_S", 0.5)
    monkeypatch.setattr(kv_handoff, "ROOM_POLL_S", 0.2)

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        port = int(pre.url.rsplit(":", 1)[1])
        r = await client.post(f"{dec.url}/v1/completions",
                              json=_leg({"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 9}))
        assert r.status_code == 504 and "did not finish within" in r.json()["error"]["message"]
        r = await client.post(f"{dec.url}/v1/completions", json=_leg({"bootstrap_room": 9}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_port"
        truth = (await client.get(f"{dec.url}/kvemu/requests")).json()["records"]
        assert truth == []  # nothing ran

    _run(tmp_path, body)


@pytest.mark.parametrize("query, param", [(b"room=x", "room"), (b"room=1&wait_s=99", "wait_s"),
                                          (b"room=99999999999999999999", "room")])
def test_the_room_route_refuses_a_bad_query_by_name(tmp_path, query, param):
    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,) = info.pool("prefill")
        r = await client.get(f"{pre.url}/kvemu/kv/room?{query.decode()}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param

    _run(tmp_path, body)


def test_a_room_whose_kv_expired_is_closed_and_no_decode_leg_pulls_freed_kv(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_handoff, "HOLD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(kv_handoff, "ROOM_TIMEOUT_S", 0.5)
    monkeypatch.setattr(kv_handoff, "ROOM_POLL_S", 0.2)

    async def body(info: FleetInfo, client: httpx.AsyncClient) -> None:
        (pre,), (dec, _) = info.pool("prefill"), info.pool("decode")
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": int(pre.url.rsplit(":", 1)[1]), "bootstrap_room": 5}
        r = await client.post(f"{pre.url}/v1/completions", json=_leg(room))
        assert r.status_code == 200 and await _held_tokens(client, pre.url) == 64

        async def freed() -> bool:
            return await _held_tokens(client, pre.url) == 0
        await _eventually(freed)
        r = await client.post(f"{dec.url}/v1/completions", json=_leg(room))  # too late: the room went with the KV
        assert r.status_code == 504 and (await client.get(f"{dec.url}/kvemu/requests")).json()["records"] == []

    _run(tmp_path, body)

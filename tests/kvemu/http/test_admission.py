"""Admission of generation requests: a cap on running requests, a bounded fair queue, 429/503 with
``Retry-After`` past it, and a server that keeps answering ``/metrics`` and short requests under a flood."""

from __future__ import annotations

import asyncio
import json
import subprocess

import msgspec
import pytest

from kvemu.http.admission import QUEUE_FULL, QUEUE_TIMEOUT, Admission, AdmissionLimits, Refused

from harness.procs.up import cli_command, cli_env
from tests.kvemu.http.flood import flood, rss_kb


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_past_the_cap_and_the_queue_a_request_gets_429_with_retry_after():
    async def main():
        gate = Admission(AdmissionLimits(max_running=2, max_waiting=1, retry_after_s=3))
        await gate.enter(False, 10, "a")
        await gate.enter(False, 10, "b")
        third = asyncio.ensure_future(gate.enter(False, 10, "c"))
        await asyncio.sleep(0)
        assert not third.done() and gate.waiting == 1
        with pytest.raises(Refused) as refused:
            await gate.enter(False, 10, "d")
        assert refused.value.status == 429 and (b"retry-after", b"3") in refused.value.headers
        gate.leave(False, 10)
        await third  # the freed slot went to the waiter
        assert (gate.running, gate.waiting, gate.refused[QUEUE_FULL]) == (2, 0, 1)

    _run(main())


def test_a_waiter_that_gets_no_slot_in_time_is_refused_503_and_leaves_the_queue():
    async def main():
        gate = Admission(AdmissionLimits(max_running=1, max_waiting=4, max_wait_s=0.05))
        await gate.enter(False, 1, "a")
        with pytest.raises(Refused) as refused:
            await gate.enter(False, 1, "b")
        assert refused.value.status == 503 and gate.waiting == 0 and gate.refused[QUEUE_TIMEOUT] == 1
        gate.leave(False, 1)
        assert gate.running == 0

    _run(main())


def test_short_requests_keep_slots_long_streams_cannot_take_and_go_first():
    async def main():
        gate = Admission(AdmissionLimits(max_running=4, max_waiting=8, long_share=0.5, long_tokens=100))
        await gate.enter(True, 1000, "long0")
        await gate.enter(True, 1000, "long1")
        late_long = asyncio.ensure_future(gate.enter(True, 1000, "long2"))
        await asyncio.sleep(0)
        assert not late_long.done()  # the long share (2 of 4) is taken
        await gate.enter(False, 4, "short0")  # a short request does not wait behind the long one
        await gate.enter(False, 4, "short1")
        short = asyncio.ensure_future(gate.enter(False, 4, "short2"))
        await asyncio.sleep(0)
        assert not short.done()
        gate.leave(False, 4)  # a short slot frees: it goes to the short waiter, though the long came first
        await asyncio.sleep(0)
        assert short.done() and not late_long.done()
        gate.leave(True, 1000)
        await late_long

    _run(main())


def test_the_output_token_budget_bounds_what_runs_together_but_one_request_always_runs():
    async def main():
        gate = Admission(AdmissionLimits(max_running=10, max_waiting=4, max_output_tokens=100, long_tokens=10**6))
        await gate.enter(False, 500, "big")  # alone: runs, whatever it asks
        second = asyncio.ensure_future(gate.enter(False, 60, "next"))
        await asyncio.sleep(0)
        assert not second.done()
        gate.leave(False, 500)
        await second
        assert gate.tokens == 60

    _run(main())


def test_long_requests_reserve_at_most_their_share_of_the_kv_and_short_ones_never_wait_for_it():
    async def main():
        gate = Admission(AdmissionLimits(max_running=100, max_waiting=8, long_tokens=10, long_share=0.75,
                                         kv_tokens=1000))
        await gate.enter(True, 5000, "huge")  # alone: runs, whatever it asks
        gate.leave(True, 5000)
        await gate.enter(True, 300, "long0")
        await gate.enter(True, 300, "long1")
        third = asyncio.ensure_future(gate.enter(True, 300, "long2"))  # 900 > 750 of the KV
        await asyncio.sleep(0)
        assert not third.done() and gate.long_tokens == 600
        for i in range(20):  # short requests do not wait for the KV the long ones would fill
            await gate.enter(False, 10, f"short{i}")
        gate.leave(True, 300)
        await third
        assert (gate.long_running, gate.long_tokens) == (2, 600)
        waiters = [asyncio.ensure_future(gate.enter(True, 300, f"more{i}")) for i in range(8)]
        await asyncio.sleep(0)
        with pytest.raises(Refused) as refused:
            await gate.enter(True, 300, "one too many")
        assert "750 output tokens together at most, of 1000 KV" in str(refused.value)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    _run(main())


def test_a_cancelled_waiter_frees_its_place_and_a_granted_one_its_slot():
    async def main():
        gate = Admission(AdmissionLimits(max_running=1, max_waiting=1))
        await gate.enter(False, 1, "a")
        w = asyncio.ensure_future(gate.enter(False, 1, "b"))
        await asyncio.sleep(0)
        w.cancel()
        await asyncio.gather(w, return_exceptions=True)
        assert gate.waiting == 0
        w = asyncio.ensure_future(gate.enter(False, 1, "c"))
        await asyncio.sleep(0)
        gate.leave(False, 1)  # granted, then cancelled before it ran: the slot is handed back
        w.cancel()
        await asyncio.gather(w, return_exceptions=True)
        assert (gate.running, gate.waiting) == (0, 0)

    _run(main())


def test_the_limits_declare_their_bounds():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_running": 0}, AdmissionLimits)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_waiting": 10**9}, AdmissionLimits)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kv_tokens": 0}, AdmissionLimits)


FLOOD_SCENARIO = """
name: flood
cluster:
  workers: 2
  engine: {block_size: 16, num_gpu_blocks: 65536, speedup_ratio: 50, decode_speedup_ratio: 50}
router: {policy: kv}
run: {mode: live, seed: 5}
"""


def test_a_flood_of_long_streams_is_capped_and_metrics_and_short_requests_still_answer(tmp_path):
    """200 streams of 100,000 tokens at once against a front door capped at 16 running and 16 waiting: the rest
    get 429 with Retry-After at once, /metrics and a 4-token request answer within a second meanwhile, and the
    serving process stays small (before: every stream admitted, its output plan in memory)."""
    path = tmp_path / "flood.yaml"
    path.write_text(FLOOD_SCENARIO)
    proc = subprocess.Popen(cli_command("serve", str(path), "--in-process", "--http", "127.0.0.1:0",
                                        "--max-running", "16", "--max-waiting", "16"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = json.loads(proc.stdout.readline())["http"]  # type: ignore[union-attr]
        base_kb = rss_kb(proc.pid)
        res = asyncio.run(flood(url, proc.pid, streams=200, max_tokens=100_000, seconds=6, probes=3))
        import httpx
        text = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert res.statuses.get(429, 0) >= 200 - 32 and "1" in res.retry_after, res.statuses
    assert max(res.metrics_s) < 2.0, res.metrics_s
    assert max(res.short_ttft_s) < 2.0, res.short_ttft_s
    assert max(res.rss_kb) - base_kb < 400 * 1024, (base_kb, res.rss_kb)
    assert 'kvemu_admission_refused_total{reason="queue_full"}' in text


def test_the_flags_out_of_bounds_are_a_usage_error_naming_the_flag(capsys):
    from harness.cli import main

    for argv, flag in ((["serve", "--max-running", "0"], "--max-running"),
                       (["worker", "--http", "127.0.0.1:0", "--max-waiting", "100000"], "--max-waiting")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and f"{flag}: Expected int" in capsys.readouterr().err


def test_long_streams_that_would_fill_the_engines_kv_wait_at_the_door_and_short_requests_stream_at_once(tmp_path):
    """40 streams of 10,000 tokens at once against 2 workers holding 32,768 KV tokens each: unchecked, the
    admitted streams fill both engines' KV within seconds and a 4-token request then waits in the engine's
    queue until a stream ends (minutes). The front door knows the engines' KV and admits long streams for at
    most 3/4 of it, so every short request streams its first token within 2 s."""
    path = tmp_path / "kv.yaml"
    path.write_text(FLOOD_SCENARIO.replace("num_gpu_blocks: 65536", "num_gpu_blocks: 2048"))
    proc = subprocess.Popen(cli_command("serve", str(path), "--in-process", "--http", "127.0.0.1:0"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = json.loads(proc.stdout.readline())["http"]  # type: ignore[union-attr]
        res = asyncio.run(flood(url, proc.pid, streams=40, max_tokens=10_000, seconds=8, probes=4))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert res.short_outcome == ["200"] * 4 and max(res.short_ttft_s) < 2.0, (res.short_outcome, res.short_ttft_s)

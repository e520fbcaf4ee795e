"""``unsettled(now_ns)``: the requests an engine still works for (what the lanes' warm-up barrier waits on), read
without changing anything: unfinished requests, prefill legs holding KV for a decode rank, KV in transit, host
offload stores in flight."""

from __future__ import annotations

from kvemu.transfer import KvTransfer
from workers.config import EngineConfig, HostOffloadConfig
from workers.mock_worker import MockWorker
from workers.request import Request
from workers.sglang.engine import SglangEngineCore
from workers.vllm.engine import VllmEngineCore

MS = 1_000_000
PROMPT = list(range(4096))


def drain(eng) -> list:
    done = []
    while (t := eng.next_event_ns()) is not None:
        done += eng.advance_to(t).completed
    return done


def test_an_unfinished_request_is_unsettled_until_it_completes_and_aborted_ones_settle():
    for eng in (VllmEngineCore(EngineConfig()), SglangEngineCore(EngineConfig(backend="sglang"))):
        assert eng.unsettled(0) == 0
        eng.add_request(Request(request_id="a", token_ids=PROMPT, max_tokens=4, arrival_ns=0))
        eng.add_request(Request(request_id="b", token_ids=PROMPT[:100], max_tokens=4, arrival_ns=5 * MS))
        assert eng.unsettled(0) == 2  # one not yet arrived counts: the engine has accepted it
        eng.abort("b", "cancelled")
        assert eng.unsettled(0) == 1
        (rec,) = drain(eng)
        assert rec.request_id == "a" and eng.unsettled(eng.now_ns) == 0


def test_a_prefill_leg_holding_kv_and_a_decode_leg_awaiting_its_transfer_are_unsettled():
    pre = VllmEngineCore(EngineConfig())
    pre.add_request(Request(request_id="r", token_ids=PROMPT, max_tokens=1, arrival_ns=0, kv_hold=True))
    drain(pre)
    assert pre.num_unfinished == 0 and pre.unsettled(pre.now_ns) == 1  # done for the client, its KV still held
    pre.release_kv("r")
    assert pre.unsettled(pre.now_ns) == 0
    dec = VllmEngineCore(EngineConfig())
    dec.add_request(Request(request_id="r", token_ids=PROMPT, max_tokens=3, arrival_ns=0,
                            kv_transfer=KvTransfer(source_worker_id=0, bandwidth_gbps=1.0)))
    dec.advance_to(1 * MS)
    assert dec.unsettled(1 * MS) == 1
    drain(dec)
    assert dec.unsettled(dec.now_ns) == 0


def test_a_finished_request_whose_blocks_are_still_being_offloaded_is_unsettled_until_the_store_ends():
    offload = HostOffloadConfig(num_host_blocks=1000, latency_to_first_byte_ms=500.0)
    worker = MockWorker(EngineConfig(kv_cache_bytes_per_token=1000, native_host_offload=offload))
    eng = worker.cores[0]
    eng.add_request(Request(request_id="a", token_ids=PROMPT, max_tokens=1, arrival_ns=0))
    (rec,) = drain(eng)
    assert eng.num_unfinished == 0 and rec.completion_ns is not None
    host = eng.host
    assert host is not None and host.stores
    end = max(s[0] for s in host.stores)
    assert end > rec.completion_ns + 400 * MS
    assert worker.unsettled(rec.completion_ns) == worker.unsettled(end - 1) == 1
    assert worker.unsettled(end) == 0  # ended, though the idle engine applies it only at its next pass
    assert host.stores  # the query changed nothing

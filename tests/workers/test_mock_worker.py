"""Worker dispatch: accepted requests run; rejected ones carry a typed reason naming the field, and change nothing."""

import re

import pytest

from kvemu.errors import KvemuError
from workers.admission import RejectReason, RequestRejected
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.request import Request
from workers.mock_worker import MockWorker

CFG = EngineConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, dp_size=2)


def make(**kw) -> Request:
    base = dict(request_id="r", token_ids=[1, 2, 3], max_tokens=2, arrival_ns=0)
    base.update(kw)
    return Request(**base)


@pytest.mark.parametrize(
    ("kw", "field", "text"),
    [
        ({"token_ids": []}, "token_ids", "the prompt is empty"),
        ({"max_tokens": 0}, "max_tokens", "must be an integer >= 1"),
        ({"max_tokens": 2.0}, "max_tokens", "must be an integer >= 1"),
        ({"token_ids": [1, -1]}, "token_ids", r"\[0, 2\*\*32\)"),
        ({"token_ids": [1, 2**32]}, "token_ids", r"\[0, 2\*\*32\)"),
        ({"token_ids": [1, "x"]}, "token_ids", r"\[0, 2\*\*32\)"),
        ({"token_ids": [1] * 60, "max_tokens": 6}, "token_ids", "can never fit in the pool of 16 blocks x 4 tokens"),
        ({"request_id": ""}, "request_id", "non-empty string"),
        ({"arrival_ns": -1}, "arrival_ns", "must be an integer >= the engine's current time 0"),
        ({"seq_hashes": [1, 2]}, "seq_hashes", "expected 0 hashes"),
        ({"output_token_ids": [2**40]}, "output_token_ids", r"\[0, 2\*\*32\)"),
        ({"priority": "high"}, "priority", "must be an integer"),
    ],
)
def test_malformed_requests_are_rejected_naming_the_field(kw, field, text):
    w = MockWorker(CFG)
    d = w.dispatch(make(**kw), dp_rank=1)
    assert not d.accepted and d.reason is RejectReason.MALFORMED and d.field == field
    assert d.message.startswith(f"{field}: ")
    assert re.search(text, d.message)
    with pytest.raises(RequestRejected) as exc:
        d.raise_if_rejected()
    assert isinstance(exc.value, KvemuError) and exc.value.reason is RejectReason.MALFORMED
    assert w.core(1).num_unfinished == 0 and w.core(1).pool.free == 16


def test_too_long_without_chunked_prefill_is_rejected():
    cfg = EngineConfig(
        num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False
    )
    eng = VllmEngineCore(cfg)
    with pytest.raises(RequestRejected, match="exceed max_num_batched_tokens") as exc:
        eng.add_request(make(token_ids=list(range(30)), max_tokens=4))
    assert exc.value.field == "token_ids"
    eng.add_request(make(token_ids=list(range(30)), max_tokens=3))  # 32 tokens of KV: fits


def test_unknown_dp_rank_and_shutdown_and_duplicates():
    w = MockWorker(CFG, worker_id=9, dp_start_rank=2)
    d = w.dispatch(make(), dp_rank=0)
    assert d.reason is RejectReason.UNKNOWN_DP_RANK and d.field == "dp_rank" and "ranks range(2, 4)" in d.message
    assert w.dispatch(make(), dp_rank=4).reason is RejectReason.UNKNOWN_DP_RANK
    assert w.dispatch(make(), dp_rank=3).accepted
    dup = w.dispatch(make(), dp_rank=3)
    assert dup.reason is RejectReason.DUPLICATE_REQUEST_ID and dup.field == "request_id"
    assert w.dispatch(make(), dp_rank=2).accepted  # ranks are independent: the same id may run elsewhere
    w.begin_shutdown()
    d = w.dispatch(make(request_id="late"), dp_rank=2)
    assert d.reason is RejectReason.SHUTTING_DOWN and "worker 9 is shutting down" in d.message
    # accepted requests still drain
    w.advance_to(10**10)
    assert w.idle and w.next_event_ns() is None


def test_accepted_dispatch_returns_the_live_record():
    w = MockWorker(CFG)
    d = w.dispatch(make(request_id="ok", max_tokens=3), dp_rank=0)
    assert d.accepted and d.reason is None
    rec = d.raise_if_rejected()
    assert rec.request_id == "ok" and rec.dp_rank == 0 and not rec.done
    w.advance_to(10**10)
    assert rec.done and rec.output_tokens == 3


def test_arrival_defaults_to_the_engine_time():
    eng = VllmEngineCore(CFG)
    eng.advance_to(5_000)
    rec = eng.add_request(make(arrival_ns=None))
    assert rec.arrival_ns == 5_000
    with pytest.raises(RequestRejected, match="arrival_ns"):
        eng.add_request(make(request_id="old", arrival_ns=4_999))

"""TRT-LLM flavour of the mock engine: reservation at admission, head-of-line waiting, no preemption,
whole-block prefix reuse (expected times from ai-dynamo-runtime 1.6.1's replay; see test_reference_engines)."""

from __future__ import annotations

import pytest
from tests.engine_runs import run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.admission import RequestRejected
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.request import Request
from workers.timing import PolynomialTiming

MS = 1_000_000


def req(rid: str, prompt: int, out: int, at_ms: float = 0, base: int = 0, tokens: list[int] | None = None) -> Request:
    ids = tokens if tokens is not None else [base * 100_000 + i for i in range(prompt)]
    return Request(request_id=rid, token_ids=ids, max_tokens=out, arrival_ns=round(at_ms * MS))


def run(cfg: EngineConfig, reqs: list[Request]) -> dict:
    return run_to_end(VllmEngineCore(cfg), reqs)


def test_defaults_follow_the_backend():
    assert EngineConfig(backend="trtllm").block_size == 32
    assert EngineConfig().block_size == 64
    assert EngineConfig(backend="trtllm", block_size=16).block_size == 16


def test_a_request_waits_until_its_whole_kv_can_be_reserved():
    # 320 + 321 tokens need ceil(641/32) = 21 blocks and 320 + 320 need 20: 41 > 40, so B waits for A's end
    a, b = req("a", 320, 321, 0, base=1), req("b", 320, 320, 1, base=2)
    done = run(EngineConfig(backend="trtllm", num_gpu_blocks=40), [a, b])
    assert done["b"].engine.admitted_ns == done["a"].completion_ns == 7_142_540_515
    assert done["a"].engine.preemptions == done["b"].engine.preemptions == 0
    # one more block and both run at once (vLLM-flavour times)
    done = run(EngineConfig(backend="trtllm", num_gpu_blocks=41), [a, b])
    assert done["b"].engine.admitted_ns == 21_403_231


def test_the_queue_head_is_never_overtaken():
    reqs = [req("a", 320, 400, 0, base=1), req("b", 320, 400, 1, base=2), req("c", 32, 4, 2, base=3)]
    done = run(EngineConfig(backend="trtllm", num_gpu_blocks=40), reqs)
    assert done["b"].engine.admitted_ns == done["c"].engine.admitted_ns == done["a"].completion_ns
    vllm = run(EngineConfig(block_size=32, num_gpu_blocks=40), reqs)  # vLLM lets c in and preempts instead
    assert vllm["c"].engine.admitted_ns < done["a"].completion_ns and vllm["b"].engine.preemptions == 1


def test_only_prefix_blocks_running_requests_hold_reduce_the_reservation():
    shared = [7] * 320
    a = req("a", 320, 200, 0, tokens=shared)
    b = req("b", 640, 160, 0.001, tokens=shared + [8] * 320)
    # b needs 25 blocks less a's 10 active ones: 15 fit beside a's remaining reservation of 32 - 17
    done = run(EngineConfig(backend="trtllm", num_gpu_blocks=32, block_size=32), [a, b])
    assert done["b"].engine.admitted_ns == 21_403_231
    done = run(EngineConfig(backend="trtllm", num_gpu_blocks=31, block_size=32), [a, b])
    assert done["b"].engine.admitted_ns == done["a"].completion_ns
    assert done["b"].engine.cached_tokens == 320


def test_a_fully_cached_aligned_prompt_computes_nothing_and_decodes_its_prompt():
    tokens = list(range(288))  # 9 blocks of 32
    done = run(EngineConfig(backend="trtllm"), [req("a", 288, 3, 0, tokens=tokens), req("b", 288, 3, 1000, tokens=tokens)])
    b = done["b"]
    assert b.engine.cached_tokens == 288
    decode = PolynomialTiming().decode_ms(288, 16384 * 32)
    assert b.first_token_ns - b.arrival_ns == round(decode * MS)  # 5.769661 ms, no prefill part
    vllm = run(EngineConfig(block_size=32), [req("a", 288, 3, 0, tokens=tokens), req("b", 288, 3, 1000, tokens=tokens)])
    assert vllm["b"].engine.cached_tokens == 256  # vLLM recomputes the last block's tokens


def test_a_request_that_could_never_be_reserved_is_refused():
    eng = VllmEngineCore(EngineConfig(backend="trtllm", num_gpu_blocks=10))  # 320 tokens
    with pytest.raises(RequestRejected, match="can never be reserved"):
        eng.add_request(req("a", 300, 21))
    eng.add_request(req("b", 300, 20))  # exactly the pool


@st.composite
def contended(draw):
    blocks = draw(st.integers(4, 24))
    bs = draw(st.sampled_from([1, 2, 4]))
    cfg = EngineConfig(backend="trtllm", num_gpu_blocks=blocks, block_size=bs, max_num_seqs=draw(st.integers(1, 6)),
                       max_num_batched_tokens=draw(st.integers(6, 32)))
    cap = blocks * bs
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        prompt = draw(st.integers(1, cap - 1))
        out = draw(st.integers(1, cap - prompt))
        shared = draw(st.integers(0, prompt))
        tokens = [1] * shared + [1000 * (i + 1) + k for k in range(prompt - shared)]
        reqs.append(Request(request_id=f"r{i}", token_ids=tokens, max_tokens=out,
                            arrival_ns=draw(st.integers(0, 20)) * MS))
    return cfg, reqs


@settings(max_examples=150, deadline=None)
@given(contended())
def test_nothing_is_ever_preempted_and_everything_completes(work):
    cfg, reqs = work
    done = run_to_end(VllmEngineCore(cfg), reqs)
    assert sorted(done) == sorted(r.request_id for r in reqs)
    assert all(rec.engine.preemptions == 0 and rec.output_tokens == rec.max_tokens for rec in done.values())

"""The reference mocker's scheduling and timing under load, which decide per-request times once memory is short.

Measured against ai-dynamo-runtime 1.6.1 (vLLM-flavour mocker, default engine arguments):

* a waiting request is admitted only if blocks for its whole known sequence (less its cached prefix blocks in
  use) are free or evictable, although only the pass's chunk is allocated;
* blocks a pass fills become cached when the pass is scheduled: a request admitted later in the same pass
  finds them (a second request sharing 3 trace blocks with the first, both at t = 0, reuses 1,536 tokens);
* a prefill batch of k requests is timed as k requests of (mean prompt position after - mean before) new
  tokens, each mean an integer division: 1,000 + 1,001 tokens take the time of 2,000;
* a re-admitted (preempted) request recomputes its generated tokens for free and, in the pass that catches it
  up, counts as a decode with its whole context;
* decode utilisation (logical KV over the pool) is clamped at 1.

The last test replays a small slice on one engine with a short pool (preemption included) and compares
every request's first token and completion with the reference's, to the microsecond.
"""

from __future__ import annotations

import json

import pytest

from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.request import Request
from harness.workload.traces.mooncake import mooncake_request, mooncake_row



def _run(eng: VllmEngineCore) -> list:
    passes = []
    while eng.num_unfinished:
        passes.append(eng.step(eng.next_pass_start_ns()))
    return passes


def _row(ts_ms: float, isl: int, osl: int, hash_ids: list[int]) -> dict:
    return {"timestamp": ts_ms, "input_length": isl, "output_length": osl, "hash_ids": hash_ids}


def _add_rows(eng: VllmEngineCore, rows: list[dict]) -> list:
    return [eng.add_request(mooncake_request(mooncake_row(r, 512), request_id=f"r{i}", trace_block_size=512))
            for i, r in enumerate(rows)]


def test_admission_waits_for_blocks_of_the_whole_prompt():
    # 10 blocks of 4 tokens, 8 tokens a pass. r0 holds 6 blocks once it decodes; r1's first chunk (2 blocks)
    # would fit, but its whole prompt (6 blocks) does not: it waits for r0 instead of preempting it later.
    cfg = EngineConfig(num_gpu_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    eng = VllmEngineCore(cfg)
    r0 = eng.add_request(Request(request_id="r0", token_ids=list(range(20)), max_tokens=6, arrival_ns=0))
    r1 = eng.add_request(Request(request_id="r1", token_ids=list(range(100, 124)), max_tokens=2, arrival_ns=1))
    passes = _run(eng)
    assert not any(p.preempted for p in passes)
    assert r1.engine.admitted_ns >= r0.completion_ns
    assert r0.engine.preemptions == r1.engine.preemptions == 0


def test_blocks_filled_by_a_pass_are_found_by_later_admissions_in_it():
    eng = VllmEngineCore(EngineConfig())
    a, b = _add_rows(eng, [_row(0, 2000, 3, [1, 2, 3, 4]), _row(0, 2000, 4, [1, 2, 3, 5])])
    first = _run(eng)[0]
    assert (a.engine.cached_tokens, b.engine.cached_tokens) == (0, 1536)
    # timed as 2 requests of (4000 // 2 - 1536 // 2) new tokens
    assert first.duration_ns == eng.timer.prefill_ns(2 * (2000 - 768))


def test_a_prefill_batch_is_timed_by_its_integer_mean():
    eng = VllmEngineCore(EngineConfig())
    _add_rows(eng, [_row(0, 1000, 2, [1, 2]), _row(0, 1001, 3, [3, 4])])
    assert _run(eng)[0].duration_ns == eng.timer.prefill_ns(2000)


def test_recomputed_output_is_free_and_decodes():
    # 40 blocks of 64: r1 is preempted while both decode, then re-admitted with its prompt still cached
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=40))
    _, r1 = _add_rows(eng, [_row(0, 1000, 400, [1, 2]), _row(0, 1001, 401, [3, 4])])
    passes = _run(eng)
    assert r1.engine.preemptions == 1
    back = [p for p in passes if "r1" in p.admitted][-1]
    assert back.prefill_tokens > 0  # it recomputes generated tokens ...
    tokens = 1001 + r1.token_times_ns.index(back.end_ns)  # its context when the pass catches it up
    assert back.duration_ns == eng.timer.decode_ns(tokens)  # ... timed as a plain decode of its context


@pytest.mark.reference
def test_per_request_times_equal_the_reference_under_memory_pressure(dynamo_core, mooncake_trace, tmp_path):
    rows = []
    with mooncake_trace.open() as src:
        for i, line in zip(range(40), src):
            row = json.loads(line)
            # 40 rows, one every 15 ms, on one engine of 4,000 blocks; outputs of at least 1,000 tokens make the
            # running requests outgrow the pool (4 to 8 preemptions on the real trace's rows and the generated one's)
            row["timestamp"] = 15 * i
            row["output_length"] = max(row["output_length"], 1000)
            rows.append(row)
    path = tmp_path / "slice.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "reference.jsonl"
    dynamo_core.run_mocker_trace_replay([str(path)], num_workers=1, trace_block_size=512, replay_mode="offline",
                                        router_mode="round_robin", report_jsonl_path=str(report),
                                        extra_engine_args={"engine": {"num_gpu_blocks": 4000}})
    ref = sorted((json.loads(line) for line in report.read_text().splitlines()),
                 key=lambda r: (r["arrival_time_ms"], r["input_length"]))
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=4000))
    ours = _add_rows(eng, rows)
    _run(eng)
    assert sum(r["readmission_count"] for r in ref) > 0, "the slice no longer preempts: the test lost its point"
    for r, k in zip(ref, ours):
        assert r["input_length"] == k.isl
        assert k.engine.preemptions == r["readmission_count"]
        assert k.first_token_ns / 1e6 == pytest.approx(r["first_token_ms"], abs=1e-3)
        assert k.completion_ns / 1e6 == pytest.approx(r["terminal_time_ms"], abs=1e-3)

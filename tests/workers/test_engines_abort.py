"""Aborting requests in the engine (a client went away): blocks freed, nothing more produced, both drivers agree."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.clock import MAX_TIME_NS
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.request import Request
from workers.mock_worker import engine_core

from tests.engine_runs import steps
from tests.workers.test_engines_fastforward import MS, summary, workloads


def _abort_plan(draw, reqs):
    ids = [r.request_id for r in reqs]
    chosen = draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids)))
    return sorted((draw(st.integers(0, 200)) * MS, rid) for rid in chosen)


def _stepwise(cfg, reqs, aborts):
    eng = engine_core(cfg)
    done, batches = [], []
    plan = list(aborts)

    def abort_due():
        """The aborts due before the next pass starts, applied; then its start."""
        s = eng.next_pass_start_ns()
        while plan and (s is None or plan[0][0] <= s):
            t, rid = plan.pop(0)
            if t > eng.now_ns:  # no pass starts before t: only the clock moves (one during a pass ends it first)
                eng.advance_to(t)
            eng.abort(rid)
            eng.check_invariants()
            s = eng.next_pass_start_ns()
        return s

    for res in steps(eng, reqs, abort_due):
        done += res.completed
        if res.events is not None:
            batches.append(res.kv_batch)
    return done, batches, eng


def _fast_forward(cfg, reqs, aborts):
    eng = engine_core(cfg)
    for r in reqs:
        eng.add_request(r)
    done, batches = [], []
    for t, rid in aborts:
        out = eng.advance_to(max(t, eng.now_ns))
        done += out.completed
        batches += out.kv_batches
        eng.abort(rid)
        eng.check_invariants()
    out = eng.advance_to(MAX_TIME_NS)
    done += out.completed
    batches += out.kv_batches
    eng.check_invariants()
    return done, batches, eng


def _all_free(eng) -> bool:
    """Every block (page) is free or cached, none held by a request."""
    if isinstance(eng, VllmEngineCore):
        return eng.pool.free + len(eng.pool.cached) == eng.pool.num_blocks
    return eng.cache.owned == 0 and eng.cache.locked == 0


@st.composite
def aborted_workloads(draw):
    cfg, reqs, _ = draw(workloads())
    return cfg, reqs, _abort_plan(draw, reqs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(aborted_workloads())
def test_aborted_requests_free_everything_and_both_drivers_agree(work):
    cfg, reqs, aborts = work
    aborted = {rid for _, rid in aborts}
    ref_done, ref_batches, ref = _stepwise(cfg, reqs, aborts)
    ff_done, ff_batches, ff = _fast_forward(cfg, reqs, aborts)
    for eng in (ref, ff):  # nothing left behind: no request, no block held, no work pending
        assert eng.num_unfinished == 0 and eng.num_running == 0 and eng.next_event_ns() is None
        assert _all_free(eng)
    kept = lambda done: {k: v for k, v in summary(done).items() if k not in aborted}  # noqa: E731
    assert kept(ff_done) == kept(ref_done)
    assert {r.request_id for r in ff_done} - aborted == {r.request_id for r in reqs} - aborted
    assert not {r.request_id for r in ff_done} & aborted or all(  # fast-forward never reports an aborted one done
        t >= r.completion_ns for t, rid in aborts for r in ff_done if r.request_id == rid)
    assert ff_batches == ref_batches


def test_abort_mid_prefill_frees_the_blocks_and_keeps_full_ones_cached():
    cfg = EngineConfig(num_gpu_blocks=32, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    eng = VllmEngineCore(cfg)
    eng.add_request(Request(request_id="a", token_ids=list(range(16)), max_tokens=50, arrival_ns=0))
    eng.advance_to(1)  # the first chunk (8 tokens) is in flight
    assert eng._inflight is not None
    rec = eng.abort("a")
    assert rec is not None and rec.failure == "cancelled" and not eng.has_request("a")
    out = eng.advance_to(MAX_TIME_NS)
    assert not out.first_tokens and not out.completed  # nothing reported for it after the abort
    eng.check_invariants()
    assert eng.num_running == 0 and eng.pool.free + len(eng.pool.cached) == 32
    assert len(eng.pool.cached) == 2  # the two blocks its pass filled stay reusable
    assert eng.abort("a") is None  # a second abort, or an unknown id, changes nothing


def test_abort_of_a_waiting_request_lets_the_next_one_in():
    cfg = EngineConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=1)
    eng = VllmEngineCore(cfg)
    for i in range(3):
        eng.add_request(Request(request_id=f"r{i}", token_ids=[i] * 8, max_tokens=4, arrival_ns=0))
    eng.abort("r1")  # still waiting: never runs
    done = eng.advance_to(MAX_TIME_NS).completed
    assert [r.request_id for r in done] == ["r0", "r2"]


def _run_both(cfg, reqs, aborts):
    ref_done, ref_batches, _ = _stepwise(cfg, reqs, aborts)
    ff_done, ff_batches, _ = _fast_forward(cfg, reqs, aborts)
    return summary(ref_done), summary(ff_done), ref_batches, ff_batches


def test_abort_of_the_blocked_head_lets_the_next_in_at_the_next_pass_as_stepping_does():
    """Dropping the waiting head frees no block, yet the request behind it may now fit: a decode run that was
    steady must be re-planned at the next pass, or the fast-forward admits it passes late (found by hypothesis)."""
    cfg = EngineConfig(num_gpu_blocks=5, block_size=8, max_num_seqs=2, max_num_batched_tokens=32)
    reqs = [Request(request_id="long", token_ids=list(range(100, 108)), max_tokens=5, arrival_ns=0),
            Request(request_id="head", token_ids=list(range(200, 224)), max_tokens=2, arrival_ns=0),
            *(Request(request_id=f"s{i}", token_ids=[300 + i], max_tokens=1, arrival_ns=0) for i in range(3))]
    # "head" is preempted by the decode of "long" and waits at the queue's head; it is aborted mid-pass
    aborts = [(23 * MS, "head")]
    ref, ff, ref_batches, ff_batches = _run_both(cfg, reqs, aborts)
    assert ff == ref and ff_batches == ref_batches
    assert ff["s0"][1] < ff["long"][3]  # the first short one got in while "long" still decoded


def test_a_request_aborted_during_its_last_pass_is_freed_in_its_place_among_the_pass_completions():
    """Both drivers free the blocks of a pass's finished requests in batch order, aborted or not, so the LRU
    victim chosen afterwards is the same (fast-forward used to free the aborted one last)."""
    cfg = EngineConfig(num_gpu_blocks=3, block_size=1, max_num_seqs=2, max_num_batched_tokens=2)
    reqs = [Request(request_id=f"r{i}", token_ids=[1000 + 100 * i], max_tokens=1, arrival_ns=0) for i in range(4)]
    ref, ff, ref_batches, ff_batches = _run_both(cfg, reqs, [(1 * MS, "r0")])
    assert ff_batches == ref_batches
    removed = [e.block_hashes for b in ff_batches for e in b.events if type(e).__name__ == "BlockRemoved"]
    assert removed and removed[0] == [ff_batches[0].events[0].block_hashes[0]]  # r0's block, the oldest, goes first
    assert "r0" not in ff and {"r1", "r2", "r3"} <= ff.keys()

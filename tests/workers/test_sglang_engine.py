"""SGLang flavour of the mock engine: prefill-only or decode-only passes, ratio-reserved admission, chunking,
radix page cache with LRU tail eviction, retraction (expected times measured with ai-dynamo-runtime 1.6.1's
replay; tests/reference/test_engines.py checks the same cases against the binding)."""

from __future__ import annotations

import pytest
from tests.engine_runs import run_to_end

from kvemu.errors import InvalidArgument
from kvemu.kv_events import BlockRemoved, BlockStored
from workers.admission import RequestRejected
from workers.config import EngineConfig, SglangConfig
from workers.request import Request
from workers.sglang.engine import SglangEngineCore
from workers.hash_id_prompt import HashIdTokens
from workers.mock_worker import MockWorker, engine_core

MS = 1_000_000
SG = EngineConfig(backend="sglang")


def req(rid: str, prompt: int, out: int, at_ms: float = 0, ids: list[int] | None = None) -> Request:
    """A trace-style prompt: each hash id stands for 512 equal tokens."""
    hash_ids = ids if ids is not None else [hash(rid) % 100_000 * 100 + i for i in range(-(-prompt // 512))]
    return Request(request_id=rid, token_ids=HashIdTokens(hash_ids, prompt), max_tokens=out, arrival_ns=round(at_ms * MS))


def run(reqs: list[Request], cfg: EngineConfig = SG) -> tuple[SglangEngineCore, dict]:
    eng = SglangEngineCore(cfg)
    done = run_to_end(eng, reqs)
    assert eng.num_unfinished == 0
    return eng, done


def ms(ns: int | None) -> float:
    assert ns is not None
    return round(ns / MS, 6)


def gaps(rec) -> list[float]:
    return [ms(b - a) for a, b in zip(rec.token_times_ns, rec.token_times_ns[1:])]


def test_defaults_are_the_references():
    assert SG.block_size == 1 and SG.capacity_tokens == 16384
    assert SG.sglang == SglangConfig(schedule_policy="fifo", max_prefill_tokens=16384, chunked_prefill_size=8192,
                                     clip_max_new_tokens=4096, schedule_conservativeness=1.0)
    assert isinstance(engine_core(SG), SglangEngineCore)
    assert all(isinstance(c, SglangEngineCore) for c in MockWorker(EngineConfig(backend="sglang", dp_size=2)).cores)


@pytest.mark.parametrize("kwargs, field", [
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill"),
    ({"block_size": 16, "sglang": SglangConfig(chunked_prefill_size=1000)}, "sglang.chunked_prefill_size"),
])
def test_settings_sglang_cannot_run_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(backend="sglang", **kwargs)
    assert err.value.field == field


def test_a_lone_request_prefills_then_decodes_against_the_16k_pool():
    _, done = run([req("a", 1000, 5)])
    a = done["a"]
    assert ms(a.first_token_ns) == 32.105859  # prefill(1000)
    assert gaps(a) == [8.943724, 8.946829, 8.949933, 8.953037]  # decode(1001 .. 1004) over a 16,384-token pool
    assert ms(a.completion_ns) == 67.899382


def test_an_extend_pass_gives_running_requests_nothing():
    _, done = run([req("a", 1000, 20), req("b", 2000, 3, at_ms=50)])
    a, b = done["a"], done["b"]
    assert ms(b.engine.admitted_ns) == 58.946345 and ms(b.first_token_ns) == 107.498641  # b's prefill alone: 48.552296
    assert 63.332425 in gaps(a)  # a waits through it: 48.552296 + the next decode pass of both
    assert ms(a.completion_ns) == 262.776114 and ms(b.completion_ns) == 137.064339


def test_a_batch_of_prompts_is_timed_on_floored_means():
    _, done = run([req("a", 1000, 3), req("b", 1001, 3)])
    assert ms(done["a"].first_token_ns) == ms(done["b"].first_token_ns) == 48.552296  # prefill(2000), not 2001


def test_a_cached_prompt_recomputes_one_token():
    _, done = run([req("a", 1024, 1, ids=[1, 2]), req("b", 1024, 1, at_ms=1000, ids=[1, 2])])
    assert done["b"].engine.reused_tokens == 1023
    assert ms(done["b"].first_token_ns - done["b"].arrival_ns) == 16.516604  # prefill(1)


def test_a_prompt_beyond_the_chunk_budget_is_chunked():
    cfg = EngineConfig(backend="sglang", sglang=SglangConfig(chunked_prefill_size=1000))
    _, done = run([req("a", 600, 2), req("b", 600, 2)], cfg)
    assert ms(done["a"].first_token_ns) == 32.105859  # a and the first 400 tokens of b
    assert ms(done["b"].first_token_ns) == 51.660807  # b's other 200 in the next pass


def test_admission_waits_until_the_decaying_ratio_leaves_room():
    # b (8,000 + 10 reserved) fits only once 16,384 - a's context - a's remaining output x ratio exceeds it
    _, done = run([req("a", 6000, 4000), req("b", 8000, 10, at_ms=100)])
    assert ms(done["b"].engine.admitted_ns) == pytest.approx(2764.003701, abs=1e-3)


def test_a_cached_prefix_nobody_holds_is_not_charged_twice_at_admission():
    # c's first 1,000 tokens are a's, cached and held by nobody: the pool's free + evictable pages already count
    # them, so locking them costs c's budget nothing more (the reference's check: charged + reserved output <
    # free + evictable - running outputs x ratio). Charged once more, c (500 new + 20 reserved) would wait ~13 s
    # for b to end; the reference admits it at its arrival (tests/reference/test_engines.py, same case).
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=2900)
    _, done = run([req("a", 1000, 1, 0, [1, 2]), req("b", 1200, 500, 100, [3, 4, 5]),
                   req("c", 1500, 20, 200, [1, 2, 6])], cfg)
    c = done["c"]
    assert c.engine.reused_tokens == 1000
    assert ms(c.engine.admitted_ns) == 206.440337  # at the end of b's decode pass in flight when it arrives
    assert ms(c.first_token_ns) == pytest.approx(200 + 30.638727, abs=1e-3)
    assert ms(c.completion_ns) == pytest.approx(200 + 672.065969, abs=1e-3)
    assert ms(done["b"].completion_ns) == pytest.approx(100 + 13345.227343, abs=1e-3)


def test_a_retracted_request_reports_the_most_any_admission_found_cached():
    # c finds a's 1,000 tokens; retracted at 5.03 s, it is re-admitted at 5.22 s finding 1,647 (its whole sequence
    # but the last token) though only its prompt's last page is left: its first token's slot waits for its next
    # decode pass, which retracts it again; b's growth then evicts all of c's tokens but 800 of a's. The reference
    # admits it at the same three moments finding the same (1,000, 1,647, 800) and reports the largest
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=3000)
    _, done = run([req("a", 1000, 1, 0, [1, 2]), req("b", 1200, 1000, 100, [3, 4, 5]),
                   req("c", 1500, 300, 200, [1, 2, 6])], cfg)
    c = done["c"]
    assert c.engine.preemptions == 2 and c.engine.cached_tokens == 1000
    assert c.engine.reused_tokens == 1647
    assert ms(done["b"].completion_ns) == pytest.approx(100 + 29322.247342, abs=1e-3)  # the reference's to 1 us


def test_retraction_takes_the_request_with_fewest_tokens_and_keeps_its_cache():
    _, done = run([req("a", 6000, 3000), req("b", 6000, 3000, at_ms=10)])
    a, b = done["a"], done["b"]
    assert b.engine.preemptions == 1 and a.engine.preemptions == 0
    assert b.output_tokens == 3000 and a.output_tokens == 3000
    # re-admitted when a ends; what a's growth did not evict of b's tokens is reused
    assert b.engine.reused_tokens == 7384
    assert ms(b.completion_ns) == pytest.approx(118191.774627 + 10, abs=1e-3)


def test_lru_evicts_exactly_the_tokens_needed_from_the_coldest_leaf():
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=3000)
    rows = [("a", 1000, [1, 2], 0), ("b", 1000, [3, 4], 100), ("a2", 1000, [1, 2], 200), ("c", 1500, [5, 6, 7], 300),
            ("b2", 1000, [3, 4], 400), ("a3", 1000, [1, 2], 500)]
    eng, done = run([req(r, n, 1, t, ids) for r, n, ids, t in rows], cfg)
    assert done["a2"].engine.reused_tokens == 999
    assert done["b2"].engine.reused_tokens == 500  # c took 500 of b's tokens, from its tail
    assert done["a3"].engine.reused_tokens == 500  # b2 refilled its tail at a's expense


def test_a_request_that_cannot_fit_keeps_its_cached_prefix_warm():
    # e (13.5 s) shares 3,584 tokens with a, finished and cached, but cannot have its own pages once that prefix is
    # locked until c ends at 16.0 s. Every pass it tries, it looks its prefix up, as the reference does, so a's
    # leaf is the most recently used and the decode passes evict b's finished tokens: e finds the 2,999 of a's
    # tokens left when it arrived (2,837 if the lookups touched nothing). Times are the reference's to 1 us
    _, done = run([req("a", 6207, 269, 0, list(range(1, 14))),
                   req("b", 3906, 320, 2000, [20, 21, 22, 23, 24, 25, 26, 27]),
                   req("c", 7638, 260, 7000, [20, 21, 22, 23, *range(30, 41)]),
                   req("d", 3254, 440, 9000, list(range(50, 57))),
                   req("e", 5856, 395, 13500, [*range(1, 8), *range(60, 65)])])
    e = done["e"]
    assert e.engine.reused_tokens == 2999
    assert ms(e.first_token_ns) == pytest.approx(13500 + 2559.501064, abs=1e-3)
    assert ms(e.completion_ns) == pytest.approx(13500 + 12742.895592, abs=1e-3)
    assert ms(done["d"].completion_ns) == pytest.approx(9000 + 13409.371541, abs=1e-3)


def test_lpm_admits_the_longest_cached_prefix_first():
    cfg = EngineConfig(backend="sglang", max_num_seqs=1, sglang=SglangConfig(schedule_policy="lpm"))
    reqs = [req("a", 1024, 1, 0, [1, 2]), req("b", 500, 50, 100, [50]), req("c", 600, 1, 200, [60, 61]),
            req("d", 1500, 1, 300, [1, 2, 3])]
    _, lpm = run(reqs, cfg)
    _, fifo = run(reqs, EngineConfig(backend="sglang", max_num_seqs=1))
    assert lpm["d"].engine.admitted_ns < lpm["c"].engine.admitted_ns
    assert ms(lpm["d"].engine.admitted_ns) == pytest.approx(488.965, abs=1e-3)
    assert fifo["c"].engine.admitted_ns < fifo["d"].engine.admitted_ns


@pytest.mark.parametrize("interval, admitted_ms", [(0, 32.105859), (1, 41.049583), (3, 58.946345)])
def test_prefill_decode_interval_holds_back_the_next_extend(interval, admitted_ms):
    cfg = EngineConfig(backend="sglang", sglang=SglangConfig(prefill_decode_interval=interval))
    _, done = run([req("a", 1000, 20), req("b", 2000, 3, 1), req("c", 500, 3, 2)], cfg)
    assert ms(done["b"].engine.admitted_ns) == ms(done["c"].engine.admitted_ns) == admitted_ms


def test_where_the_reference_hangs_every_request_still_ends():
    # the reference loops forever: b's first 8,192-token chunk holds pages while a grows into the last of them
    _, done = run([req("a", 4000, 5000), req("b", 12000, 100, at_ms=200)])
    assert done["a"].output_tokens == 5000 and done["b"].output_tokens == 100
    # the reference errs (prompt + reserved output never fit an empty pool) or hangs (it decodes past the pool):
    # SGLang clips the output to what fits (the pool less one page)
    _, done = run([req("c", 16000, 384), req("d", 9000, 7385, at_ms=1)])
    assert done["c"].output_tokens == 16383 - 16000 and done["d"].output_tokens == 16383 - 9000


def test_a_prompt_that_leaves_no_room_is_refused_at_arrival():
    eng = SglangEngineCore(SG)
    with pytest.raises(RequestRejected) as err:
        eng.add_request(req("a", 16383, 1))
    assert err.value.field == "token_ids" and "16383" in str(err.value)
    assert eng.num_unfinished == 0


def test_disaggregated_legs_are_refused():
    eng = SglangEngineCore(SG)
    with pytest.raises(RequestRejected) as err:
        eng.add_request(Request(request_id="a", token_ids=[1, 2, 3], max_tokens=1, kv_hold=True))
    assert err.value.field == "backend" and eng.num_unfinished == 0


def test_abort_mid_pass_frees_what_the_request_held():
    eng = SglangEngineCore(SG)
    eng.add_request(req("a", 3000, 50))
    eng.add_request(req("b", 2000, 50))
    eng.advance_to(MS)  # the extend pass of both is in flight
    rec = eng.abort("a", "client_gone")
    assert rec is not None and rec.failure == "client_gone"
    while (t := eng.next_event_ns()) is not None:
        out = eng.advance_to(t)
        assert "a" not in [r.request_id for r in out.completed]
        eng.check_invariants()
    assert eng.cache.owned == 0 and eng.cache.locked == 0  # nothing is held once everything ended


def test_kv_events_name_one_page_per_block_as_the_cache_changes():
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=1500)
    eng = SglangEngineCore(cfg)
    eng.add_request(req("a", 1000, 1, 0, [1, 2]))
    eng.add_request(req("b", 1000, 1, 100, [3, 4]))
    stored: set[int] = set()
    removed: list[int] = []
    while (t := eng.next_event_ns()) is not None:
        for batch in eng.advance_to(t).kv_batches:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    assert ev.block_size == 1 and len(ev.token_ids) == len(ev.block_hashes)
                    stored.update(ev.block_hashes)
                else:
                    assert isinstance(ev, BlockRemoved)
                    removed += ev.block_hashes
    assert len(stored) == 2000  # both prompts, a page (token) each
    assert len(removed) == 500  # b needed 500 of a's pages, its least recent tail
    assert stored - set(removed) == eng.cache.cached_hashes()


def test_reset_prefix_cache_drops_every_page_once_nothing_runs():
    eng = SglangEngineCore(SG)
    eng.add_request(req("a", 1000, 3))
    eng.advance_to(MS)  # a's prefill is in flight
    assert eng.reset_prefix_cache(MS) is None
    while (t := eng.next_event_ns()) is not None:
        eng.advance_to(t)
    assert eng.cache.size == 1003  # a's prompt and a slot for each of its 3 output tokens, as the reference keeps
    events = eng.reset_prefix_cache(eng.now_ns)
    assert events is not None and [type(e).__name__ for e in events.batch().events] == ["AllBlocksCleared"]
    assert eng.cache.size == 0 and eng.cache.cached_hashes() == set()
    eng.add_request(req("b", 1000, 1, at_ms=eng.now_ns / MS + 1, ids=None))
    while (t := eng.next_event_ns()) is not None:
        eng.advance_to(t)
    eng.check_invariants()


def test_with_no_output_reserve_the_first_token_slots_still_fit_the_pool():
    """clip_max_new_tokens 0 reserves nothing for outputs: admission must still leave each finished prompt
    the page of its first token (found by the fast-forward property: the pool went one page over)."""
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=33, max_num_seqs=4, max_num_batched_tokens=4,
                       sglang=SglangConfig(max_prefill_tokens=2, chunked_prefill_size=2, clip_max_new_tokens=0))
    specs = [([1000, 1001, 1002], 2, 6), ([1100], 2, 6), ([1200], 15, 3), ([2, 2, 1300, 1301], 9, 0), ([1400], 16, 0),
             ([1500], 1, 0), ([1600], 9, 0)]
    eng = SglangEngineCore(cfg)
    for i, (tokens, out, at_ms) in enumerate(specs):
        eng.add_request(Request(request_id=f"r{i}", token_ids=tokens, max_tokens=out, arrival_ns=at_ms * MS))
    done = 0
    while (s := eng.next_pass_start_ns()) is not None:
        done += len(eng.step(s).completed)
        eng.check_invariants()  # the pool never goes over
    assert done == len(specs)


def test_a_retracted_request_queues_behind_a_half_prefilled_prompt():
    """A retracted request that cannot fit while a half-prefilled prompt holds pages must not stand in front of
    it (that idle rank would admit nobody, ever: found by the fast-forward property)."""
    cfg = EngineConfig(backend="sglang", num_gpu_blocks=6, max_num_seqs=3, max_num_batched_tokens=3,
                       sglang=SglangConfig(max_prefill_tokens=1, chunked_prefill_size=1, schedule_conservativeness=0.3))
    eng = SglangEngineCore(cfg)
    for rid, tokens, out in (("r0", [1000], 4), ("r1", [1100], 2), ("r2", [1200, 1201], 1)):
        eng.add_request(Request(request_id=rid, token_ids=tokens, max_tokens=out, arrival_ns=0))
    done, retracted = [], []
    while (s := eng.next_pass_start_ns()) is not None:
        res = eng.step(s)
        assert not res.idle, eng
        done += [r.request_id for r in res.completed]
        retracted += res.preempted
        eng.check_invariants()
    assert retracted == ["r0"] and sorted(done) == ["r0", "r1", "r2"]

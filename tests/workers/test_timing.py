"""Timing model: polynomial values, speedup scaling, integer nanoseconds, mixed passes, pluggable models."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.request import Request
from workers import timing
from workers.timing import PassTimer, PolynomialTiming


def test_prefill_polynomial_values():
    m = PolynomialTiming()
    assert m.prefill_ms(0) == 0.0
    assert m.prefill_ms(1000) == pytest.approx(4.209989e-07 * 1e6 + 15.18344 + 16.50142)
    assert m.prefill_ms(8192) == pytest.approx(4.209989e-07 * 8192**2 + 1.518344e-02 * 8192 + 16.50142)
    assert m.prefill_ms(1) == pytest.approx(16.51660, abs=1e-4)


def test_decode_polynomial_values_and_floor():
    m = PolynomialTiming()
    assert m.decode_ms(0, 1000) == pytest.approx(5.74)
    assert m.decode_ms(500, 1000) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert m.decode_ms(1000, 1000) == pytest.approx(-25.74 + 54.01 + 5.74)
    # shared prefixes count once per request, so KV can exceed the pool: p is capped at 1 (as the reference's
    # replay does: tests/reference/test_engines.py, "active prefix discount")
    assert m.decode_ms(3000, 1000) == pytest.approx(-25.74 + 54.01 + 5.74)


def test_pass_timer_uses_decode_kv_tokens_and_rounds_to_ns():
    cfg = EngineConfig(num_gpu_blocks=100, block_size=16)
    t = PassTimer(cfg)
    assert t.decode_ns(800) == round((-25.74 * 0.25 + 54.01 * 0.5 + 5.74) * 1e6)  # 800 of 1600 KV tokens
    assert t.prefill_ns(100) == round(PolynomialTiming().prefill_ms(100) * 1e6)
    assert isinstance(t.pass_ns(100, 3, 800), int)
    # a mixed pass lasts prefill time + decode time
    assert t.pass_ns(100, 3, 800) == t.prefill_ns(100) + t.decode_ns(800)
    assert t.pass_ns(0, 3, 800) == t.decode_ns(800)
    assert t.pass_ns(100, 0, 800) == t.prefill_ns(100)
    assert t.pass_ns(0, 0, 800) == 0


def test_speedup_ratios_divide_durations():
    base = PassTimer(EngineConfig(num_gpu_blocks=100, block_size=16))
    fast = PassTimer(EngineConfig(num_gpu_blocks=100, block_size=16, speedup_ratio=2.0, decode_speedup_ratio=4.0))
    assert fast.prefill_ns(1000) == round(PolynomialTiming().prefill_ms(1000) * 1e6 / 2)
    # decode is divided by speedup_ratio * decode_speedup_ratio (the reference's effective ratio)
    assert fast.decode_ns(160) == round(PolynomialTiming().decode_ms(160, 1600) * 1e6 / 8)
    assert base.decode_ns(160) == round(PolynomialTiming().decode_ms(160, 1600) * 1e6)


@pytest.mark.parametrize(("speedup", "decode_speedup"), [(0, 1), (0, 0), (1, 0)])
def test_zero_ratio_means_no_delay_for_the_parts_it_scales(speedup, decode_speedup):
    t = PassTimer(EngineConfig(speedup_ratio=speedup, decode_speedup_ratio=decode_speedup))
    assert t.decode_ns(100) == 0
    assert t.prefill_ns(5000) == (0 if speedup == 0 else round(PolynomialTiming().prefill_ms(5000) * 1e6))


def test_engine_first_token_after_prefill_time_and_decode_steps():
    cfg = EngineConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=256)
    eng = VllmEngineCore(cfg)
    rec = eng.add_request(Request(request_id="a", token_ids=list(range(10)), max_tokens=3, arrival_ns=1000))
    timer = PassTimer(cfg)
    r1 = eng.step(1000)
    assert r1.prefill_tokens == 10 and r1.decodes == 0
    assert r1.end_ns == 1000 + timer.prefill_ns(10)
    assert rec.first_token_ns == r1.end_ns and rec.engine.cached_tokens == 0
    r2 = eng.step(r1.end_ns)
    # the decode pass computes the KV of its 11th token: 10 prompt + 1 output tokens (not 3 blocks x 4)
    assert r2.decodes == 1 and r2.duration_ns == timer.decode_ns(11)
    r3 = eng.step(r2.end_ns)
    assert rec.token_times_ns == [r1.end_ns, r2.end_ns, r3.end_ns] and rec.completion_ns == r3.end_ns


def test_mixed_pass_duration_is_prefill_plus_decode():
    cfg = EngineConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=256)
    eng = VllmEngineCore(cfg)
    eng.add_request(Request(request_id="a", token_ids=list(range(10)), max_tokens=5, arrival_ns=0))
    first = eng.step(0)
    eng.add_request(Request(request_id="b", token_ids=list(range(100, 120)), max_tokens=2, arrival_ns=first.end_ns))
    mixed = eng.step(first.end_ns)
    assert mixed.prefill_tokens == 20 and mixed.decodes == 1
    timer = PassTimer(cfg)
    # the decode part counts the decoding request's 11 KV tokens, not the prompt being prefilled
    assert mixed.duration_ns == timer.prefill_ns(20) + timer.decode_ns(11)


def test_decode_time_counts_every_request_context_even_over_a_shared_prefix():
    # as the reference mocker: two requests sharing a cached prefix decode as slowly as two disjoint ones
    cfg = EngineConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=256)
    durations = []
    for second in (list(range(8)) + [50, 51], list(range(100, 110))):  # shares 2 blocks with "a", or nothing
        eng = VllmEngineCore(cfg)
        eng.add_request(Request(request_id="a", token_ids=list(range(10)), max_tokens=9, arrival_ns=0))
        first = eng.step(0)
        rec = eng.add_request(Request(request_id="b", token_ids=second, max_tokens=9, arrival_ns=first.end_ns))
        mixed = eng.step(first.end_ns)  # a decodes, b prefills
        both = eng.step(mixed.end_ns)
        assert both.decodes == 2 and both.prefill_tokens == 0
        assert rec.engine.cached_tokens == (8 if second[0] == 0 else 0)
        durations.append(both.duration_ns)
    assert durations[0] == durations[1] == PassTimer(cfg).decode_ns(12 + 11)


class Flat:
    """A custom timing model: 2 ms per prefill pass, 1 ms per decode pass."""

    def prefill_ms(self, new_tokens: int) -> float:
        return 2.0 if new_tokens else 0.0

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int) -> float:
        return 1.0


def test_timing_model_is_pluggable():
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4), timing=Flat())
    rec = eng.add_request(Request(request_id="a", token_ids=[1, 2, 3], max_tokens=4, arrival_ns=0))
    eng.advance_to(10**9)
    assert rec.token_times_ns == [2_000_000, 3_000_000, 4_000_000, 5_000_000]


class Broken:
    def prefill_ms(self, new_tokens: int) -> float:
        return -1.0

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int) -> float:
        return float("nan")


def test_timing_model_results_are_validated():
    t = PassTimer(EngineConfig(), Broken())
    with pytest.raises(InvalidArgument, match="prefill_ms must return a finite number >= 0"):
        t.prefill_ns(10)
    with pytest.raises(InvalidArgument, match="decode_ms must return a finite number >= 0"):
        t.decode_ns(10)


@given(first=st.integers(0, 2_000_000), step=st.integers(0, 64), count=st.integers(0, 70),
       speedup=st.sampled_from([1.0, 2.0, 3.7]), decode_speedup=st.sampled_from([1.0, 2.5]),
       slowdown=st.sampled_from([1.0, 1.5, 4.0]))
def test_a_decode_series_equals_its_passes_one_by_one(first, step, count, speedup, decode_speedup, slowdown):
    """Fast-forward's run of decode durations (fused for the polynomial, generic for any model) is exactly
    the per-pass ``decode_ns`` stepping uses, slowdowns included."""
    cfg = EngineConfig(num_gpu_blocks=1000, block_size=16, speedup_ratio=speedup, decode_speedup_ratio=decode_speedup)

    poly = PolynomialTiming()

    class Generic:  # no series methods: the per-pass fallback (delegating: a compiled class lends no methods)
        def prefill_ms(self, new_tokens: int) -> float:
            return poly.prefill_ms(new_tokens)

        def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int) -> float:
            return poly.decode_ms(active_kv_tokens, total_kv_tokens)

    for model in (PolynomialTiming(), Generic()):
        t = PassTimer(cfg, model)  # type: ignore[arg-type]
        t.set_slowdown(slowdown)
        assert t.decode_series_ns(first, step, count) == [t.decode_ns(first + i * step) for i in range(count)]


@given(calls=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30), st.sampled_from([1, 2, 3, 4, 0])), max_size=30),
       slow_at=st.integers(0, 30))
def test_the_kept_decode_run_returns_what_a_fresh_computation_would(calls, slow_at):
    """Slices of the kept run, continuations of it and fresh runs all equal the per-pass durations,
    also across a slowdown (which drops the kept run)."""
    t = PassTimer(EngineConfig(num_gpu_blocks=1000, block_size=16, speedup_ratio=1.5))
    base = 50_000
    for n, (offset, count, step) in enumerate(calls):
        if n == slow_at:
            t.set_slowdown(2.0)
        first = base + offset * max(step, 1)
        assert t.decode_series_ns(first, step, count) == [t.decode_ns(first + i * step) for i in range(count)]


@given(first=st.integers(0, 600), step=st.integers(0, 9), count=st.integers(0, 40), total=st.sampled_from([512, 1000]),
       scale=st.sampled_from([1_000_000 / 1.7, 1_000_000.0, 1_000_000 / 0.3]))
def test_decode_series_read_across_table_chunks_are_the_polynomials_values(first, step, count, total, scale):
    """Series within one chunk of the shared duration table, across several, or past a full memo are all
    the polynomial's own values, bit for bit."""
    model = PolynomialTiming()
    want = [round(model.decode_ms(first + i * step, total) * scale) for i in range(count)]
    saved = timing._CHUNK, timing._CHUNKS_KEPT
    timing._CHUNK, timing._CHUNKS_KEPT = 16, 8  # series cross chunks, and the memo fills and starts afresh
    timing._DECODE_TABLES.clear()  # (not the 4,096-size chunks an earlier test on this worker left)
    try:
        assert model.decode_ns_series(first, step, count, total, scale) == want
        assert all(len(t) <= 8 for t in timing._DECODE_TABLES.values())
    finally:
        timing._CHUNK, timing._CHUNKS_KEPT = saved
        timing._DECODE_TABLES.clear()


@given(calls=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30), st.sampled_from([1, 2, 3, 4, 0]),
                                st.booleans()), max_size=30),
       slow_at=st.integers(0, 30), run_max=st.sampled_from([8, 64, 1 << 14]))
def test_prefix_sums_of_the_kept_run_time_any_stretch_of_passes(calls, slow_at, run_max):
    """``decode_prefix_ns`` interleaved with ``decode_series_ns``: the sums over any k leading passes are those of
    the per-pass durations, whether the kept run was reused, extended, capped (``_RUN_MAX``) or dropped."""
    kept = timing._RUN_MAX
    timing._RUN_MAX = run_max
    try:
        t = PassTimer(EngineConfig(num_gpu_blocks=1000, block_size=16, speedup_ratio=1.5))
        base = 50_000
        for n, (offset, count, step, prefix) in enumerate(calls):
            if n == slow_at:
                t.set_slowdown(2.0)
            first = base + offset * max(step, 1)
            passes = [t.decode_ns(first + k * step) for k in range(count)]
            if prefix:
                sums, i = t.decode_prefix_ns(first, step, count)
                assert [sums[i + k] - sums[i] for k in range(count + 1)] == [sum(passes[:k]) for k in range(count + 1)]
            else:
                assert t.decode_series_ns(first, step, count) == passes
    finally:
        timing._RUN_MAX = kept


@given(x=st.one_of(st.floats(-1e18, 1e18), st.integers(-10**9, 10**9).map(lambda n: n / 2),
                   st.integers(0, 1 << 60).map(float)))
def test_round_half_even_is_pythons_round(x):
    """The tabulated durations round without calling ``round``: same integer, ties to even, at every magnitude."""
    assert timing._round_half_even(x) == round(x)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_round_half_even_refuses_what_round_refuses(bad):
    with pytest.raises((OverflowError, ValueError)) as theirs:
        round(bad)
    with pytest.raises(theirs.type):
        timing._round_half_even(bad)


@given(lo=st.integers(0, 3000), n=st.integers(0, 300), total=st.sampled_from([7, 512, 1000, (1 << 53) + 1]),
       scale=st.sampled_from([1_000_000 / 1.7, 1_000_000.0, 1_000_000 / 0.3]))
def test_a_tabulated_chunk_is_the_polynomial_rounded(lo, n, total, scale):
    model = PolynomialTiming()
    want = [round(model.decode_ms(a, total) * scale) for a in range(lo, lo + n)]
    assert timing._decode_ns(range(lo, lo + n), total, scale) == want

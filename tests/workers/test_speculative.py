"""Speculative decoding: the draws (Dynamo's conditional burst sampling), its config, and what an engine makes of it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from kvemu.kv_events import BlockStored
from workers.config import DEFAULT_ACCEPTANCE_RATES, EngineConfig, SpeculativeConfig
from workers.request import Request
from workers.sglang.engine import SglangEngineCore
from workers.speculative import DraftSampler
from workers.vllm.engine import VllmEngineCore

from tests.engine_runs import run_to_end, steps


def spec(k: int = 3, rates: list[float] | float | None = None, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method=kw.pop("method", "mtp"), num_speculative_tokens=k, acceptance_rates=rates, **kw)


# ---------------------------------------------------------------------------------------------- config


def test_rates_default_to_dynamos_cut_or_padded_to_k():
    assert spec(2).conditional_rates == list(DEFAULT_ACCEPTANCE_RATES[:2]) == [0.85, 0.3]
    assert spec(7).conditional_rates == [0.85, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert spec(3, 0.5).conditional_rates == [0.5, 0.5, 0.5]
    assert spec(3, [1.0, 0.5]).conditional_rates == [1.0, 0.5, 0.0]
    assert spec(3, [0.5, 0.5, 0.5]).mean_tokens_per_pass == pytest.approx(1 + 0.5 + 0.25 + 0.125)


@pytest.mark.parametrize("build, field", [
    (lambda: spec(2, [0.5, 0.5, 0.5]), "speculative.acceptance_rates"),
    (lambda: spec(2, method="ngram", draft_cost=0.1), "speculative.draft_cost"),
    (lambda: spec(0), "num_speculative_tokens"),
    (lambda: spec(17), "num_speculative_tokens"),
    (lambda: spec(2, 1.5), "acceptance_rates"),
    (lambda: spec(2, [0.5, -0.1]), "acceptance_rates"),
    (lambda: EngineConfig(decode_speedup_ratio=2.0, speculative=spec()), "speculative"),
])
def test_bad_configs_are_refused_naming_the_field(build, field):
    with pytest.raises((InvalidArgument, msgspec.ValidationError)) as exc:
        build()
    assert field in str(exc.value) or getattr(exc.value, "field", None) == field


def test_a_scenario_style_dict_decodes_with_its_bounds_checked():
    cfg = msgspec.convert({"speculative": {"method": "eagle", "num_speculative_tokens": 2, "acceptance_rates": [0.7]}},
                          EngineConfig)
    assert cfg.speculative is not None and cfg.speculative.conditional_rates == [0.7, 0.0]
    with pytest.raises(msgspec.ValidationError, match="speculative"):
        msgspec.convert({"speculative": {"method": "medusa", "num_speculative_tokens": 2}}, EngineConfig)


# ---------------------------------------------------------------------------------------------- draws


def test_each_position_counts_only_after_every_earlier_one_was_accepted():
    s = DraftSampler(spec(3, [0.8, 0.5, 0.25]), 0, 0)
    n = 40_000
    draws = [s.next() for _ in range(n)]
    assert set(draws) <= {1, 2, 3, 4}
    mean = sum(draws) / n
    assert mean == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25, abs=0.02)
    # P(position 3 accepted) = 0.8 * 0.5 * 0.25, not 0.25
    assert draws.count(4) / n == pytest.approx(0.1, abs=0.01)
    assert s.drafts == n and s.draft_tokens == 3 * n and s.accepted == sum(draws) - n
    assert s.accepted_per_pos == [sum(d > i + 1 for d in draws) for i in range(3)]


def test_certain_and_impossible_acceptance():
    assert {DraftSampler(spec(4, 1.0), 0, 0).next() for _ in range(50)} == {5}
    assert {DraftSampler(spec(4, 0.0), 0, 0).next() for _ in range(50)} == {1}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40), st.integers(0, 5))
def test_peeking_ahead_never_changes_the_stream(ops, seed):
    # a rank's look-ahead reads draws it has not used: what it uses later is what it would have used anyway
    cfg = spec(3, [0.7, 0.5, 0.5], seed=seed)
    plain, peeking = DraftSampler(cfg, 1, 2), DraftSampler(cfg, 1, 2)
    used_plain, used_peeking = [], []
    for peek, n in ops:
        if peek:
            ahead = [peeking.peek(i) for i in range(n)]
            assert ahead == [peeking.peek(i) for i in range(n)]  # reading is repeatable
        else:
            used_plain += [plain.next() for _ in range(n)]
            used_peeking += [peeking.peek(i) for i in range(n)]
            peeking.take(n)
    assert used_plain == used_peeking
    assert (plain.accepted, plain.accepted_per_pos) == (peeking.accepted, peeking.accepted_per_pos)


def test_a_stream_is_the_seeds_the_workers_and_the_ranks_own():
    cfg = spec(3, 0.5)

    def stream(c, w, r):
        s = DraftSampler(c, w, r)
        return [s.next() for _ in range(64)]

    assert stream(cfg, 0, 0) == stream(cfg, 0, 0)
    assert len({tuple(stream(cfg, w, r)) for w in range(3) for r in range(3)}) == 9
    assert stream(cfg, 0, 0) != stream(msgspec.structs.replace(cfg, seed=43), 0, 0)


# ---------------------------------------------------------------------------------------------- engine


def engine(k: int = 3, rates: list[float] | float | None = 1.0, **kw) -> VllmEngineCore:
    return VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4, speculative=spec(k, rates), **kw))


def test_a_pass_emits_one_plus_the_accepted_drafts_and_the_last_burst_is_cut_at_max_tokens():
    eng = engine(3, 1.0)
    rec = run_to_end(eng, [Request(request_id="a", token_ids=list(range(10)), max_tokens=10)])["a"]
    times = rec.token_times_ns
    # the prefill pass gives the first token alone (no drafts yet), then bursts of 4, the last cut to 1
    groups = [times.count(t) for t in sorted(set(times))]
    assert groups == [1, 4, 4, 1] and rec.output_tokens == 10 and rec.completion_ns == times[-1]
    assert eng.passes == 4
    assert eng.spec is not None and eng.spec.accepted == 9  # counted before the cut, as vLLM counts


def test_kv_grows_by_what_was_emitted_and_bursts_fill_blocks():
    eng = engine(3, 1.0)
    seq_states = []
    stored = []
    for res in steps(eng, [Request(request_id="a", token_ids=list(range(10)), max_tokens=12)]):
        seq = eng._seqs.get("a")
        if seq is not None:
            seq_states.append((seq.computed, seq.n_out))
        if res.events is not None:
            stored += [h for ev in res.kv_batch.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    # the newest token has no KV yet: computed = prompt + output - 1 after every pass
    assert all(c == 10 + n - 1 for c, n in seq_states) and [n for _, n in seq_states] == [1, 5, 9]
    # 10 + 11 tokens with KV at the end: 5 full blocks of 4, each stored once, in order
    assert len(stored) == 5 == len(set(stored))


def test_a_decode_pass_prices_the_verified_drafts_and_the_draft_model():
    reqs = [Request(request_id=f"r{i}", token_ids=list(range(8 * i, 8 * i + 8)), max_tokens=6) for i in range(3)]

    def second_pass(eng):
        it = steps(eng, reqs)
        next(it)  # the prefill pass
        res = next(it)  # the first decode pass: three requests, 9 KV tokens each
        return res.end_ns - res.start_ns

    plain = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4))
    base = plain.timer.decode_ns(27, 3)
    assert second_pass(plain) == base
    k3 = engine(3, 0.0)
    assert second_pass(k3) == k3.timer.decode_ns(27 + 3 * 3, 3)  # the 3 drafts per request are attended too
    costly = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4,
                                     speculative=spec(3, 0.0, method="eagle", draft_cost=0.1)))
    assert second_pass(costly) == round(k3.timer.decode_ns(27 + 9, 3) * 1.3)


def test_bursts_make_decoding_take_fewer_passes_at_the_expected_rate():
    reqs = [Request(request_id=f"r{i}", token_ids=list(range(50 * i, 50 * i + 20)), max_tokens=200) for i in range(8)]
    plain = VllmEngineCore(EngineConfig(num_gpu_blocks=2048, block_size=16))
    run_to_end(plain, reqs)
    cfg = spec(3, [0.8, 0.6, 0.4])
    fast = VllmEngineCore(EngineConfig(num_gpu_blocks=2048, block_size=16, speculative=cfg))
    done = run_to_end(fast, reqs)
    assert all(r.output_tokens == 200 for r in done.values())
    # one prefill pass, then 199 tokens at ~mean_tokens_per_pass each
    assert (plain.passes - 1) / (fast.passes - 1) == pytest.approx(cfg.mean_tokens_per_pass, rel=0.1)
    assert fast.spec is not None
    assert 1 + fast.spec.accepted / fast.spec.drafts == pytest.approx(cfg.mean_tokens_per_pass, rel=0.05)


def test_the_sglang_flavour_emits_bursts_and_takes_a_page_per_token():
    eng = SglangEngineCore(EngineConfig(backend="sglang", num_gpu_blocks=256, speculative=spec(2, 1.0)))
    rec = run_to_end(eng, [Request(request_id="a", token_ids=list(range(10)), max_tokens=8)])["a"]
    groups = [rec.token_times_ns.count(t) for t in sorted(set(rec.token_times_ns))]
    assert groups == [1, 3, 3, 1] and rec.output_tokens == 8
    # it let go of the same sequence, cached page by page, as without drafts
    plain = SglangEngineCore(EngineConfig(backend="sglang", num_gpu_blocks=256))
    run_to_end(plain, [Request(request_id="a", token_ids=list(range(10)), max_tokens=8)])
    assert eng.cache.cached_hashes() == plain.cache.cached_hashes() and len(plain.cache.cached_hashes()) == 18


def test_off_by_default():
    eng = VllmEngineCore(EngineConfig())
    assert eng.config.speculative is None and eng.spec is None

"""The engine's side of disaggregated serving: a prefill leg holds its KV until released; a decode leg
reserves room, waits its transfer and decodes without computing its prompt.

Expected times are ai-dynamo-runtime 1.6.1's per-request timestamps (one 4096-token request, 10 output
tokens, one prefill and one decode worker, with and without a link model).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.transfer import KvTransfer, transfer_delay_ns, transfer_tokens
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.request import Request
from workers.timing import PolynomialTiming

MS = 1_000_000
P = PolynomialTiming()
PROMPT = list(range(4096))


def prefill_leg(rid: str = "r", tokens=PROMPT, at: int = 0) -> Request:
    return Request(request_id=rid, token_ids=tokens, max_tokens=1, arrival_ns=at, kv_hold=True)


def decode_leg(rid: str = "r", tokens=PROMPT, out: int = 10, at: int = 0, **link) -> Request:
    return Request(request_id=rid, token_ids=tokens, max_tokens=out, arrival_ns=at,
                   kv_transfer=KvTransfer(source_worker_id=0, **link))


def drain(eng: VllmEngineCore) -> list:
    done = []
    while (t := eng.next_event_ns()) is not None:
        done += eng.advance_to(t).completed
        eng.check_invariants()
    return done


def test_a_prefill_leg_completes_at_its_prefill_and_holds_its_kv_until_released():
    eng = VllmEngineCore(EngineConfig())
    eng.add_request(prefill_leg())
    (rec,) = drain(eng)
    assert rec.first_token_ns == rec.completion_ns == round(P.prefill_ms(4096) * MS)  # 85.75598 ms
    assert eng.num_held == 1 and eng.pool.num_active_blocks == 64 and eng.num_unfinished == 0
    assert eng.release_kv("r") and not eng.release_kv("r")
    assert eng.num_held == 0 and eng.pool.num_active_blocks == 0 and len(eng.pool.inactive) == 64  # cached
    eng.check_invariants()


def test_held_kv_is_a_prefix_for_later_prompts_and_uses_capacity():
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=100))
    eng.add_request(prefill_leg("a"))
    drain(eng)
    eng.add_request(prefill_leg("b", tokens=PROMPT + list(range(10**6, 10**6 + 1024)), at=eng.now_ns))
    (b,) = drain(eng)
    assert b.engine.cached_tokens == 4096  # the held blocks are shared
    eng.add_request(prefill_leg("c", tokens=list(range(5 * 10**6, 5 * 10**6 + 4096)), at=eng.now_ns))
    assert drain(eng) == []  # 64 + 80 blocks held: c cannot start
    eng.release_kv("a")
    eng.release_kv("b")
    released = eng.now_ns
    (c,) = drain(eng)
    assert c.engine.admitted_ns == released  # when the blocks came free, never before


@pytest.mark.parametrize("link, ttft_ms, e2e_ms", [
    ({}, 91.706564, 145.264127),  # no link model: the transfer is instant
    ({"bandwidth_gbps": 1.0, "bytes_per_token": 1000}, 95.802564, 149.360127),  # 4.096 ms
    ({"bandwidth_gbps": 25.0, "bytes_per_token": 131072}, 113.18140048, 166.73896348),  # 21.47483648 ms
])
def test_a_decode_leg_waits_its_transfer_then_decodes_from_its_first_pass(link, ttft_ms, e2e_ms):
    held = round(P.prefill_ms(4096) * MS)  # the decode leg arrives when the prefill rank finished
    eng = VllmEngineCore(EngineConfig())
    out = []
    eng.add_request(decode_leg(at=held, **link))
    while (t := eng.next_event_ns()) is not None:
        res = eng.advance_to(t)
        out += res.pulled
        done = res.completed
    (rec,) = done
    delay = transfer_delay_ns(KvTransfer(source_worker_id=0, **link), 4096)
    assert out == [("r", held, held + delay)] and rec.kv_reserved_ns == held and rec.kv_activated_ns == held + delay
    assert rec.first_token_ns / MS == pytest.approx(ttft_ms, abs=1e-6)  # + one decode pass of the prompt: D(4096)
    assert rec.completion_ns / MS == pytest.approx(e2e_ms, abs=1e-6)
    assert rec.engine.cached_tokens == 0 and rec.output_tokens == 10 and eng.pool.num_active_blocks == 0
    assert len(eng.pool.inactive) == 64  # the transferred prompt stays cached here


def test_destination_missing_moves_only_the_blocks_the_decode_rank_lacks():
    x = KvTransfer(source_worker_id=0, bandwidth_gbps=1.0, bytes_per_token=1000, mode="destination_missing")
    assert transfer_tokens("destination_missing", 4100, 65, 64) == 4160
    assert transfer_delay_ns(x, 4160) == 4_160_000
    eng = VllmEngineCore(EngineConfig())
    eng.add_request(Request(request_id="a", token_ids=PROMPT, max_tokens=2, arrival_ns=0, kv_transfer=x))
    (a,) = drain(eng)
    assert a.kv_activated_ns - a.kv_reserved_ns == 4_096_000  # nothing cached yet: 64 blocks
    eng.add_request(Request(request_id="b", token_ids=PROMPT + [7] * 4, max_tokens=2, arrival_ns=eng.now_ns,
                            kv_transfer=x))
    (b,) = drain(eng)
    assert b.kv_activated_ns - b.kv_reserved_ns == 64_000  # one block: the partial last one


def test_a_decode_leg_waits_for_room_in_arrival_order():
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=72))
    eng.add_request(Request(request_id="small", token_ids=list(range(10**6, 10**6 + 512)), max_tokens=300,
                            arrival_ns=0))
    eng.add_request(decode_leg("big", at=50 * MS))  # 64 blocks do not fit beside the 9 of "small": not until it ends
    done = {r.request_id: r for r in drain(eng)}
    assert done["big"].kv_reserved_ns == done["small"].completion_ns


@st.composite
def legs(draw):
    cfg = EngineConfig(num_gpu_blocks=draw(st.integers(8, 40)), block_size=draw(st.sampled_from([1, 2, 4])),
                       max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(4, 32)))
    cap = cfg.capacity_tokens
    reqs, releases = [], []
    for i in range(draw(st.integers(1, 10))):
        n = draw(st.integers(1, cap // 3))
        shared = draw(st.integers(0, n))
        tokens = [1] * shared + [1000 * (i + 1) + k for k in range(n - shared)]
        at = draw(st.integers(0, 30)) * MS
        if draw(st.booleans()):
            reqs.append(prefill_leg(f"p{i}", tokens, at))
            releases.append((f"p{i}", draw(st.integers(0, 60)) * MS))
        else:
            out = draw(st.integers(1, max(1, min(8, cap // 3 - n + 1))))
            reqs.append(decode_leg(f"d{i}", tokens, out, at, bandwidth_gbps=draw(st.sampled_from([1e-4, 1e-3])),
                                   bytes_per_token=40))
    return cfg, reqs, releases


@settings(max_examples=200, deadline=None)
@given(legs())
def test_blocks_are_conserved_whatever_legs_come_and_go(work):
    """Held and in-transit KV is accounted for at every step; after every release the pool is all free or cached."""
    cfg, reqs, releases = work
    eng = VllmEngineCore(cfg)
    for r in reqs:
        eng.add_request(r)
    released: set[str] = set()
    done: set[str] = set()
    for _ in range(100_000):
        t = eng.next_event_ns()
        due = [(at, rid) for rid, at in releases if rid in done and rid not in released]
        if due:
            at, rid = min(due)
            done |= {rec.request_id for rec in eng.advance_to(max(at, eng.now_ns)).completed}
            eng.release_kv(rid)
            released.add(rid)
            continue
        if t is None:
            break
        done |= {rec.request_id for rec in eng.advance_to(t).completed}
        eng.check_invariants()
    assert done == {r.request_id for r in reqs}
    eng.advance_to(max(eng.busy_until_ns, eng.now_ns))
    eng.check_invariants()
    assert eng.num_held == 0 and eng.pool.num_active_blocks == 0


def test_a_decode_legs_first_token_is_never_inside_a_quiet_horizon():
    """A decode leg that joins a rank alone produces its first token at its first pass: ``next_event_ns`` must
    stop there (it once took the leg for a steady decode and reported the token a whole decode run late)."""
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=3, block_size=2, max_num_seqs=1, max_num_batched_tokens=1))
    eng.add_request(Request(request_id="r0", token_ids=[1000], max_tokens=2, arrival_ns=0))
    eng.add_request(Request(request_id="r1", token_ids=[1100], max_tokens=2, arrival_ns=0,
                            kv_transfer=KvTransfer(source_worker_id=9, source_dp_rank=0, bandwidth_gbps=0.0001,
                                                   bytes_per_token=40)))
    firsts = []
    while (t := eng.next_event_ns()) is not None:
        if t - 1 > eng.now_ns:
            quiet = eng.advance_to(t - 1)
            assert not (quiet.first_tokens or quiet.completed), t
        firsts += [(rid, at) for rid, at in eng.advance_to(t).first_tokens]
    assert [rid for rid, _ in firsts] == ["r0", "r1"]

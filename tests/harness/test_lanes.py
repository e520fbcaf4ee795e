"""Continuous agentic lanes (``workload.lanes``, ``harness.workload.lanes``): lanes, recycling, deadline, idle guards,
snapshot, warm-up, lineage, and the phases in the report."""

from __future__ import annotations

import asyncio
import heapq
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.clock import ManualClock
from kvemu.errors import InvalidArgument
from kvemu.runtime.loop import run_virtual

from harness.workload.agentic_corpus import corpus_rows
from harness.workload.lanes import DEADLINE_REASON, LanePlayer, conversation_parents, snapshot_cut
from harness.report.summary import WALL_CLOCK_KEYS
from harness.run.runner import run_scenario
from harness.scenario import LanesSpec, ScenarioError, load_scenario, parse_scenario
from harness.workload.traces.formats import load_graph
from harness.workload.traces.graph import TraceGraph

from tests.harness.trace_files import HEADER, v2_row, write

MS = 1_000_000
S = 1_000_000_000
ROOT = Path(__file__).resolve().parents[2]


class Sent(SimpleNamespace):
    """One request the fake server took: its request, arrival, end and failure."""


def play(g: TraceGraph, spec: LanesSpec, service_ms: Any = lambda req: 10, fail: Any = lambda req: False,
         busy: Any = None) -> tuple[dict[str, Sent], LanePlayer, list[tuple[str, str]]]:
    """Run a lane player against a fake server whose request ``req`` takes ``service_ms(req)`` ms; ``busy(now_ns,
    log)``: what the server still works for besides (None: the player does not ask)."""
    clock = ManualClock()
    log: dict[str, Sent] = {}
    cancelled: list[tuple[str, str]] = []
    handles: dict[str, Any] = {}

    def submit(req, on_end):
        sent = log[req.request_id] = Sent(req=req, at=clock.now_ns(), end=None, failure=None)
        loop = asyncio.get_running_loop()

        def finish():
            handles.pop(req.request_id, None)
            sent.end = clock.now_ns()
            sent.failure = "boom" if fail(req) else None
            on_end(SimpleNamespace(failure=sent.failure))

        loop.call_at_ns(clock.now_ns() + round(service_ms(req) * MS), finish)
        handles[req.request_id] = (finish, on_end)

    def cancel(rid, why):
        cancelled.append((rid, why))
        if rid in handles:
            _, on_end = handles.pop(rid)
            log[rid].end, log[rid].failure = clock.now_ns(), why
            on_end(SimpleNamespace(failure=why))

    async def in_server() -> int:
        return len(handles) + busy(clock.now_ns(), log)

    player = LanePlayer(g, spec, submit, clock, cancel=cancel, in_server=in_server if busy is not None else None)

    async def main() -> None:
        await player.run()

    run_virtual(main, clock)
    return log, player, cancelled


def corpus(tmp_path: Path, plays: int = 4, seed: int = 31) -> TraceGraph:
    return load_graph(write(tmp_path / "c.jsonl", corpus_rows(plays, seed)))


def instance_of(rid: str) -> int:
    return int(rid.split(":", 1)[0][1:])


def spans(log: dict[str, Sent]) -> dict[int, tuple[int, int]]:
    """Each play instance's first arrival and last end."""
    out: dict[int, tuple[int, int]] = {}
    for rid, s in log.items():
        k = instance_of(rid)
        lo, hi = out.get(k, (s.at, s.end))
        out[k] = (min(lo, s.at), max(hi, s.end))
    return out


def most_concurrent(intervals: list[tuple[int, int]]) -> int:
    """The most intervals [start, end) open at once (an end at t frees its slot before a start at t)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


# ------------------------------------------------------------------ lanes and recycling


def test_lanes_never_hold_more_plays_than_lanes_and_the_corpus_runs_once(tmp_path):
    g = corpus(tmp_path, plays=6)
    log, player, _ = play(g, LanesSpec(lanes=2))
    per = spans(log)
    assert len(per) == 6 and player.cursor == 6
    assert most_concurrent(list(per.values())) == 2
    assert len(log) == len(g) and player.report().plays_completed == 6
    assert all(s.req.request_id.split(":", 1)[1] in {g.request_id(i) for i in range(len(g))} for s in log.values())


def test_recycling_wraps_the_cursor_with_fresh_ids_and_a_fresh_cache_per_instance(tmp_path):
    g = corpus(tmp_path, plays=3)
    log, player, _ = play(g, LanesSpec(lanes=2, duration_s=400, grace_s=0, tree_idle_cap_s=None,
                                       global_idle_cap_s=None))
    assert player.cursor > 3  # wrapped
    assert most_concurrent(list(spans(log).values())) <= 2
    ids: dict[int, set[int]] = {}
    sessions: dict[int, set[str]] = {}
    for rid, s in log.items():
        k = instance_of(rid)
        ids.setdefault(k, set()).update(s.req.tokens.hash_ids)
        sessions.setdefault(k, set()).add(s.req.session_id)
        assert s.req.session_id.startswith(f"i{k}:")
    instances = sorted(ids)
    for a in instances:  # no two instances share a block, nor a conversation
        for b in instances:
            if a < b:
                assert not ids[a] & ids[b] and not sessions[a] & sessions[b]
    # the same play's instances: the same prompt shapes, in their own id ranges; within one, prefixes are shared
    by_play: dict[int, list[int]] = {}
    for inst in player.instances:
        by_play.setdefault(inst.play, []).append(inst.k)
    first, again = next(ks for ks in by_play.values() if len(ks) > 1)[:2]
    turns = sorted((rid for rid in log if instance_of(rid) == first and ":main:t" in rid), key=lambda r: log[r].at)
    t0, t1 = log[turns[0]].req.tokens.hash_ids, log[turns[1]].req.tokens.hash_ids
    assert t1[:len(t0)] == t0  # the next turn extends the prompt: its blocks are the previous turn's
    rid_again = f"i{again}:" + turns[0].split(":", 1)[1]
    assert len(log[rid_again].req.tokens.hash_ids) == len(t0)


@st.composite
def chain_corpora(draw) -> list[list[tuple[int, int]]]:
    """Plays as chains of (delay ms, service ms) requests."""
    return draw(st.lists(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), min_size=1, max_size=3),
                         min_size=1, max_size=6))


def lane_model(plays: list[list[tuple[int, int]]], lanes: int, deadline_ms: int | None) -> list[tuple[int, int]]:
    """Reference: list scheduling. Play instances in cursor order (wrapping while before the deadline), each on
    the lane free first; returns each instance's (start ms, play)."""
    free = [0] * lanes
    out = []
    k = 0
    while True:
        if deadline_ms is None and k == len(plays):
            break
        t = heapq.heappop(free)
        if deadline_ms is not None and t >= deadline_ms:
            break
        p = k % len(plays)
        out.append((t, p))
        heapq.heappush(free, t + sum(d + s for d, s in plays[p]))
        k += 1
    return out


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plays=chain_corpora(), lanes=st.integers(1, 4), recycle=st.booleans())
def test_lane_scheduling_matches_a_list_scheduling_model(tmp_path, plays, lanes, recycle):
    if not recycle:
        lanes = min(lanes, len(plays))
    rows = [HEADER]
    service = {}
    for p, chain in enumerate(plays):
        for t, (delay, svc) in enumerate(chain):
            deps = [(f"p{p}t{t - 1}", "completion", "sequence", delay)] if t else []
            rows.append(v2_row(f"p{p}t{t}", *deps, play=f"p{p}", at=delay if not t else 0))
            service[f"p{p}t{t}"] = svc
    g = load_graph(write(tmp_path / "chains.jsonl", rows))
    deadline = 200 if recycle else None
    spec = LanesSpec(lanes=lanes, duration_s=deadline / 1000 if deadline else None, grace_s=1000,
                     tree_idle_cap_s=None, global_idle_cap_s=None)
    log, player, _ = play(g, spec, lambda req: service[req.request_id.split(":", 1)[1]])
    # a play ready later than its order place (a root floor) starts later: order is by first root, then index
    model = lane_model([plays[p] for p in player.order], lanes, deadline)
    started = sorted((inst.k, inst.play) for inst in player.instances)
    assert [player.order.index(p) for _, p in started][:len(model)] == [p for _, p in model]
    for k, (t, p) in enumerate(model):
        first = (t + plays[player.order[p]][0][0]) * MS
        sent = [s.at for rid, s in log.items() if instance_of(rid) == k]
        if deadline is not None and first >= deadline * MS:
            assert not sent  # its first request was due after the deadline
        else:
            assert min(sent) == first
    assert most_concurrent(list(spans(log).values())) <= lanes


# ------------------------------------------------------------------ deadline, grace, idle guards


def deadline_graph(tmp_path: Path) -> TraceGraph:
    return load_graph(write(tmp_path / "d.jsonl", [HEADER,
        v2_row("long", play="a", session="a"),
        v2_row("late", ("long", "completion", "sequence", 0), play="a", session="a"),
        v2_row("short", play="b", session="b"),
        v2_row("graced", ("short", "completion", "sequence", 0), play="b", session="b"),
    ]))


def test_at_the_deadline_nothing_new_goes_responses_count_in_grace_and_the_rest_is_cancelled(tmp_path):
    g = deadline_graph(tmp_path)
    service = {"long": 100_000, "late": 1, "short": 9_000, "graced": 3_000}
    log, player, cancelled = play(g, LanesSpec(lanes=2, duration_s=10, grace_s=5, tree_idle_cap_s=None,
                                               global_idle_cap_s=None),
                                  lambda req: service[req.request_id.split(":", 1)[1]])
    assert cancelled == [("i0:long", DEADLINE_REASON)]
    assert log["i0:long"].end == 15 * S and log["i0:long"].failure == DEADLINE_REASON
    assert log["i1:graced"].at == 9 * S and log["i1:graced"].end == 12 * S and log["i1:graced"].failure is None
    assert "i0:late" not in log
    r = player.report()
    assert (r.requests_issued, r.requests_cancelled, r.requests_never_issued) == (3, 1, 1)
    assert (r.plays_completed, r.plays_cut) == (1, 1)


def test_a_play_idle_longer_than_the_tree_cap_has_its_timers_moved_earlier(tmp_path):
    g = load_graph(write(tmp_path / "i.jsonl", [HEADER,
        v2_row("t0"), v2_row("t1", ("t0", "completion", "sequence", 1_000_000)),
        v2_row("t2", ("t1", "completion", "sequence", 20_000))]))
    log, player, _ = play(g, LanesSpec(lanes=1, duration_s=3_000, grace_s=0, tree_idle_cap_s=50,
                                       global_idle_cap_s=None), lambda req: 10)
    assert log["i0:t1"].at == log["i0:t0"].end + 50 * S  # 1,000 s of tool time capped at 50
    assert log["i0:t2"].at == log["i0:t1"].end + 20 * S  # under the cap: as recorded
    assert player.report().idle_shifts_tree >= 1


def test_a_client_idle_longer_than_the_global_cap_moves_every_timer_by_the_same_amount(tmp_path):
    g = load_graph(write(tmp_path / "i.jsonl", [HEADER,
        v2_row("a0"), v2_row("a1", ("a0", "completion", "sequence", 100_000)),
        v2_row("a2", ("a0", "completion", "sequence", 100_500)),
        v2_row("a3", ("a0", "completion", "sequence", 130_000))]))
    log, player, _ = play(g, LanesSpec(lanes=1, duration_s=10_000, grace_s=0, tree_idle_cap_s=None,
                                       global_idle_cap_s=10), lambda req: 10)
    end = log["i0:a0"].end
    assert log["i0:a1"].at == end + 10 * S  # the earliest timer moved to the cap...
    assert log["i0:a2"].at == end + 10_500 * MS  # ... and the others by as much, keeping their gap
    assert log["i0:a3"].at == log["i0:a2"].end + 10 * S  # idle again: moved again
    assert player.report().idle_shifts_global >= 2


# ------------------------------------------------------------------ snapshot and warm-up


@given(seed=st.integers(0, 2**63 - 1), first=st.integers(0, 10**12), span=st.integers(0, 10**12))
def test_a_snapshot_cut_lies_in_the_middle_half_of_the_span_and_depends_only_on_its_inputs(seed, first, span):
    cut = snapshot_cut(seed, "play", 1, 0, first, first + span)
    assert first + span // 4 <= cut <= first + (3 * span) // 4 + 1
    assert cut == snapshot_cut(seed, "play", 1, 0, first, first + span)


def test_a_snapshot_is_the_same_for_a_seed_and_starts_each_lane_part_way(tmp_path):
    g = corpus(tmp_path, plays=4)

    def sent(seed: int) -> tuple[list[tuple[str, int]], LanePlayer]:
        log, player, _ = play(g, LanesSpec(lanes=3, snapshot_seed=seed))
        return sorted((rid, s.at) for rid, s in log.items()), player

    a, player = sent(5)
    assert a == sent(5)[0] and a != sent(6)[0]
    assert len(player.instances) == 3 and player.cursor == 0  # without a profile, only the lanes' first plays
    assert 0 < len(a) < sum(len(inst.nodes) for inst in player.instances)  # history is not replayed
    roots = {f"i{k}:play-{k}:main:t0" for k in range(3)}
    assert not roots & {rid for rid, _ in a}  # every lane's first turn was history


def test_a_snapshot_turns_history_edges_into_timers_from_the_cut(tmp_path):
    # a chain recorded at 0, 10, 20, 30 s, each request 2 s long and 8 s of tool time before the next
    rows = [HEADER]
    for t in range(4):
        deps = [(f"r{t - 1}", "completion", "sequence", 8_000)] if t else []
        rows.append(v2_row(f"r{t}", *deps, at=10_000 * t, recorded_api_time_ms=2_000))
    g = load_graph(write(tmp_path / "chain.jsonl", rows))
    for seed in range(5):
        log, player, _ = play(g, LanesSpec(lanes=1, snapshot_seed=seed))
        cut = snapshot_cut(seed, "p", 0, 0, 0, 30 * S)
        live = [t for t in range(4) if t * 10 * S >= cut]
        assert sorted(log) == [f"i0:r{t}" for t in live]
        first = log[f"i0:r{live[0]}"]
        assert first.at == live[0] * 10 * S - cut  # its recorded start, counted from the cut
        for t in live[1:]:  # live edges stay edges; the authored start stays a floor, counted from the cut
            assert log[f"i0:r{t}"].at == max(log[f"i0:r{t - 1}"].end + 8 * S, t * 10 * S - cut)


def test_a_warm_up_primes_each_conversation_then_warms_each_lane_with_one_token_requests(tmp_path):
    g = corpus(tmp_path, plays=4)
    spec = LanesSpec(lanes=3, snapshot_seed=5, warmup=True, warmup_requests=4)
    log, player, _ = play(g, spec)
    primers = [s for rid, s in log.items() if ":primer:" in rid]
    warm = [s for rid, s in log.items() if ":warmup:" in rid]
    profile = [s for rid, s in log.items() if player.phases[rid] == "profile"]
    assert len(warm) == 3 * 4 and all(s.req.max_tokens == 1 for s in primers + warm)
    # a primer per conversation with history and requests left: its last historical prompt
    expected = 0
    for inst in player.instances:
        live = {g.session[i] for j, i in enumerate(inst.nodes) if inst.state[j] != 4}
        hist = {g.session[i] for j, i in enumerate(inst.nodes) if inst.state[j] == 4}
        expected += len(live & hist)
    assert len(primers) == expected > 0
    assert max(s.end for s in primers + warm) <= min(s.at for s in profile)  # the barrier
    for s in warm:  # a warm-up request repeats one of its lane's primers (a lane with none: a remaining request)
        mine = [p.req.tokens.hash_ids for p in primers if instance_of(p.req.request_id) == instance_of(
            s.req.request_id)]
        assert s.req.tokens.hash_ids in mine or not mine


def _server_busy_until(t_ns: Any) -> Any:
    """A server that still works for 2 requests not owned by the lanes until ``t_ns(log)`` (e.g. KV transfers)."""
    return lambda now, log: 2 if now < t_ns(log) else 0


def _last_warmup_end(log: dict[str, Sent]) -> int:
    return max(s.end for rid, s in log.items() if ":warmup:" in rid or ":primer:" in rid)


def test_the_barrier_waits_for_the_server_to_settle_after_the_last_warm_up_response(tmp_path):
    g = corpus(tmp_path, plays=4)
    spec = LanesSpec(lanes=3, snapshot_seed=5, warmup=True, warmup_requests=4)
    _, base, _ = play(g, spec, busy=lambda now, log: 0)  # settled at once: the barrier opens at the last response
    assert base.unsettled == 0 and base.times["profile"][0] == base.times["warmup"][1]
    log, player, _ = play(g, spec, busy=_server_busy_until(lambda log: _last_warmup_end(log) + 1234 * MS))
    last = _last_warmup_end(log)
    first_profile = min(s.at for rid, s in log.items() if player.phases[rid] == "profile")
    # the server was busy for 1234 ms more: asked every 10 ms, the barrier opens at the first answer of 0
    assert player.times["profile"][0] == last + 1240 * MS <= first_profile
    assert player.unsettled == 0 and player.report().unsettled_server_requests == 0
    assert player.times["warmup"][1] == last


def test_a_server_that_does_not_settle_in_time_opens_the_barrier_at_the_timeout_and_is_counted(tmp_path):
    g = corpus(tmp_path, plays=4)
    spec = LanesSpec(lanes=3, snapshot_seed=5, warmup=True, warmup_requests=4, settle_timeout_s=0.25)
    log, player, _ = play(g, spec, busy=_server_busy_until(lambda log: _last_warmup_end(log) + 10 * S))
    assert player.times["profile"][0] == _last_warmup_end(log) + 250 * MS
    assert player.unsettled == 2 and player.report().unsettled_server_requests == 2
    assert any(player.phases[rid] == "profile" for rid in log)  # measurement went on


def test_a_settle_timeout_out_of_bounds_is_refused_naming_the_field():
    for bad in (0, 3601):
        with pytest.raises(Exception, match="settle_timeout_s"):
            parse_scenario(f"workload: {{kind: trace, trace: c.jsonl, lanes: {{lanes: 1, settle_timeout_s: {bad}}}}}\n")


def test_a_failed_warm_up_request_stops_the_run(tmp_path):
    g = corpus(tmp_path, plays=2)
    log, player, _ = play(g, LanesSpec(lanes=2, snapshot_seed=1, warmup=True),
                          fail=lambda req: ":warmup:" in req.request_id)
    assert player.failed_preparation and all(player.phases[rid] != "profile" for rid in log)


# ------------------------------------------------------------------ lineage


def test_a_spawned_conversation_carries_its_parent_and_ambiguous_lineage_none(tmp_path):
    g = load_graph(write(tmp_path / "l.jsonl", [HEADER,
        v2_row("m0", session="main"),
        v2_row("a0", ("m0", "dispatch", "spawn", 0), session="agent"),
        v2_row("b0", ("m0", "dispatch", "spawn", 0), session="other"),
        v2_row("x0", ("a0", "dispatch", "spawn", 0), ("b0", "dispatch", "spawn", 0), session="both"),
        v2_row("y0", ("x0", "dispatch", "spawn", 0), session="below"),
        v2_row("m1", ("m0", "completion", "sequence", 0), ("a0", "completion", "join", 0), session="main"),
    ]))
    parents = conversation_parents(g)
    name = {s: g.sessions[p] if p >= 0 else None for s, p in enumerate(parents)}
    by = {g.sessions[s]: name[s] for s in range(len(g.sessions))}
    assert by == {"main": None, "agent": "main", "other": "main", "both": None, "below": None}
    log, _, _ = play(g, LanesSpec(lanes=1))
    assert log["i0:a0"].req.parent_session_id == "i0:main" == log["i0:b0"].req.parent_session_id
    assert log["i0:m0"].req.parent_session_id is None and log["i0:y0"].req.parent_session_id is None


# ------------------------------------------------------------------ the scenario and the report


def lanes_scenario(tmp_path: Path, **lanes: Any):
    write(tmp_path / "c.jsonl", corpus_rows(4))
    body = {"lanes": 3, "duration_s": 60, "grace_s": 5, "snapshot_seed": 3, "warmup": True, **lanes}
    text = ("name: lanes\ncluster: {workers: 2, engine: {block_size: 64}}\nrouter: {affinity: {enabled: true}}\n"
            f"workload: {{kind: trace, trace: c.jsonl, lanes: {json.dumps(body)}}}\n")
    return parse_scenario(text, base_dir=tmp_path)


def test_a_lanes_run_reports_its_phases_and_counts_only_the_profile(tmp_path):
    out = run_scenario(lanes_scenario(tmp_path), tmp_path / "out")
    s = out.summary.to_builtins()
    assert s is not None
    lanes = s["kvemu"]["lanes"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").open()]
    phases = {r["request_id"]: r["phase"] for r in rows}
    profile = [r for r in rows if r["phase"] == "profile"]
    assert lanes["phases"]["primer"]["requests"] == sum(1 for p in phases.values() if p == "primer") > 0
    assert lanes["phases"]["warmup"]["requests"] == 3 * 10
    assert s["num_requests"] == len(profile) == lanes["phases"]["profile"]["requests"]
    assert s["total_input_tokens"] == sum(r["isl"] for r in profile if r["completion_ns"] and not r["failure"])
    assert all(r["max_tokens"] == 1 for r in rows if r["phase"] != "profile")
    assert lanes["requests_issued"] == len(profile)
    per: dict[str, tuple[int, int]] = {}  # the records alone: at most 3 play instances at a time
    for r in profile:
        k = r["request_id"].split(":", 1)[0]
        end = r["completion_ns"] if r["completion_ns"] is not None else r["arrival_ns"]
        lo, hi = per.get(k, (r["arrival_ns"], end))
        per[k] = (min(lo, r["arrival_ns"]), max(hi, end))
    assert most_concurrent(list(per.values())) <= 3 and len(per) > 3
    assert "Lanes: 3 lanes recycling the corpus" in (tmp_path / "out" / "report.md").read_text()
    # the engine's view: a recycled instance's first request finds nothing cached (the corpus's plays share their
    # system prompt, but each instance has its own blocks); its later turns find their own prefix
    firsts: dict[str, dict] = {}
    for r in sorted(profile, key=lambda r: r["arrival_ns"]):
        firsts.setdefault(r["request_id"].split(":", 1)[0], r)
    recycled = [r for k, r in firsts.items() if int(k[1:]) >= 3]
    assert recycled and all(r["engine_cached_tokens"] == 0 for r in recycled if r["failure"] is None)
    later = [r for r in profile if r["request_id"].split(":", 1)[0] in {k for k in firsts if int(k[1:]) >= 3}
             and r not in recycled and r["failure"] is None]
    assert sum(r["engine_cached_tokens"] or 0 for r in later) > 0


def _profile_start_ms(tmp_path: Path, name: str, latency_ms: float, **lanes: Any) -> tuple[float, Any]:
    """A lanes run on engines that offload prompt blocks to host memory, each copy taking ``latency_ms`` to start:
    when measurement started (its first profile request) and what the barrier found still in the server."""
    write(tmp_path / "c.jsonl", corpus_rows(4))
    body = {"lanes": 3, "duration_s": 5, "grace_s": 1, "snapshot_seed": 3, "warmup": True, **lanes}
    text = ("name: lanes\ncluster: {workers: 2, engine: {block_size: 64, kv_cache_bytes_per_token: 1024, "
            f"native_host_offload: {{num_host_blocks: 4096, latency_to_first_byte_ms: {latency_ms}}}}}}}\n"
            f"workload: {{kind: trace, trace: c.jsonl, lanes: {json.dumps(body)}}}\n")
    out = run_scenario(parse_scenario(text, base_dir=tmp_path), tmp_path / name)
    assert out.summary is not None
    lanes_out = out.summary.to_builtins()["kvemu"]["lanes"]
    return lanes_out["phases"]["profile"]["start_ms"], lanes_out["unsettled_server_requests"]


def test_measurement_waits_for_the_engines_offload_after_the_last_warm_up_response(tmp_path):
    """Engines still copying the warm-up's prompt blocks to host memory when its last response arrives: the
    barrier waits until they finished; past ``settle_timeout_s`` it opens anyway, counting what was left."""
    instant, left = _profile_start_ms(tmp_path, "o0", 0.0)
    assert left == 0
    slow, left = _profile_start_ms(tmp_path, "o1", 1500.0)
    assert left == 0 and slow - instant >= 1500  # (the plays' timers run from the barrier)
    cut, left = _profile_start_ms(tmp_path, "o2", 1500.0, settle_timeout_s=0.3)
    assert left > 0 and cut - instant == pytest.approx(300, abs=1e-6)


def test_two_lanes_runs_are_byte_identical(tmp_path):
    digests = []
    for n in range(2):
        run_scenario(lanes_scenario(tmp_path), tmp_path / f"o{n}")
        summary = json.loads((tmp_path / f"o{n}" / "summary.json").read_text())
        for key in WALL_CLOCK_KEYS:
            summary.pop(key)
        digests.append((summary, (tmp_path / f"o{n}" / "requests.jsonl").read_bytes()))
    assert digests[0] == digests[1]


def test_validate_says_the_lanes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "validate", str(ROOT / "examples" / "agentic-lanes.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith(", on 6 lanes (recycling the corpus for 300 s)")


def test_the_example_runs(tmp_path):
    out = run_scenario(load_scenario(ROOT / "examples" / "agentic-lanes.yaml",
                                     ["workload.lanes.duration_s=30"]), tmp_path / "out")
    assert out.summary is not None and out.summary.completed_requests > 0
    assert out.summary.kvemu.lanes.plays_started >= 6


@pytest.mark.parametrize("lanes, extra, message", [
    ({"lanes": 2, "warmup": True}, "", "give snapshot_seed too"),
    ({"lanes": 2}, "  concurrency: 3\n", "not both"),
    ({"lanes": 2}, "  format: mooncake\n", "has no plays"),
    ({"lanes": 0}, "", "workload.lanes.lanes"),
])
def test_lanes_that_make_no_sense_are_refused_naming_the_field(tmp_path, lanes, extra, message):
    text = f"workload:\n  kind: trace\n  trace: c.jsonl\n{extra}  lanes: {json.dumps(lanes)}\n"
    with pytest.raises((ScenarioError, InvalidArgument), match=message):
        parse_scenario(text, base_dir=tmp_path)


def test_more_lanes_than_plays_run_once_are_refused(tmp_path):
    with pytest.raises(ScenarioError, match="lanes for a corpus of 4 plays run once"):
        run_scenario(lanes_scenario(tmp_path, lanes=5, duration_s=None, snapshot_seed=None, warmup=False))

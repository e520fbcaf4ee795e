"""A worker's engine truth: every request's facts and its ranks' load, bounded, paged, and served over HTTP."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvemu.records import EngineFacts, EngineRecord

from harness.procs.engine_truth import EngineTruth, TruthPage

from tests.raw_peer import NOT_HTTP, raw_peer


def _rec(i: int, **kw) -> EngineRecord:
    return EngineRecord(request_id=f"r{i}", arrival_ns=i, isl=100, dp_rank=1, engine=EngineFacts(cached_tokens=64),
                         **kw)


def test_records_page_on_and_the_oldest_are_dropped_past_the_bound_and_counted():
    truth = EngineTruth(7, max_records=3)
    for i in range(5):
        truth.ended(_rec(i))
    page = truth.records_page(0)
    assert [r.request_id for r in page.records] == ["r2", "r3", "r4"] and page.dropped == 2 and page.next == 5
    first = page.records[0]
    assert first.worker_id == 7 and first.engine.cached_tokens == 64 and first.dp_rank == 1
    assert truth.records_page(4).records[0].request_id == "r4"
    assert truth.records_page(5).records == [] and truth.records_page(5).next == 5
    assert [r.request_id for r in truth.records_page(0, limit=1).records] == ["r2"]


def test_an_aborted_request_is_recorded_as_failed():
    truth = EngineTruth(0)
    truth.ended(_rec(0), "abort")
    truth.ended(_rec(1, failure="rank_lost"), "abort")
    assert [r.failure for r in truth.records_page().records] == ["aborted", "rank_lost"]


def test_the_first_arrival_is_kept():
    truth = EngineTruth(0)
    assert truth.records_page().first_arrival_ns is None
    truth.arrived(50)
    truth.arrived(90)
    assert truth.records_page().first_arrival_ns == 50


class _Core:
    def __init__(self, rank: int) -> None:
        self.dp_rank, self.num_running, self.num_waiting, self.kv_usage = rank, rank + 1, 2, 0.123456


def test_load_samples_skip_dead_ranks():
    truth = EngineTruth(3)
    truth.sample(10, [_Core(0), _Core(1)], lambda r: r == 1)
    samples = truth.load_page().samples
    assert [(s.t_ns, s.worker_id, s.dp_rank, s.running, s.waiting, s.kv_usage) for s in samples] == \
        [(10, 3, 0, 1, 2, 0.1235)]


def _get(route, query: bytes) -> tuple[int, bytes]:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    asyncio.run(route({"query_string": query}, receive, send))
    return sent[0]["status"], sent[1]["body"]


def test_the_routes_serve_pages_and_refuse_a_bad_parameter_by_name():
    truth = EngineTruth(1)
    truth.ended(_rec(0))
    routes = truth.routes()
    status, body = _get(routes[("GET", "/kvemu/requests")], b"after=0")
    assert status == 200 and msgspec.json.decode(body, type=TruthPage).records[0].request_id == "r0"
    from kvemu.http.errors import ApiError

    with pytest.raises(ApiError, match="after"):
        _get(routes[("GET", "/kvemu/requests")], b"after=-1")
    with pytest.raises(ApiError, match="limit"):
        _get(routes[("GET", "/kvemu/load")], b"limit=1e9")


def test_a_served_record_is_the_engines_own_without_its_token_times():
    truth = EngineTruth(4)
    rec = _rec(0, token_times_ns=[5, 6, 7], output_tokens=3, kv_reserved_ns=2, worker_id=None)
    truth.ended(rec)
    (served,) = truth.records_page().records
    assert served.token_times_ns == [] and rec.token_times_ns == [5, 6, 7]  # the engine's record is not touched
    assert (served.worker_id, served.output_tokens, served.kv_reserved_ns, served.engine.cached_tokens) == (4, 3, 2, 64)


class _CountingList(list):
    """A list that counts the entries its reads touch (an index 1, a slice its length)."""

    touched = 0

    def __getitem__(self, key):
        got = super().__getitem__(key)
        type(self).touched += len(got) if isinstance(key, slice) else 1
        return got


def test_a_page_of_a_million_records_costs_the_page_not_its_position():
    """``/kvemu/requests`` pages in O(page): the log is a ring over a list read by at most two slices (a deque
    indexed entry by entry walked from its ends: 157 ms on the loop at 1 M records); counted, not timed."""
    from harness.procs.engine_truth import _Log

    log = _Log(1_000_000)
    for i in range(1_250_000):  # past the bound: the ring has wrapped
        log.add(i)
    assert isinstance(log.items, list)
    log.items = _CountingList(log.items)
    for after in (0, 250_000, 600_000, 999_995, 1_249_995):  # (999_995: a page across the wrap)
        _CountingList.touched = 0
        items, nxt, dropped = log.page(after, 10)
        want = list(range(max(after, 250_000), min(max(after, 250_000) + 10, 1_250_000)))
        assert (items, nxt, dropped) == (want, want[-1] + 1, 250_000)
        assert _CountingList.touched == len(want)  # the page's entries, nothing walked to reach them


@pytest.mark.parametrize("answer", NOT_HTTP)
def test_a_worker_answering_something_other_than_http_is_a_problem_named_not_a_crash(answer):
    """Reading a fleet's truth after its run: a worker whose port answers garbage (or a body cut short) is one
    line in the problems, and the other workers' records are still read."""
    from harness.procs.fleet import FleetInfo, FleetWorker, _first_arrival
    from harness.procs.http_loadgen import fetch_truth

    with raw_peer(answer) as url:
        fleet = FleetInfo(model="m", kv_events_version="0.33", workers=[
            FleetWorker(worker_id=0, pool="aggregated", url=url, dp_size=1, block_size=16, kv_events=[],
                        kv_replay=[])])
        records, samples, problems = fetch_truth(fleet, timeout_s=5)
        assert _first_arrival(url) is None
    assert records == [] and samples == [] and len(problems) == 1 and problems[0].startswith(url)

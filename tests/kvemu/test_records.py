"""One record of a request's life: the engine keeps its own, and the router's is the one it returns, its hooks
carry and the recorder writes."""

import gc
from array import array

import anyio
import msgspec
import pytest

from kvemu import ManualClock, RequestRecord
from kvemu.records import EngineRecord, router_record, sequences_as_lists
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_virtual
from kvemu.messages import ClientRequest
from workers import EngineConfig, MockWorker, Request

from harness.run.cluster import cluster
from harness.report.recorder import Recorder
from harness.scenario import parse_scenario

SCENARIO = """
name: records
cluster:
  workers: 2
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 24, max_num_seqs: 8, speedup_ratio: 20, decode_speedup_ratio: 20}
router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}}
run: {mode: virtual, seed: 5}
"""

def _holds_scalars_only(struct: msgspec.inspect.StructType) -> None:
    scalars = (msgspec.inspect.StrType, msgspec.inspect.IntType, msgspec.inspect.NoneType)
    for field in struct.fields:
        t = field.type
        kinds = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
        for k in kinds:
            if isinstance(k, msgspec.inspect.StructType):  # an embedded struct (the engine's facts): the same rule
                _holds_scalars_only(k)
                continue
            assert isinstance(k, scalars) or (
                isinstance(k, msgspec.inspect.ListType) and isinstance(k.item_type, msgspec.inspect.IntType)
            ), (field.name, k)


def test_gc_untracked_is_safe_no_field_can_hold_an_object():
    """``gc=False`` is safe only while no field can refer back to a record: scalars, lists of ints, and structs of
    them (themselves untracked)."""
    for cls in (RequestRecord, EngineRecord):
        _holds_scalars_only(msgspec.inspect.type_info(cls))
        rec = cls(request_id="r", token_times_ns=[1, 2])
        assert not gc.is_tracked(rec) and not gc.is_tracked(rec.engine) and rec.token_times_ns == [1, 2]
        assert cls(request_id="a").token_times_ns is not cls(request_id="b").token_times_ns


def test_engine_keeps_the_record_and_the_worker_names_itself():
    worker = MockWorker(EngineConfig(block_size=4, num_gpu_blocks=16), worker_id=7)
    rec = worker.dispatch(Request(request_id="a", token_ids=list(range(10)), max_tokens=3)).raise_if_rejected()
    assert type(rec) is EngineRecord  # the engine's own, smaller record
    assert (rec.worker_id, rec.dp_rank, rec.isl, rec.max_tokens, rec.output_tokens) == (7, 0, 10, 3, 0)
    while not rec.done:
        worker.advance_to(worker.next_event_ns())
    assert rec.output_tokens == 3 and rec.completion_ns == rec.token_times_ns[-1] and rec.engine.admitted_ns == 0
    assert rec.engine.cached_tokens == 0 and rec.engine.preemptions == 0 and rec.failure is None


def test_router_result_and_recorder_line_agree_field_by_field():
    scenario = parse_scenario(SCENARIO)
    hooks = Hooks()
    recorder = Recorder(hooks)
    clock = ManualClock()
    shared = list(range(1000, 1064))
    results: dict[str, RequestRecord] = {}

    async def main():
        async with cluster(scenario, clock, hooks) as c:

            async def one(i: int) -> None:
                await anyio.sleep(i * 0.0003)
                req = ClientRequest(request_id=f"r{i}", tokens=shared + [i] * (16 + 40 * (i % 4)), max_tokens=40,
                                    session_id=f"s{i % 3}")
                results[req.request_id] = await c.router.handle(req)

            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)

    run_virtual(main, clock)
    assert len(results) == 24 and all(type(r) is RequestRecord and r.done for r in results.values())
    assert any(r.engine.cached_tokens for r in results.values())
    assert any(r.engine.preemptions for r in results.values())  # 24 blocks a rank: the engines preempt
    for rid, res in results.items():
        line = recorder.records[rid]
        assert line is res  # one record: the recorder keeps the router's, it does not rebuild one from hooks
        assert line.output_tokens == len(line.token_times_ns) == 40 and line.completion_ns == line.token_times_ns[-1]
        admitted = line.engine.admitted_ns
        assert admitted is not None and line.dispatch_ns <= admitted <= line.first_token_ns
        assert line.attempts == 1 and line.routed_ns is not None and line.best_overlap_blocks is not None
        assert line.best_overlap_blocks >= line.predicted_overlap_blocks
        # token times are kept compact (8 bytes each) and still written as the list the field declares
        assert isinstance(line.token_times_ns, array) and line.token_times_ns.typecode == "q"
        assert msgspec.json.decode(msgspec.json.encode(line, enc_hook=sequences_as_lists),
                                   type=RequestRecord).token_times_ns == list(line.token_times_ns)


def test_hooks_carry_the_record_as_it_stands_at_each_step():
    """Every request-level hook carries the request's one record; at each step it already holds that step's facts."""
    scenario = parse_scenario(SCENARIO)
    hooks = Hooks()
    seen: list[tuple[str, RequestRecord | None, dict]] = []
    hooks.subscribe(lambda ev: seen.append((ev.kind, ev.record, {
        "routed": ev.record.routed_ns if ev.record else None, "first": ev.record.first_token_ns if ev.record else None,
        "times": len(ev.record.token_times_ns) if ev.record else 0,
        "done": ev.record.completion_ns if ev.record else None})) if ev.request_id == "a" else None)
    clock = ManualClock()
    out: list[RequestRecord] = []

    async def main():
        async with cluster(scenario, clock, hooks) as c:
            out.append(await c.router.handle(ClientRequest(request_id="a", tokens=list(range(40)), max_tokens=5)))

    run_virtual(main, clock)
    (record,) = out
    assert all(rec is record for _, rec, _ in seen)
    kinds = [k for k, _, _ in seen]
    assert kinds[0] == "request_arrived" and kinds[-1] == "completed" and "routed" in kinds and "first_token" in kinds
    at = {k: facts for k, _, facts in seen}
    assert at["request_arrived"]["routed"] is None
    assert at["routed"]["routed"] is not None and at["routed"]["first"] is None
    assert at["first_token"]["first"] is not None and at["first_token"]["done"] is None
    assert at["completed"]["times"] == 5 and at["completed"]["done"] == record.token_times_ns[-1]


def test_token_times_go_into_a_router_record_as_sent_whatever_holds_them() -> None:
    """A list goes into the record's ``array('q')`` in one resize (``fromlist``); any other sequence still does;
    a time outside 64 bits is refused and leaves the times as they were."""
    rec = router_record("r", session_id=None, parent_session_id=None, arrival_ns=0, isl=1, max_tokens=9)
    rec.add_token_times([5, 7])
    rec.add_token_times((9,))
    rec.add_token_times(array("q", [11, 13]))
    rec.add_token_times([])
    assert type(rec.token_times_ns) is array and list(rec.token_times_ns) == [5, 7, 9, 11, 13]
    with pytest.raises(OverflowError):
        rec.add_token_times([15, 2**64])
    assert list(rec.token_times_ns) == [5, 7, 9, 11, 13] and rec.last_token_ns() == 13

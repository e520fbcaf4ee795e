"""The engine's facts of a request (issue #45): one ``EngineFacts`` the engine fills, ``Finished`` carries and the
router's record embeds; bounded on the wire, flat in requests.jsonl, the old names deprecated aliases."""

from __future__ import annotations

import warnings

import anyio
import msgspec
import pytest

from kvemu import ManualClock, RequestRecord
from kvemu.hooks import Hooks
from kvemu.limits import INT64_MAX
from kvemu.messages import ClientRequest, Finished, decode_worker_message, encode
from kvemu.records import JSONL_COLUMNS, EngineFacts, EngineRecord, records_jsonl, sequences_as_lists
from kvemu.runtime.loop import run_virtual

from harness.run.cluster import cluster
from harness.scenario import parse_scenario

SCENARIO = """
name: engine-facts
cluster:
  workers: 2
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 24, max_num_seqs: 8, speedup_ratio: 20, decode_speedup_ratio: 20}
router: {policy: kv}
run: {mode: virtual, seed: 5}
"""

FLAT_COLUMNS = (
    "request_id", "session_id", "parent_session_id", "arrival_ns", "isl", "max_tokens", "worker_id", "dp_rank",
    "attempts", "queued_ns", "routed_ns", "dispatch_ns", "routing_reason", "predicted_overlap_blocks",
    "best_overlap_blocks", "truth_overlap_blocks", "truth_best_overlap_blocks", "regret_source", "admitted_ns",
    "engine_cached_tokens", "engine_reused_tokens", "engine_host_cached_tokens", "preemptions", "first_token_ns",
    "output_tokens", "token_times_ns", "completion_ns", "prefill_worker_id", "prefill_dp_rank", "prefill_done_ns",
    "kv_reserved_ns", "kv_activated_ns", "failure",
)
"""requests.jsonl's columns from before the facts were embedded: the file's layout does not change."""


def _finished_with(facts: dict[str, object]) -> bytes:
    """A ``Finished`` as a hostile peer would write it: any value in its engine facts, unchecked."""
    return msgspec.msgpack.encode({"type": "Finished", "request_id": "r", "times_ns": [1], "engine": facts})


@pytest.mark.parametrize("facts", [
    {"engine_cached_tokens": -1},
    {"engine_cached_tokens": INT64_MAX + 1},
    {"engine_reused_tokens": -5},
    {"engine_host_cached_tokens": 2**64 - 1},
    {"admitted_ns": -1},
    {"preemptions": -1},
    {"preemptions": None},
    {"engine_cached_tokens": "many"},
    {"engine_cached_tokens": 1.5},
    {"cached_tokens": 3},  # its attribute name is not its wire name: an unknown field
    {"engine_cached_tokens": 3, "evil": "x" * 1000},
])
def test_a_hostile_peers_finished_with_facts_past_their_bounds_is_refused(facts):
    with pytest.raises(msgspec.ValidationError, match=r"\$\.engine"):
        decode_worker_message(_finished_with(facts))


def test_facts_at_their_bounds_decode_as_sent():
    most = EngineFacts(admitted_ns=INT64_MAX, cached_tokens=INT64_MAX, reused_tokens=0, host_cached_tokens=None,
                       preemptions=INT64_MAX)
    msg = Finished(request_id="r", times_ns=[1], engine=most)
    assert decode_worker_message(encode(msg)) == msg
    assert decode_worker_message(_finished_with({})).engine == EngineFacts()  # a peer that says nothing: defaults


@pytest.mark.parametrize("wire_check", ["false", "true"])
def test_the_engines_facts_arrive_in_the_routers_record_unchanged(wire_check):
    """What each engine held when it finished a request is, field for field, the router's ``record.engine`` (as
    objects, and as the bytes live mode sends)."""
    scenario = parse_scenario(SCENARIO, overrides=[f"cluster.kv_wire_check={wire_check}"])
    clock = ManualClock()
    shared = list(range(1000, 1064))
    at_engine: dict[str, EngineFacts] = {}
    results: dict[str, RequestRecord] = {}

    def ended(rec: RequestRecord, reason: str) -> None:
        at_engine[rec.request_id] = msgspec.structs.replace(rec.engine)  # a copy: as the engine had them

    async def main() -> None:
        async with cluster(scenario, clock, Hooks()) as c:
            for actor in c.workers.values():
                actor.on_end = ended

            async def one(i: int) -> None:
                await anyio.sleep(i * 0.0003)
                req = ClientRequest(request_id=f"r{i}", tokens=shared + [i] * (16 + 40 * (i % 4)), max_tokens=40)
                results[req.request_id] = await c.router.handle(req)

            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)

    run_virtual(main, clock)
    assert len(results) == 24 and all(r.done for r in results.values())
    assert {rid: r.engine for rid, r in results.items()} == at_engine
    # the run exercises every kind of fact: cached prefixes, preemptions (24 blocks a rank), admissions
    assert any(f.cached_tokens for f in at_engine.values()) and any(f.preemptions for f in at_engine.values())
    assert all(f.admitted_ns is not None and f.reused_tokens is not None for f in at_engine.values())


def test_requests_jsonl_keeps_its_flat_columns_and_values():
    facts = EngineFacts(admitted_ns=7, cached_tokens=32, reused_tokens=16, host_cached_tokens=8, preemptions=2)
    rec = RequestRecord(request_id='x"engine":{', session_id="}", engine=facts, token_times_ns=[9])
    assert JSONL_COLUMNS == FLAT_COLUMNS
    line = records_jsonl([rec], msgspec.json.Encoder(enc_hook=sequences_as_lists))
    row = msgspec.json.decode(line)
    assert tuple(row) == FLAT_COLUMNS and line.endswith(b"}\n") and line.count(b"\n") == 1
    assert (row["request_id"], row["session_id"]) == ('x"engine":{', "}")  # strings that look like the object
    assert (row["admitted_ns"], row["engine_cached_tokens"], row["engine_reused_tokens"],
            row["engine_host_cached_tokens"], row["preemptions"]) == (7, 32, 16, 8, 2)


def test_the_old_names_still_read_and_warn():
    facts = EngineFacts(admitted_ns=7, cached_tokens=32, reused_tokens=16, host_cached_tokens=8, preemptions=2)
    rec = RequestRecord(request_id="x", engine=facts)
    msg = Finished(request_id="x", times_ns=[], engine=facts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = (rec.admitted_ns, rec.engine_cached_tokens, rec.engine_reused_tokens, rec.engine_host_cached_tokens,
               rec.preemptions, msg.admitted_ns, msg.cached_tokens, msg.reused_tokens, msg.host_cached_tokens,
               msg.preemptions)
    assert old == (7, 32, 16, 8, 2) * 2
    assert len(caught) == 10 and all(w.category is DeprecationWarning and w.filename == __file__ for w in caught)
    assert "RequestRecord.engine.cached_tokens" in str(caught[1].message)


def test_the_engines_record_is_the_routers_fields_it_fills_under_the_same_names_and_bounds():
    """``EngineRecord`` is the engine's part of ``RequestRecord``: every field of it is one of the router's record,
    same type and bounds (the worker's /kvemu/requests page serves it as a ``RequestRecord``)."""
    router = {f.name: f for f in msgspec.inspect.type_info(RequestRecord).fields}
    engine = msgspec.inspect.type_info(EngineRecord).fields
    assert len(engine) <= len(router) // 2
    for f in engine:
        assert f.name in router and f.type == router[f.name].type, f.name
    rec = EngineRecord(request_id="x", engine=EngineFacts(cached_tokens=5))
    with pytest.warns(DeprecationWarning, match=r"EngineRecord\.engine_cached_tokens is now EngineRecord\.engine"):
        assert rec.engine_cached_tokens == 5

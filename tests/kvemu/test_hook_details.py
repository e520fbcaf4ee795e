"""Typed hook details: every kind declares its payload type, and what is emitted has it; ``data`` is deprecated."""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import NoneType, UnionType
from typing import get_args

import anyio
import pytest

import kvemu.hooks
from kvemu import SessionAffinity
from kvemu.affinity import AffinityMode
from kvemu.hooks import (DETAILS, DUPLICATE, HookEvent, HookKind, Hooks, KvRange, QueueDepth, Ranks, Reason,
                         Restart, SessionBinding)
from kvemu.kv_events import BlockStored, KVEventBatch
from kvemu.queue import PolicyQueue, QueueClass

from harness.run.runner import run_scenario
from harness.scenario import parse_scenario
from tests.harness.test_chaos_virtual import BASE
from tests.harness.test_disagg import SCENARIO as DISAGG, req as disagg_req, run_requests
from tests.kvemu.runtime.test_router import BS, cluster, req, run

CHAOS = BASE.replace("ttl_secs: 30", "ttl_secs: 1").replace("think_time_s: 0.5", "think_time_s: 2") + """
chaos:
  - {at_s: 2, action: drop_kv_events, worker: 0, count: 3}
  - {at_s: 3, action: kill_rank, worker: 2, dp_rank: 1}
  - {at_s: 4, action: remove_worker, worker: 1, graceful: false}
  - {at_s: 5, action: remove_worker, worker: 0, graceful: true}
"""


@contextmanager
def _every_event() -> Iterator[list[HookEvent]]:
    """Every event any ``Hooks`` emits meanwhile (pools' own hubs included), each hub made meanwhile having an
    observer of every kind (a hub builds an event only for a listener)."""
    seen: list[HookEvent] = []
    emit = Hooks.emit
    init = Hooks.__init__

    def keep(self: Hooks, event: HookEvent) -> None:
        seen.append(event)
        emit(self, event)

    def listened(self: Hooks) -> None:
        init(self)
        self.subscribe(lambda ev: None)

    Hooks.emit = keep  # type: ignore[method-assign]
    Hooks.__init__ = listened  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Hooks.emit = emit  # type: ignore[method-assign]
        Hooks.__init__ = init  # type: ignore[method-assign]


@functools.cache
def _virtual_run_with_chaos() -> list[HookEvent]:
    """A virtual run with sessions, dropped KV events, a rank down, a worker killed and one drained."""
    with _every_event() as seen:
        run_scenario(parse_scenario(CHAOS), None)
    return seen


@functools.cache
def _disaggregated_run_losing_a_prefill_worker() -> list[HookEvent]:
    """Prefill worker 0 dies while its KV waits for a slow link: the requests start over (``retried``)."""
    slow = DISAGG.replace("kv_transfer_bandwidth: 0.05", "kv_transfer_bandwidth: 0.0002")

    async def kill(c) -> None:
        await anyio.sleep(0.15)
        await c.remove_worker(0, graceful=False)

    with _every_event() as seen:
        run_requests([(0.001 * i, disagg_req(f"r{i}", 400, 10, base=1000 * i)) for i in range(8)], chaos=kill,
                     text=slow)
    return seen


def _batch(start: int) -> KVEventBatch:
    tokens = list(range(start, start + BS))
    return KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=[start + 1], parent_block_hash=None,
                                                    token_ids=tokens, block_size=BS)])


@functools.cache
def _router_by_hand() -> list[HookEvent]:
    """A router fed by hand: a queue, a duplicate id, a KV stream that skips, loses and restarts, a session moved."""
    with _every_event() as seen:
        clock, router, ws, _ = cluster([1])
        core = router.core
        router.queue = PolicyQueue(classes=[QueueClass(busy_threshold=0)],  # busy while a prefill is in flight
                                   prefill_tokens=lambda k: core.load.rank(k).active_prefill_tokens
                                   if core.load.rank(k) else 0)
        router.affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=30, mode=AffinityMode.SOFT)
        router.affinity.observer = router._affinity_event
        bus = ws[0].bus
        bus.buffer_steps = 1  # a replay brings back one batch at most: the rest is lost

        async def body() -> None:
            for rid, tokens in (("same", None), ("same", None), ("other", list(range(100, 116)))):
                router.submit(req(rid, tokens), lambda record: None)  # the second is refused; the third queues
            pub = bus.publisher(1, 0)
            pub.publish(_batch(0))
            pub.drop_next = 3
            for i in range(1, 5):
                pub.publish(_batch(i * BS))  # 1..3 dropped, 4 shows a gap; the replay finds 4 only
            pub.restart()
            pub.publish(_batch(0))  # sequence 0 again: the engine restarted
            aff = router.affinity
            assert aff is not None
            aff.commit(aff.try_acquire("s"), (1, 0))
            aff.commit(aff.try_acquire("s"), (1, 1))  # soft affinity follows the dispatch: rebound
            await anyio.sleep(5)

        run(clock, router, ws, body)
    return seen


PROVOKED: dict[HookKind, Callable[[], list[HookEvent]]] = {
    **{k: _virtual_run_with_chaos for k in HookKind},
    HookKind.RETRIED: _disaggregated_run_losing_a_prefill_worker,
    HookKind.QUEUED: _router_by_hand, HookKind.KV_LOST: _router_by_hand, HookKind.KV_RESTART: _router_by_hand,
    HookKind.AFFINITY_REBOUND: _router_by_hand,
}
"""Which run emits each kind (every kind must be emitted by one)."""


def test_every_kind_declares_its_details_type_and_documents_it() -> None:
    text = Path(kvemu.hooks.__file__).read_text()
    for kind in HookKind:
        assert kind in DETAILS, f"{kind} declares no details type in kvemu.hooks.DETAILS"
        declared = DETAILS[kind]
        types = get_args(declared) if isinstance(declared, UnionType) else (declared,)
        doc = re.search(rf'{kind.name} = "{kind.value}"\n    """(.*?)"""', text, re.S)
        assert doc is not None
        for t in types:
            if t is NoneType:
                continue
            assert f"``{t.__name__}``" in doc.group(1), f"{kind}'s docstring does not name {t.__name__}"
    assert set(DETAILS) == set(HookKind)


@pytest.mark.parametrize("kind", list(HookKind))
def test_the_emitted_details_have_the_kinds_type(kind: HookKind) -> None:
    assert kind in DETAILS, f"{kind} declares no details type"
    events = [e for e in PROVOKED[kind]() if e.kind == kind]
    assert events, f"{PROVOKED[kind].__name__} emitted no {kind}"
    wrong = [type(e.details).__name__ for e in events if not isinstance(e.details, DETAILS[kind])]
    assert not wrong, f"{kind} carried {sorted(set(wrong))}, not {DETAILS[kind]}"


def test_a_refused_duplicate_a_kv_gap_and_a_pool_workers_removal_say_so_in_their_details() -> None:
    failed = [e for e in _router_by_hand() if e.kind == HookKind.FAILED]
    assert [e.request_id for e in failed if e.details is DUPLICATE] == ["same"]
    assert isinstance(next(e for e in _router_by_hand() if e.kind == HookKind.QUEUED).details, QueueDepth)
    kv = [(e.kind, e.details) for e in _router_by_hand() if e.kind.startswith("kv_") and e.worker_id == 1]
    assert (HookKind.KV_GAP, KvRange(1, 4)) in kv
    removed = [e for e in _disaggregated_run_losing_a_prefill_worker() if e.kind == HookKind.WORKER_REMOVED]
    # the pool router's own event, then the coordinator's copy naming the pool
    assert [(e.pool, e.details) for e in removed if e.worker_id == 0] == [
        (None, Reason("missed heartbeats")), ("prefill", Reason("missed heartbeats"))]
    assert any(isinstance(e.details, Restart) for e in _disaggregated_run_losing_a_prefill_worker())


def test_data_is_a_deprecated_dict_view_of_the_details() -> None:
    ev = HookEvent(HookKind.KV_GAP, 1, None, 3, 0, KvRange(5, 9), pool="prefill")
    with pytest.warns(DeprecationWarning, match="HookEvent.details"):
        assert ev.data == {"from": 5, "to": 9, "pool": "prefill"}
    with pytest.warns(DeprecationWarning):
        assert HookEvent(HookKind.WORKER_ADDED, 1, details=Ranks(2, 4)).data == {"dp_size": 2, "dp_start": 4}
    with pytest.warns(DeprecationWarning):
        assert HookEvent(HookKind.COMPLETED, 1, "r").data is None
    with pytest.warns(DeprecationWarning):
        assert HookEvent(HookKind.AFFINITY_BOUND, 1, details=SessionBinding("s", "decode"),
                         pool="decode").data == {"session": "s", "pool": "decode"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HookEvent(HookKind.WORKER_FENCED, 1, details=Reason("draining")).details == Reason("draining")

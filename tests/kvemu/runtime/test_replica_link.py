"""ReplicaEnds: a worker's messages reach the replica they belong to, and only that replica may act on a request."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvemu.clock import ManualClock
from kvemu.messages import (Abort, Dispatch, DispatchAck, Finished, Heartbeat, Register, RegisterAck, Reregister,
                            ReleaseKv, RequestFailed, TokenBatch)
from kvemu.runtime.loop import run_virtual
from kvemu.runtime.replica_link import ReplicaEnds

REPLICAS = 3
IDS = ["a", "b", "c", "d"]


class _End:
    """A fake replica end: what the worker sent to it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_nowait(self, msg: Any) -> None:
        self.sent.append(msg)

    async def serve(self, handler: Any) -> None:  # pragma: no cover - the tests call receive() directly
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        pass


def _link(n: int = REPLICAS) -> tuple[ReplicaEnds, list[_End], list[Any]]:
    ends = [_End() for _ in range(n)]
    link = ReplicaEnds(ends)  # type: ignore[arg-type]
    got: list[Any] = []
    link.bind(got.append)
    return link, ends, got


def _dispatch(rid: str, hold: bool = False) -> Dispatch:
    return Dispatch(request_id=rid, dp_rank=0, tokens=[1, 2, 3], max_tokens=4, kv_hold=hold)


class ReplicaLinkVsModel(RuleBasedStateMachine):
    """Random dispatches, answers, aborts and releases from three replicas, against a model of who owns what."""

    def __init__(self) -> None:
        super().__init__()
        self.link, self.ends, self.got = _link()
        self.owner: dict[str, int] = {}
        self.held: dict[str, int] = {}

    def _last(self, i: int) -> Any:
        return self.ends[i].sent[-1] if self.ends[i].sent else None

    @rule(i=st.integers(0, REPLICAS - 1), rid=st.sampled_from(IDS), hold=st.booleans())
    def dispatch(self, i: int, rid: str, hold: bool) -> None:
        before = len(self.got)
        self.link.receive(i, _dispatch(rid, hold))
        if rid in self.owner or (hold and rid in self.held):
            ack = self._last(i)
            assert type(ack) is DispatchAck and not ack.accepted and ack.request_id == rid
            assert len(self.got) == before  # the worker never sees it
        else:
            assert self.got[-1].request_id == rid
            self.owner[rid] = i
            if hold:
                self.held[rid] = i

    @rule(rid=st.sampled_from(IDS), kind=st.sampled_from(["token", "finish", "fail", "refuse", "accept"]))
    def worker_says(self, rid: str, kind: str) -> None:
        msg = {"token": TokenBatch(request_id=rid, times_ns=[1]), "finish": Finished(request_id=rid, times_ns=[2]),
               "fail": RequestFailed(request_id=rid, reason="x"),
               "refuse": DispatchAck(request_id=rid, accepted=False, reason="x"),
               "accept": DispatchAck(request_id=rid, accepted=True)}[kind]
        sizes = [len(e.sent) for e in self.ends]
        self.link.send_nowait(msg)
        i = self.owner.get(rid)
        for j, e in enumerate(self.ends):  # only the owner hears it
            assert len(e.sent) == sizes[j] + (j == i)
        if i is not None and kind in ("finish", "fail", "refuse"):
            del self.owner[rid]
            if kind != "finish":
                self.held.pop(rid, None)

    @rule(i=st.integers(0, REPLICAS - 1), rid=st.sampled_from(IDS), release=st.booleans())
    def replica_acts(self, i: int, rid: str, release: bool) -> None:
        before, foreign = len(self.got), self.link.foreign
        self.link.receive(i, ReleaseKv(request_id=rid) if release else Abort(request_id=rid))
        owner = None if release else self.owner.get(rid)
        if owner is None:
            owner = self.held.get(rid)
        if owner == i:
            assert len(self.got) == before + 1
            if not release:
                self.owner.pop(rid, None)
            self.held.pop(rid, None)
        else:
            assert len(self.got) == before and self.link.foreign == foreign + 1

    @rule()
    def heartbeat(self) -> None:
        self.link.send_nowait(Heartbeat(worker_id=1))
        assert all(type(e.sent[-1]) is Heartbeat for e in self.ends)

    @invariant()
    def tables_match(self) -> None:
        assert self.link.owner == self.owner and self.link.held == self.held


TestReplicaLinkVsModel = ReplicaLinkVsModel.TestCase
TestReplicaLinkVsModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_registration_is_per_replica():
    link, ends, got = _link()
    reg = Register(worker_id=7)
    link.send_nowait(reg)
    assert all(e.sent == [reg] for e in ends)
    link.receive(1, RegisterAck(worker_id=7, accepted=True))
    link.receive(0, RegisterAck(worker_id=7, accepted=True))
    assert [type(m) for m in got] == [RegisterAck]  # the worker hears the first acceptance only
    link.receive(0, Reregister())  # replica 0 restarted: it alone is asked again
    assert ends[0].sent[-1] is reg and len(ends[1].sent) == 1 and len(ends[2].sent) == 1
    link.send_nowait(reg)  # the worker's own retry goes to replicas that have not accepted it
    assert len(ends[1].sent) == 1 and ends[2].sent[-1] is reg
    link.receive(2, RegisterAck(worker_id=7, accepted=False, reason="no"))  # one refuses for good: the others serve
    assert [type(m) for m in got] == [RegisterAck]


def test_a_worker_refused_by_every_replica_hears_the_refusal():
    link, _ends, got = _link(2)
    link.send_nowait(Register(worker_id=7))
    link.receive(0, RegisterAck(worker_id=7, accepted=False, reason="full"))
    assert got == []
    link.receive(1, RegisterAck(worker_id=7, accepted=False, reason="full"))
    assert [m.accepted for m in got] == [False]


def test_a_rate_limited_replica_is_asked_again_after_its_retry_time():
    clock = ManualClock()

    async def main() -> None:
        link, ends, got = _link(2)
        async with anyio.create_task_group() as tg:
            link._tg = tg
            reg = Register(worker_id=7)
            link.send_nowait(reg)
            link.receive(0, RegisterAck(worker_id=7, accepted=True))
            link.receive(1, RegisterAck(worker_id=7, accepted=False, reason="rate_limited", retry_after_s=2.5))
            assert len(ends[1].sent) == 1
            await anyio.sleep(2.4)
            assert len(ends[1].sent) == 1
            await anyio.sleep(0.2)
            assert ends[1].sent[-1] is reg and [m.accepted for m in got] == [True]

    run_virtual(main, clock)
    assert clock.now_ns() == 2_600_000_000


def test_at_least_one_end():
    with pytest.raises(ValueError):
        ReplicaEnds([])


def test_a_busy_worker_keeps_every_replica_hearing_from_it():
    """A worker busy with one replica's requests sends no heartbeat (any message proves it alive); the other
    replicas get one once they heard nothing for an interval, so none of them fences a working worker."""
    clock = ManualClock()
    ends = [_End() for _ in range(3)]
    link = ReplicaEnds(ends, clock.now_ns, heartbeat_interval_ns=1000)  # type: ignore[arg-type]
    link.bind(lambda msg: None)
    link.send_nowait(Register(worker_id=7))
    for i in range(3):
        link.receive(i, RegisterAck(worker_id=7, accepted=True))
    link.receive(0, _dispatch("a"))
    beats = [0, 0, 0]
    for t in range(100, 5001, 100):
        clock.advance_to(t)
        link.send_nowait(TokenBatch(request_id="a", times_ns=[t]))
        beats = [sum(type(m) is Heartbeat for m in end.sent) for end in ends]
    assert beats[0] == 0, "the owner hears the tokens"
    assert beats[1] == beats[2] == 5, "the others: one heartbeat per interval of silence"
    assert all(type(m) in (Register, Heartbeat) for end in ends[1:] for m in end.sent)

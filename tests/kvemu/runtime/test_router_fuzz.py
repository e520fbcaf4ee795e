"""The router's whole message handling against arbitrary peers: registrations, replies for any request id
from any connection, departures and time passing, interleaved with client requests. Whatever the peers
send, the router never raises, a reply counts only from the worker the request was dispatched to, load is
booked exactly for dispatched requests, and every request ends exactly once."""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvemu import ManualClock, RoutingCore
from kvemu.lifecycle import DISPATCHED, RUNNING
from kvemu.records import EngineFacts
from kvemu.messages import (
    ClientRequest,
    Deregister,
    DispatchAck,
    Draining,
    Finished,
    Heartbeat,
    RankDown,
    Register,
    RequestFailed,
    TokenBatch,
)
from kvemu.runtime.router import Router, RouterSettings
from kvemu.runtime.transport import MemoryNetwork

PEERS = [b"p0", b"p1", b"p2", b"p3"]
IDS = [f"r{i}" for i in range(6)]
MS = 1_000_000


class RouterVsPeers(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = ManualClock()
        self.router = Router(guarded=False, core=RoutingCore(block_size=4, clock=self.clock), end=MemoryNetwork().router_end(),
                             clock=self.clock, settings=RouterSettings(dispatch_timeout_s=1.0, startup_grace_s=0.0,
                                                                       request_deadline_s=5.0, retry_limit=2))
        self.ended: dict[int, object] = {}
        self.owner: dict[int, int | None] = {}  # submission -> worker it was last dispatched to, at its end
        self.submitted = 0

    @rule(peer=st.sampled_from(PEERS), wid=st.integers(0, 3), dp=st.integers(0, 3))
    def register(self, peer, wid, dp):
        self.router.on_message(peer, Register(worker_id=wid, dp_size=dp, block_size=4))

    @rule(rid=st.sampled_from(IDS), n=st.integers(0, 9))
    def submit(self, rid, n):
        k = self.submitted
        self.submitted += 1

        def on_end(record, k=k):
            assert k not in self.ended, "a request ended twice"
            self.ended[k] = record

        self.router.submit(ClientRequest(request_id=rid, tokens=list(range(1, n + 1)), max_tokens=2), on_end)

    @rule(peer=st.sampled_from(PEERS), rid=st.sampled_from(IDS),
          kind=st.sampled_from(["ack", "refuse", "tokens", "finish", "fail"]))
    def reply(self, peer, rid, kind):
        f = self.router.lifecycle.flights.get(rid)
        before = (f.stage, f.key, f.record.output_tokens) if f is not None else None
        owner = self.router._peers.get(peer)
        t = self.clock.now_ns()
        msg = {"ack": DispatchAck(request_id=rid, accepted=True), "refuse": DispatchAck(request_id=rid, accepted=False),
               "tokens": TokenBatch(request_id=rid, times_ns=[t]),
               "finish": Finished(request_id=rid, times_ns=[t], engine=EngineFacts(cached_tokens=0, admitted_ns=t)),
               "fail": RequestFailed(request_id=rid, reason="engine_error")}[kind]
        self.router.on_message(peer, msg)
        if f is not None and (owner is None or before[1] is None or before[1][0] != owner
                              or before[0] not in (DISPATCHED, RUNNING)):
            after = self.router.lifecycle.flights.get(rid)
            assert after is f and (f.stage, f.key, f.record.output_tokens) == before, "a stranger's reply counted"

    @rule(peer=st.sampled_from(PEERS), wid=st.integers(0, 3), rank=st.integers(0, 2),
          kind=st.sampled_from(["heartbeat", "draining", "rank_down", "deregister"]))
    def worker_says(self, peer, wid, rank, kind):
        msg = {"heartbeat": Heartbeat(worker_id=wid), "draining": Draining(worker_id=wid),
               "rank_down": RankDown(worker_id=wid, dp_rank=rank), "deregister": Deregister(worker_id=wid)}[kind]
        self.router.on_message(peer, msg)

    @rule(ms=st.integers(0, 3000))
    def time_passes(self, ms):
        self.clock.advance(ms * MS)
        self.router._on_time()

    @invariant()
    def load_is_booked_exactly_for_dispatched_requests(self):
        flights = self.router.lifecycle.flights
        booked = {r for r, f in flights.items() if f.stage in (DISPATCHED, RUNNING)}
        assert {r for r in booked if self.router.core.load.booked_rank(r) is not None} == booked
        assert len(self.router.core.load) == len(booked)
        assert len(flights) + len(self.ended) <= self.submitted

    def teardown(self):
        self.router.stop("test_over")
        assert not self.router.lifecycle.flights and len(self.router.core.load) == 0
        assert len(self.ended) == self.submitted  # every request ended, once
        reasons = {(getattr(r, "failure", None) or "").split(":")[0] or None for r in self.ended.values()}
        if None in reasons:
            event("a request completed")
        if reasons & {"deadline_exceeded", "duplicate_request_id", "worker_lost", "retries_exhausted"}:
            event("a request failed for a lifecycle reason")


TestRouterVsPeers = RouterVsPeers.TestCase
TestRouterVsPeers.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

"""The load generator's routing truth from KV events (``harness.procs.truth_oracle``): real ZeroMQ publishers on
127.0.0.1, events in, each request's truth and the class of its lost blocks out, as the engines' probe classes them."""

from __future__ import annotations

import pytest

from kvemu.messages import ClientRequest, Register
from kvemu.records import RequestRecord

from harness.procs.truth_oracle import TruthOracle
from harness.scenario import ScenarioError, parse_scenario
from harness.run.routing_truth import RegretJudge, RoutingTruth
from tests.kvemu.wire.test_sockets import BS, batch, chain_events, net, prompt, wait_until  # noqa: F401 (fixture)

A, B, C = prompt(1, 8), prompt(2, 6), prompt(3, 5)


@pytest.fixture
def cluster(net):  # noqa: F811 - the fixture imported above
    """Worker 0 (ranks 0 and 1) and worker 1 (rank 0), a publisher per rank; an oracle following them."""
    pubs = {key: net.publisher(dp_rank=key[1]) for key in ((0, 0), (0, 1), (1, 0))}
    regs = [Register(worker_id=0, dp_size=2, block_size=BS, kv_endpoints=[pubs[0, 0].endpoint, pubs[0, 1].endpoint],
                     kv_replay_endpoints=[pubs[0, 0].replay_endpoint, pubs[0, 1].replay_endpoint]),
            Register(worker_id=1, dp_size=1, block_size=BS, kv_endpoints=[pubs[1, 0].endpoint],
                     kv_replay_endpoints=[pubs[1, 0].replay_endpoint])]
    oracle = TruthOracle(BS)
    oracle.learn(regs)
    yield oracle, pubs, regs
    oracle.close()


def store(pubs, key, tokens, blocks, oracle, want: dict) -> None:
    """Rank ``key`` publishes the store of ``tokens``' first ``blocks``; wait until the oracle sees ``want``."""
    pubs[key].publish(batch(*chain_events(tokens, last=blocks)))
    sub = oracle.kv.subscriber
    core = oracle.core

    def seen():
        return core.overlaps(core.prepare(tokens)) == want

    wait_until(seen, [sub], tick=lambda: [p.publish(batch()) for p in pubs.values()], what=f"{want}, seeing {core.overlaps(core.prepare(tokens))}")


def req(rid: str, tokens, session: str | None = None) -> ClientRequest:
    return ClientRequest(request_id=rid, tokens=tokens, max_tokens=4, session_id=session)


def routed(rid: str, key, session: str | None = None) -> RequestRecord:
    return RequestRecord(request_id=rid, session_id=session, worker_id=key[0], dp_rank=key[1], routed_ns=1,
                         isl=128)


def truth(rec: RequestRecord):
    return rec.truth_overlap_blocks, rec.truth_best_overlap_blocks, rec.regret_source


def test_the_oracle_judges_each_request_from_the_events_as_of_its_send(cluster):
    oracle, pubs, _ = cluster
    assert oracle.ranks() == ((0, 0), (0, 1), (1, 0))
    store(pubs, (1, 0), A, 8, oracle, {(1, 0): 8})
    store(pubs, (0, 1), A, 4, oracle, {(1, 0): 8, (0, 1): 4})
    store(pubs, (0, 1), B, 6, oracle, {(0, 1): 6})

    oracle.sent(req("r1", A, "s"))
    # blocks stored after the send do not count: the truth is the caches as the request left
    store(pubs, (0, 0), A, 8, oracle, {(1, 0): 8, (0, 1): 4, (0, 0): 8})
    rec = routed("r1", (0, 0), "s")
    oracle.judge(rec)
    assert truth(rec) == (0, 8, "shared")  # on worker 1 only: another worker, and session s never ran

    oracle.sent(req("r2", B))
    rec = routed("r2", (0, 0))
    oracle.judge(rec)
    assert truth(rec) == (0, 6, "peer")  # the chosen worker's other rank had them

    store(pubs, (1, 0), C, 5, oracle, {(1, 0): 5})
    oracle.sent(req("r3", C, "t"))
    first = routed("r3", (1, 0), "t")
    oracle.judge(first)
    assert truth(first) == (5, 5, None)  # nothing lost; session t last ran on (1, 0)
    oracle.sent(req("r4", C, "t"))
    rec = routed("r4", (0, 1), "t")
    oracle.judge(rec)
    assert truth(rec) == (0, 5, "cache_owner")  # where the session last ran

    oracle.sent(req("r5", A))
    failed = RequestRecord(request_id="r5", failure="no_worker")  # never routed: no truth
    oracle.judge(failed)
    assert truth(failed) == (None, None, None)
    oracle.sent(req("r7", []))  # an empty prompt (the router fails it): nothing to read, nothing raised
    unsent = routed("r6", (0, 0))  # never sent through the oracle: no truth either
    oracle.judge(unsent)
    assert truth(unsent) == (None, None, None)
    assert oracle.judged == 4 and not oracle._pending
    feed = oracle.feed()
    assert feed["batches"] >= 5 and feed["lost_batches"] == 0  # (the stores, and the probes while waiting)


def test_a_worker_no_replica_lists_any_more_is_forgotten(cluster):
    oracle, pubs, regs = cluster
    store(pubs, (1, 0), A, 8, oracle, {(1, 0): 8})
    oracle.learn(regs, replica=1)
    oracle.learn(regs[:1], replica=0)  # replica 1 still lists worker 1
    assert oracle.ranks() == ((0, 0), (0, 1), (1, 0))
    oracle.learn(regs[:1], replica=1)
    assert oracle.ranks() == ((0, 0), (0, 1))
    oracle.sent(req("r1", A))
    rec = routed("r1", (0, 0))
    oracle.judge(rec)
    assert truth(rec) == (0, 0, None)  # its cache went with it
    oracle.learn(regs, replica=1)  # listed again (a restarted router): rebuilt from its publisher's replay buffer
    sub, core = oracle.kv.subscriber, oracle.core
    wait_until(lambda: core.overlaps(core.prepare(A)) == {(1, 0): 8}, [sub], tick=lambda: pubs[1, 0].publish(batch()),
               what="worker 1's cache replayed")


def test_the_judge_classes_as_the_engines_probe_does():
    """``RoutingTruth`` is ``RegretJudge`` over what the engines hold: the same decisions, the same classes."""
    held = {(0, 0): {1: 3}, (0, 1): {1: 5, 2: 2}, (1, 0): {1: 5, 2: 4}}

    class Core:
        def __init__(self, have):
            self.have = have

        def cached_prefix_blocks(self, hashes):
            return self.have.get(hashes[0], 0)

    probe = RoutingTruth(lambda w, r: Core(held[(w, r)]))
    judge = RegretJudge()
    ranks = ((0, 0), (0, 1), (1, 0))
    for prompt_id, chosen, session in [(1, (1, 0), "s"), (2, (0, 0), "s"), (1, (0, 0), None), (2, (0, 1), "s")]:
        have = {k: held[k].get(prompt_id, 0) for k in ranks}
        assert probe([prompt_id], ranks, chosen, session) == judge(have, ranks, chosen, have[chosen], session)
    # session s last ran on (0, 1): its blocks there are the cache owner's, elsewhere shared
    assert judge({(0, 1): 4, (1, 0): 0}, ((0, 1), (1, 0)), (1, 0), 0, "s") == (0, 4, "cache_owner")
    assert judge({(0, 1): 4, (1, 0): 0}, ((0, 1), (1, 0)), (1, 0), 0, "u") == (0, 4, "shared")


def test_event_truth_with_a_disaggregated_cluster_is_refused_naming_the_field():
    with pytest.raises(ScenarioError) as err:
        parse_scenario("name: bad\ncluster: {prefill: {workers: 1}, decode: {workers: 1}}\nrun: {event_truth: true}\n")
    assert "run.event_truth" in str(err.value)
    assert parse_scenario("name: ok\nrun: {event_truth: true}\n").run.event_truth

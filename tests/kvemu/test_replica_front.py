"""ReplicaFront: how requests spread over router replicas."""

from __future__ import annotations

from collections import Counter

import pytest

from kvemu.errors import InvalidArgument
from kvemu.replica_front import ReplicaFront, ReplicaFrontDoor


def test_round_robin_takes_replicas_in_turn():
    front = ReplicaFront(3)
    assert [front.pick(f"s{i}") for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_session_hashing_keeps_a_session_on_one_replica_and_spreads_sessions():
    front = ReplicaFront(4, "session")
    picks = {s: front.pick(s) for s in (f"session-{i}" for i in range(400))}
    assert all(front.pick(s) == r for s, r in picks.items())  # every later turn lands where the first did
    counts = Counter(picks.values())
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 60
    assert [front.pick(None) for _ in range(3)] == [0, 1, 2]  # no session: round robin


def test_random_is_seeded_and_uniform():
    a = [ReplicaFront(4, "random", seed=5).pick() for _ in range(1)]
    fa, fb, fc = ReplicaFront(4, "random", seed=5), ReplicaFront(4, "random", seed=5), ReplicaFront(4, "random", 6)
    sa = [fa.pick() for _ in range(400)]
    assert sa == [fb.pick() for _ in range(400)] and sa != [fc.pick() for _ in range(400)] and a == sa[:1]
    assert min(Counter(sa).values()) > 70


def test_one_replica_always_gets_everything():
    assert {ReplicaFront(1, mode).pick("s") for mode in ("round_robin", "random", "session")} == {0}


@pytest.mark.parametrize("kwargs, field", [({"replicas": 0}, "replicas"), ({"replicas": 2, "mode": "hash"},
                                                                              "replica_front")])
def test_bad_settings_name_their_field(kwargs, field):
    with pytest.raises(InvalidArgument) as exc:
        ReplicaFront(**kwargs)
    assert exc.value.field == field


class _Replica:
    """A replica that ends requests when told: what it was given and cancelled."""

    def __init__(self) -> None:
        self.open: dict = {}
        self.cancelled: list = []

    def submit(self, req, on_end):
        self.open[req.request_id] = on_end
        return req.request_id

    def cancel(self, request_id, reason="cancelled"):
        if request_id not in self.open:
            return False
        self.cancelled.append((request_id, reason))
        return True

    def end(self, request_id):
        self.open.pop(request_id)(request_id)


class _Req:
    def __init__(self, rid, session=None):
        self.request_id, self.session_id = rid, session


def test_the_front_door_cancels_at_the_replica_a_request_went_to():
    replicas = [_Replica(), _Replica()]
    door = ReplicaFrontDoor(replicas, ReplicaFront(2))
    ended = []
    door.submit(_Req("a"), ended.append)
    door.submit(_Req("b"), ended.append)
    assert door.cancel("b", "deadline") and replicas[1].cancelled == [("b", "deadline")]
    assert replicas[0].cancelled == []
    replicas[0].end("a")
    assert ended == ["a"] and not door.cancel("a"), "an ended request is not the front's any more"
    assert door.replica_of == {"a": 0, "b": 1}


def test_a_server_front_door_keeps_only_its_open_requests():
    replicas = [_Replica(), _Replica()]
    door = ReplicaFrontDoor(replicas, ReplicaFront(2), keep_history=False)
    for i in range(100):
        door.submit(_Req(f"r{i}"), lambda _r: None)
        replicas[i % 2].end(f"r{i}")
    assert door.replica_of is None and door.open == {}


def test_prefix_hashing_sends_prompts_that_start_alike_to_one_replica():
    front = ReplicaFront(4, "prefix", prefix_tokens=3)
    picks = {p: front.pick(None, [p, p + 1, p + 2, 99]) for p in range(200)}
    assert all(front.pick("any", [p, p + 1, p + 2, 7, 7]) == r for p, r in picks.items())  # only the head counts
    assert set(Counter(picks.values())) == {0, 1, 2, 3}
    assert [front.pick(None, []) for _ in range(3)] == [0, 1, 2]  # no prompt: round robin
    with pytest.raises(InvalidArgument, match="replica_prefix_tokens"):
        ReplicaFront(2, "prefix", prefix_tokens=0)

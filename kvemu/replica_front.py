"""Which router replica a request reaches (``router.replica_front``), as the load balancer in front of them picks.

* ``round_robin``: replicas in turn.
* ``random``: uniformly, from this front's own seeded generator.
* ``session``: a hash of the session id, so every turn of a session reaches one replica (the consistent hashing
  vllm-router and SGLang's gateway offer on a session header); a request without a session goes round robin.
* ``prefix``: a hash of the prompt's first ``prefix_tokens`` tokens, so prompts that start alike (a
  conversation's turns, when the trace names no session) reach one replica, as SGLang's gateway's
  ``prefix_hash`` policy picks a worker.

Sans-IO and deterministic: the same requests in the same order reach the same replicas.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Literal, Protocol

import xxhash

from kvemu.errors import InvalidArgument
from kvemu.messages import ClientRequest
from kvemu.records import RequestRecord

__all__ = ["ReplicaFront", "ReplicaFrontDoor", "FRONT_MODES", "FrontMode"]

FrontMode = Literal["round_robin", "random", "session", "prefix"]
FRONT_MODES: tuple[FrontMode, ...] = ("round_robin", "random", "session", "prefix")
MAX_PREFIX_TOKENS = 1 << 20


class ReplicaFront:
    """Picks one of ``replicas`` router replicas per request."""

    __slots__ = ("replicas", "mode", "prefix_tokens", "_next", "_rng")

    def __init__(self, replicas: int, mode: FrontMode = "round_robin", seed: int = 0, prefix_tokens: int = 256) -> None:
        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidArgument(f"router.replicas must be an integer >= 1, got {replicas!r}", field="replicas")
        if mode not in FRONT_MODES:
            raise InvalidArgument(f"router.replica_front must be one of {', '.join(FRONT_MODES)}, got {mode!r}",
                                  field="replica_front")
        if not isinstance(prefix_tokens, int) or not 1 <= prefix_tokens <= MAX_PREFIX_TOKENS:
            raise InvalidArgument(f"router.replica_prefix_tokens must be an integer in 1..{MAX_PREFIX_TOKENS}, got "
                                  f"{prefix_tokens!r}", field="replica_prefix_tokens")
        self.replicas = replicas
        self.mode = mode
        self.prefix_tokens = prefix_tokens
        self._next = 0
        self._rng = random.Random(f"kvemu-replica-front:{seed}")

    def pick(self, session_id: str | None = None, tokens: Iterable[int] = ()) -> int:
        """The replica for the next request (of ``session_id``, if it has one; with prompt ``tokens``)."""
        n = self.replicas
        if n == 1:
            return 0
        if self.mode == "session" and session_id is not None:
            return xxhash.xxh3_64_intdigest(session_id.encode()) % n
        if self.mode == "prefix":
            head = array("Q", islice(tokens, self.prefix_tokens))
            if head:
                return xxhash.xxh3_64_intdigest(head.tobytes()) % n
        if self.mode == "random":
            return self._rng.randrange(n)
        i = self._next
        self._next = (i + 1) % n
        return i


    def pick_request(self, req: ClientRequest) -> int:
        """The replica for request ``req`` (a ``ClientRequest``: its session id, and its prompt for ``prefix``)."""
        return self.pick(req.session_id, req.tokens if self.mode == "prefix" else ())


class Front(Protocol):
    """Where requests go: something they are submitted to and cancelled at (a router, a ``DisaggRouter`` over two
    pools, or a ``ReplicaFrontDoor`` over replicas, each of which is one)."""

    def submit(self, req: ClientRequest, on_end: Callable[[RequestRecord], None]) -> RequestRecord: ...

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool: ...


class ReplicaFrontDoor:
    """The load balancer in front of router replicas, in one process: each request goes to the replica
    ``ReplicaFront`` picks, and its cancel to the same one. ``replicas`` is the owner's list, read at each
    request: its ``replicas[i]`` may be replaced (a restarted replica)."""

    def __init__(self, replicas: Sequence[Front], front: ReplicaFront, keep_history: bool = True) -> None:
        if len(replicas) != front.replicas:
            raise InvalidArgument(f"{len(replicas)} replicas for a front of {front.replicas}", field="replicas")
        self.replicas = replicas
        self.front = front
        self.replica_of: dict[str, int] | None = {} if keep_history else None
        """Each request id submitted: the replica it went to (a run's report groups by it); None: not kept (a
        server that runs for ever keeps only its open requests')."""
        self.open: dict[str, int] = {}
        """Requests not ended yet: their replica (a cancel goes there)."""

    def submit(self, req: ClientRequest, on_end: Callable[[RequestRecord], None]) -> RequestRecord:
        """Submit ``req`` to its replica; returns that replica's record."""
        rid = req.request_id
        i = self.front.pick_request(req)
        if self.replica_of is not None:
            self.replica_of.setdefault(rid, i)  # (a reused id keeps its first, as the run's records do)
        opened = self.open

        def ended(record: RequestRecord) -> None:
            if opened.get(rid) == i:
                del opened[rid]
            on_end(record)

        opened.setdefault(rid, i)
        return self.replicas[i].submit(req, ended)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel a request at the replica it went to (False: unknown, or over)."""
        i = self.open.get(request_id)
        return i is not None and self.replicas[i].cancel(request_id, reason)

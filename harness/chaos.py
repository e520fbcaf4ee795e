"""The chaos timeline on real processes: control messages to a router process, and who applies what.

A supervisor (``kvemu up``) or a load generator (``kvemu loadgen --chaos apply``, as in docker-compose) sends
``Control`` to the router on the client socket. The router checks the shared control token, restarts itself
(``restart_router``) or forwards a ``Chaos`` message to the worker it names, which applies the fault to itself.
Starting and stopping worker processes (``add_worker``, ``remove_worker``) is for a supervisor only, and so is
``WorkerExited``: a worker process it runs exited unasked, so the router fences it at once, and ``SyncPeers``:
where a router replica's peers publish their sync batches.

Every place that applies chaos (the in-process cluster of ``harness.run.runner``, a router process's control channel,
``kvemu fleet``) is a ``ChaosHost``; ``apply_chaos`` is the one map from an event onto a host's capabilities.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, NamedTuple, Protocol

import msgspec
from msgspec import Meta

from kvemu.clock import NS_PER_S
from kvemu.limits import Text
from kvemu.messages import WORKER_CHAOS, Chaos
from kvemu.replica_sync import MAX_REPLICAS

from harness.scenario import ChaosAction, ChaosEvent

__all__ = ["Control", "ControlReply", "WorkerExited", "SyncPeers", "CONTROL_TOKEN_ENV", "ROUTER_CHAOS",
           "SUPERVISOR_CHAOS", "Outcome", "ChaosHost", "RouterlessHost", "apply_chaos", "worker_chaos", "ChaosMark", "timeline",
           "chaos_problems", "REPLAYING", "SILENCING"]

CONTROL_TOKEN_ENV = "KVEMU_CONTROL_TOKEN"
"""The environment variable holding the shared control token; a router without one refuses every control."""
ROUTER_CHAOS = frozenset({*WORKER_CHAOS, "restart_router"})
"""Actions applied through the router's control channel."""
SUPERVISOR_CHAOS = frozenset({"add_worker", "remove_worker"})
"""Actions that start or stop worker processes."""
MAX_TOKEN_BYTES = 256
"""Longest control token (``up`` makes 32 hex characters); a longer one is refused at decoding."""
Token = Annotated[str, Meta(max_length=MAX_TOKEN_BYTES)]


class Control(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Apply one chaos event now (client → router)."""

    token: Token
    event: ChaosEvent


class WorkerExited(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """A worker's process exited unasked (supervisor → router): fence it now instead of after its heartbeat
    timeout, and say how in its ``worker_removed`` event."""

    token: Token
    worker_id: Annotated[int, Meta(ge=0, le=1 << 31)]
    how: Annotated[str, Meta(max_length=64)]
    """``signal SIGKILL``, ``code 1``."""


class SyncPeers(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Where the other router replicas publish their sync batches (supervisor → router replica): subscribe to
    each (``router.replica_sync``; a replica's endpoint is known only once it started, so it comes after)."""

    token: Token
    peers: Annotated[dict[Annotated[int, Meta(ge=0, lt=MAX_REPLICAS)], Annotated[str, Meta(max_length=256)]],
                     Meta(max_length=MAX_REPLICAS)]


class ControlReply(msgspec.Struct, tag=True, frozen=True):
    """Whether the router applied (or forwarded) the event, and what it did or why not."""

    ok: bool
    detail: Text = ""


def worker_chaos(ev: ChaosEvent) -> Chaos:
    """The message that makes a worker apply ``ev`` to itself."""
    return Chaos(action=ev.action, dp_rank=ev.dp_rank, count=ev.count, lag_ms=ev.lag_ms,  # type: ignore[arg-type]
                 factor=ev.factor)


class Outcome(NamedTuple):
    """What a host did with a chaos event: applied it (and what it did), or not (and why)."""

    ok: bool
    detail: str = ""


class ChaosHost(Protocol):
    """What a place that applies chaos can do, one method per capability. A host that cannot do one says why in
    its ``Outcome``; every host subclasses this, so mypy checks it implements each (``apply_chaos`` calls them)."""

    async def add_worker(self) -> Outcome:
        """Start one more worker (in the last pool)."""
        ...

    async def remove_worker(self, worker: int | None, graceful: bool) -> Outcome:
        """Stop ``worker`` (None: the first running one), letting its requests finish when ``graceful``."""
        ...

    async def restart_router(self, replica: int) -> Outcome:
        """The router (replica ``replica``) dies and a new one starts in its place."""
        ...

    async def delay_kv_events(self, replica: int | None, lag_ms: float) -> Outcome:
        """KV events arrive ``lag_ms`` late from now on: on replica ``replica``'s own feed, or (None) from every
        worker's publishers, present and future."""
        ...

    async def drop_kv_events(self, replica: int, count: int) -> Outcome:
        """Replica ``replica``'s own KV feed loses its next ``count`` batches."""
        ...

    async def to_worker(self, worker: int | None, msg: Chaos) -> Outcome:
        """``worker`` (None: the first one) applies ``msg`` to itself (``WorkerActor.apply_chaos``)."""
        ...


class RouterlessHost(ChaosHost):
    """A host with workers and no router (``kvemu fleet``): the router's own faults are refused here, in one place
    (a new router capability adds its refusal here, not in each such host)."""

    who = "this host"
    """Who refuses, in the refusal (``kvemu fleet``)."""

    async def restart_router(self, replica: int) -> Outcome:
        return Outcome(False, f"{self.who} has no router to restart")

    async def delay_kv_events(self, replica: int | None, lag_ms: float) -> Outcome:
        """A replica's feed: refused; else every worker's publishers, present and future (``delay_workers``), as
        the router and the in-process cluster do."""
        if replica is not None:
            return self._no_feed(replica)
        return await self.delay_workers(lag_ms)

    async def delay_workers(self, lag_ms: float) -> Outcome:
        """Every running worker's KV events ``lag_ms`` late from now on, and every worker started later."""
        raise NotImplementedError

    async def drop_kv_events(self, replica: int, count: int) -> Outcome:
        return self._no_feed(replica)

    def _no_feed(self, replica: int) -> Outcome:
        return Outcome(False, f"{self.who} has no router replica {replica}: its KV feed is the router's")


def _to_worker(host: ChaosHost, ev: ChaosEvent) -> Awaitable[Outcome]:
    return host.to_worker(ev.worker, worker_chaos(ev))


_APPLY: dict[ChaosAction, Callable[[ChaosHost, ChaosEvent], Awaitable[Outcome]]] = {
    **{action: _to_worker for action in WORKER_CHAOS},  # a worker applies them to itself, unless below
    "add_worker": lambda host, ev: host.add_worker(),
    "remove_worker": lambda host, ev: host.remove_worker(ev.worker, ev.graceful),
    "restart_router": lambda host, ev: host.restart_router(ev.replica or 0),
    "delay_kv_events": lambda host, ev: host.delay_kv_events(ev.replica, ev.lag_ms),
    "drop_kv_events": lambda host, ev: (host.drop_kv_events(ev.replica, ev.count) if ev.replica is not None
                                        else _to_worker(host, ev)),
}
"""Per chaos action, the host capability that applies it (one row per action of ``ChaosEvent``)."""


def _never(ev: ChaosEvent) -> bool:
    return False


SILENCING: dict[ChaosAction, Callable[[ChaosEvent], bool]] = {
    "remove_worker": lambda ev: not ev.graceful,  # killed: only its silence tells the router (the watchdog)
    "restart_router": lambda ev: True,  # the new router knows an idle worker only from its next heartbeat
    "add_worker": _never,  # it registers, as the first workers do
    "kill_rank": _never,  # the worker says so (``RankDown``) and lives on
    "drop_kv_events": _never,  # KV events: the index's concern, not the worker link's
    "delay_kv_events": _never,
    "slow_worker": _never,  # longer passes: its actor still runs on time and beats when silent
}
"""Per chaos action, whether an event makes a worker's heartbeats observable in an in-process run: it silences a
worker the router must notice, or makes a router that must hear from idle workers (one row per action of
``ChaosEvent``; ``harness.run.wiring.liveness_observable`` reads it)."""

REPLAYING: dict[ChaosAction, Callable[[ChaosEvent], bool]] = {
    "drop_kv_events": lambda ev: True,  # the router sees the gap and asks for the batches it missed
    "delay_kv_events": lambda ev: True,  # a lag that changes can reorder batches: a gap, then a replay
    "restart_router": lambda ev: True,  # the new router rebuilds its index from every rank's buffer
    "add_worker": _never,  # a new id: its buffer is empty when its streams open
    "remove_worker": _never,
    "kill_rank": _never,  # the rank's publisher goes on numbering; nothing asks it to replay
    "slow_worker": _never,
}
"""Per chaos action, whether an event can make a router of an in-process run read a rank's KV replay buffer (one row
per action of ``ChaosEvent``; ``harness.run.wiring.replay_observable`` reads it)."""


async def apply_chaos(host: ChaosHost, ev: ChaosEvent) -> Outcome:
    """Apply one chaos event on ``host``: what it did, or why it could not."""
    return await _APPLY[ev.action](host, ev)


def chaos_problems(events: list[ChaosEvent], applies: frozenset[str], who: str) -> list[str]:
    """One line per event ``who`` cannot apply (empty: it can apply the whole timeline)."""
    return [f"chaos[{i}] {ev.action} at {ev.at_s:g} s cannot be applied by {who}" for i, ev in enumerate(events)
            if ev.action not in applies]


class ChaosMark(msgspec.Struct, frozen=True, kw_only=True):
    """One chaos event as the report marks it on its plots: when (s since the run started), what, and whom."""

    t_s: float
    action: ChaosAction
    replica: int | None = None
    worker: int | None = None
    lag_ms: float | None = None
    """``delay_kv_events``' lag (None for any other action)."""

    @property
    def label(self) -> str:
        """Its short label: its action, target and lag (``restart_router r2``, ``delay_kv_events r1 5000 ms``)."""
        words = [str(self.action)]
        words += [f"r{self.replica}"] if self.replica is not None else []
        words += [f"w{self.worker}"] if self.worker is not None else []
        words += [f"{self.lag_ms:g} ms"] if self.lag_ms is not None else []
        return " ".join(words)


def timeline(events: list[ChaosEvent]) -> list[ChaosMark]:
    """The chaos timeline as the report marks it (``RunData.chaos``): when, what, and whom."""
    return [ChaosMark(t_s=ev.at_s, action=ev.action, replica=ev.replica, worker=ev.worker,
                      lag_ms=ev.lag_ms if ev.action == "delay_kv_events" else None) for ev in events]


def at_ns(ev: ChaosEvent) -> int:
    """When the event happens, in ns since the run started."""
    return round(ev.at_s * NS_PER_S)

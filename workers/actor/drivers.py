"""How a worker actor's engine cores are driven in time: the one seam between virtual and wall time.

The actor acts (admits, aborts, frees held KV) the same way in both modes and asks its ``ModeDriver`` only
what differs: bring the engines to now before acting, re-arm or wake after, start the cores. ``mode_driver``
is the one place that reads the run mode; ``VirtualDriver`` fast-forwards on one re-armable timer
(``Wakeup``), ``LiveDriver`` runs one task per rank that sleeps each forward pass's duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import anyio
import anyio.abc

from kvemu.clock import NS_PER_S, Clock
from kvemu.runtime.wakeup import Wakeup
from workers.rank_engine import RankEngine
from workers.results import StepResult

__all__ = ["DriverHost", "LiveDriver", "ModeDriver", "RunMode", "VirtualDriver", "mode_driver"]

RunMode = Literal["virtual", "live"]
"""Virtual time (fast-forward, exact and reproducible) or wall time (real sleeps, real sockets)."""


class DriverHost(Protocol):
    """What a driver needs from the actor it drives (``WorkerActor`` is one)."""

    clock: Clock
    dead_ranks: set[int]

    @property
    def cores(self) -> Sequence[RankEngine]:
        """Its ranks' engines in rank order."""

    def core(self, dp_rank: int) -> RankEngine:
        """One rank's engine (a new one after a fault)."""

    def catch_up(self) -> None:
        """Advance every core to now and publish what became visible."""

    def next_event_ns(self) -> int | None:
        """The next instant any core has something visible to do (None: all idle)."""

    def fault(self, core: RankEngine, exc: Exception) -> RankEngine:
        """A core's pass raised: end its requests, start the rank again empty; the new core."""

    def emit_step(self, core: RankEngine, res: StepResult) -> None:
        """Send and publish what one forward pass of ``core`` produced."""

    def say_alive(self) -> None:
        """Send the router a heartbeat now."""


class ModeDriver(Protocol):
    """What the actor needs from the way its cores are driven; the actor never asks which mode it is in."""

    def catch_up(self) -> None:
        """Before acting on an engine: bring the engines to now (virtual time; wall time keeps them there)."""

    def settle(self, dp_rank: int) -> None:
        """After acting on ``dp_rank``'s engine: re-arm the next instant, or wake the rank's task."""

    def wake(self, dp_rank: int) -> None:
        """``dp_rank``'s core was replaced (a fault): its task, if it has one, picks up the new core."""

    def replan(self) -> None:
        """Every pass's duration changed (chaos slowdown): plan again from now."""

    def sync(self) -> None:
        """A host is about to read what the engines published: bring them to now and re-arm."""

    def registered(self) -> None:
        """The router accepted the worker."""

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start running the cores in ``tg`` (until it is cancelled)."""


class VirtualDriver(ModeDriver):
    """Virtual time: one timer advances every core at its next visible event, and is re-armed after each act."""

    def __init__(self, host: DriverHost) -> None:
        self._host = host
        self._timer = Wakeup(self._step, host.clock.now_ns)

    def _step(self) -> int | None:
        """Advance every core to now and publish; the next instant anything will become visible."""
        host = self._host
        host.catch_up()
        nxt = host.next_event_ns()
        return None if nxt is None else max(nxt, host.clock.now_ns())

    def catch_up(self) -> None:
        self._host.catch_up()

    def settle(self, dp_rank: int) -> None:
        self._timer.arm(self._host.next_event_ns())  # the engines are at now already: the next instant is >= now + 1

    def wake(self, dp_rank: int) -> None:
        pass  # the next step reads the new core

    def replan(self) -> None:
        self._timer.poke()

    def sync(self) -> None:
        self._timer.arm(self._step())

    def registered(self) -> None:
        pass  # the in-process router routes to a worker once it accepted it

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._timer.run)


class LiveDriver(ModeDriver):
    """Wall time: each rank's task runs one forward pass at a time, sleeping its duration, and waits when idle."""

    def __init__(self, host: DriverHost) -> None:
        self._host = host
        self._wakes: dict[int, anyio.Event] = {}  # per rank: set to end its idle wait

    def catch_up(self) -> None:
        pass  # each rank's task keeps its engine at now

    def settle(self, dp_rank: int) -> None:
        self.wake(dp_rank)  # new work, or waiting requests that may fit now

    def wake(self, dp_rank: int) -> None:
        if (wake := self._wakes.get(dp_rank)) is not None:
            wake.set()

    def replan(self) -> None:
        for wake in self._wakes.values():
            wake.set()

    def sync(self) -> None:
        pass  # the engines publish as they run

    def registered(self) -> None:
        self._host.say_alive()  # a live router routes to us once we speak after its acceptance

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        for core in self._host.cores:
            tg.start_soon(self._drive, core.dp_rank)

    async def _drive(self, rank: int) -> None:
        host = self._host
        clock = host.clock
        while rank not in host.dead_ranks:
            core = host.core(rank)  # (a new one after a fault)
            now = max(clock.now_ns(), core.busy_until_ns, core.now_ns)
            try:
                res = core.step(now)
            except Exception as exc:  # noqa: BLE001 - one request's failed pass must not stop the rank
                host.fault(core, exc)
                continue
            if res.idle:
                wake = self._wakes[rank] = anyio.Event()
                if core.num_unfinished == 0:
                    await wake.wait()
                else:  # waiting requests that cannot start yet: look again shortly
                    with anyio.move_on_after(0.001):
                        await wake.wait()
                continue
            duration = res.duration_ns
            if duration:
                await anyio.sleep(duration / NS_PER_S)
            else:
                await anyio.sleep(0)  # let the loop breathe between zero-length passes
            host.emit_step(core, res)


def mode_driver(mode: RunMode, host: DriverHost) -> ModeDriver:
    """The driver for ``mode``: the one place a worker reads its run mode."""
    return VirtualDriver(host) if mode == "virtual" else LiveDriver(host)

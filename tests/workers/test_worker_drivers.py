"""The worker actor's one seam for the run mode (``workers.actor.drivers``): the actor acts the same way on virtual and
wall time and asks its driver, in a fixed order, for what differs; the two drivers implement the whole seam."""

from __future__ import annotations

import inspect

import anyio
import anyio.abc
import pytest

from kvemu.clock import ManualClock
from kvemu.messages import ClientRequest, Finished, RequestFailed, TokenBatch
from kvemu.runtime.kv_bus import MemoryKvBus
from kvemu.runtime.loop import run_virtual
from kvemu.runtime.transport import MemoryNetwork
from workers.config import EngineConfig
from workers.actor.drivers import LiveDriver, ModeDriver, VirtualDriver, mode_driver
from workers.mock_worker import MockWorker
from workers.rank_engine import RankEngine
from workers.request import Request
from workers.results import StepResult
from workers.actor.actor import WorkerActor

SEAM = sorted(name for name, _ in inspect.getmembers(ModeDriver, inspect.isfunction) if not name.startswith("_"))


class Recording(ModeDriver):
    """A driver that logs each call the actor makes, then hands it to the real one."""

    def __init__(self, inner: ModeDriver, log: list[str]) -> None:
        self.inner = inner
        self.log = log

    def catch_up(self) -> None:
        self.log.append("catch_up")
        self.inner.catch_up()

    def settle(self, dp_rank: int) -> None:
        self.log.append(f"settle {dp_rank}")
        self.inner.settle(dp_rank)

    def wake(self, dp_rank: int) -> None:
        self.log.append(f"wake {dp_rank}")
        self.inner.wake(dp_rank)

    def replan(self) -> None:
        self.log.append("replan")
        self.inner.replan()

    def sync(self) -> None:
        self.log.append("sync")
        self.inner.sync()

    def registered(self) -> None:
        self.log.append("registered")
        self.inner.registered()

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        self.log.append("start")
        self.inner.start(tg)


def _recorded_actor(clock: ManualClock, dp_size: int = 1) -> tuple[WorkerActor, list[str]]:
    """A virtual worker actor whose driver calls, and its engine's dispatches, go to one log."""
    bus = MemoryKvBus()
    actor = WorkerActor(MockWorker(EngineConfig(dp_size=dp_size, num_gpu_blocks=64, block_size=16), worker_id=2),
                        MemoryNetwork().worker_end(2), clock, [bus.publisher(2, r) for r in range(dp_size)],
                        mode="virtual")
    log: list[str] = []
    dispatch = actor.worker.dispatch

    def logged_dispatch(req: Request, dp_rank: int | None = None):
        log.append(f"dispatch {req.request_id}")
        return dispatch(req, dp_rank)

    actor.worker.dispatch = logged_dispatch  # type: ignore[method-assign]
    actor.driver = Recording(actor.driver, log)
    return actor, log


def test_one_submit_brings_the_engines_to_now_then_dispatches_then_rearms_its_rank_and_runs_to_its_end():
    clock = ManualClock()
    actor, log = _recorded_actor(clock, dp_size=2)
    replies: list[TokenBatch | Finished | RequestFailed] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            actor.driver.start(tg)
            await anyio.sleep(0.5)
            assert actor.submit_local(ClientRequest(request_id="r", tokens=list(range(40)), max_tokens=4), 1,
                                      replies.append) is None
            with anyio.fail_after(60):  # virtual seconds
                while not any(type(m) is Finished for m in replies):
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    run_virtual(main, clock)
    assert log == ["start", "catch_up", "dispatch r", "settle 1"]  # the timer then ran the engine to the end
    assert [type(m) for m in replies] == [TokenBatch, Finished]
    assert len(replies[0].times_ns) + len(replies[1].times_ns) == 4
    assert replies[0].times_ns[0] > 500_000_000  # after the submit, at the engine's pace on virtual time


def test_abort_and_a_refused_dispatch_ask_the_driver_only_what_they_act_on():
    actor, log = _recorded_actor(ManualClock())
    req = ClientRequest(request_id="a", tokens=list(range(40)), max_tokens=8)
    assert actor.submit_local(req, 0, lambda _m: None) is None
    assert actor.submit_local(req, 0, lambda _m: None) is not None  # a duplicate: refused before the engine
    assert actor.abort("a")
    assert not actor.abort("a")  # not here any more: nothing to bring to now
    assert log == ["catch_up", "dispatch a", "settle 0", "catch_up", "settle 0"]
    actor.slow_down(2.0)
    actor.stopped = True
    actor.sync()  # a stopped worker's engines are not advanced again
    assert log[-1:] == ["replan"]


class _Host:
    """A ``DriverHost`` that only counts what it is asked."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.cores = MockWorker(EngineConfig(num_gpu_blocks=64, block_size=16)).cores
        self.dead_ranks: set[int] = set()
        self.calls: list[str] = []

    def core(self, dp_rank: int) -> RankEngine:
        return self.cores[dp_rank]

    def catch_up(self) -> None:
        self.calls.append("catch_up")

    def next_event_ns(self) -> int | None:
        self.calls.append("next_event_ns")
        return None

    def fault(self, core: RankEngine, exc: Exception) -> RankEngine:
        raise AssertionError("no pass runs here")

    def emit_step(self, core: RankEngine, res: StepResult) -> None:
        raise AssertionError("no pass runs here")

    def say_alive(self) -> None:
        self.calls.append("say_alive")


@pytest.mark.parametrize("driver", [VirtualDriver, LiveDriver])
def test_each_driver_implements_the_whole_seam_with_its_signatures(driver: type[ModeDriver]) -> None:
    for name in SEAM:
        assert name in vars(driver), f"{driver.__name__} leaves {name} to the protocol's empty body"
        assert inspect.signature(getattr(driver, name)) == inspect.signature(getattr(ModeDriver, name))
    assert set(SEAM) == {"catch_up", "settle", "wake", "replan", "sync", "registered", "start"}


def test_the_mode_is_read_once_and_each_driver_does_its_own_half():
    virtual, live = _Host(), _Host()
    vd, ld = mode_driver("virtual", virtual), mode_driver("live", live)
    assert type(vd) is VirtualDriver and type(ld) is LiveDriver
    for d in (vd, ld):
        d.catch_up()
        d.settle(0)
        d.wake(0)
        d.replan()
        d.sync()
        d.registered()
    # virtual: brought to now before acting and re-armed after; silent on acceptance (the router routes to it)
    assert virtual.calls == ["catch_up", "next_event_ns", "catch_up", "next_event_ns"]
    # live: each rank's task keeps its engine at now; a live router routes to it once it speaks after acceptance
    assert live.calls == ["say_alive"]

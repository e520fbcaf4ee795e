"""In-memory delivery on virtual time: handlers called in order at the delivery instant, errors not lost."""

from __future__ import annotations

import anyio
import pytest

from kvemu.clock import ManualClock
from kvemu.runtime.loop import run_virtual
from kvemu.messages import Dispatch, Heartbeat, RegisterAck
from kvemu.runtime.transport import MemoryNetwork, peer_id
from kvemu.runtime.wakeup import Wakeup


@pytest.mark.parametrize("wire_check", [False, True])
def test_messages_arrive_in_order_after_the_latency_also_those_sent_before_serving(wire_check):
    clock = ManualClock()
    net = MemoryNetwork(latency_ns=2_000_000, wire_check=wire_check)
    router, worker = net.router_end(), net.worker_end(7)
    got: list[tuple[int, object]] = []

    async def main() -> None:
        for i in range(3):  # before the router serves: kept, then delivered in order
            worker.send_nowait(Heartbeat(worker_id=i))
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.serve, lambda peer, msg: got.append((clock.now_ns(), peer, msg)))
            tg.start_soon(worker.serve, lambda msg: got.append((clock.now_ns(), None, msg)))
            await anyio.sleep(0.001)
            router.send_nowait(peer_id(7), Dispatch(request_id="r", dp_rank=0, tokens=[1, 2], max_tokens=3))
            router.send_nowait(peer_id(99), RegisterAck(worker_id=99, accepted=True))  # nobody: dropped
            await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    run_virtual(main, clock)
    assert [m.worker_id for t, p, m in got[:3]] == [0, 1, 2]
    assert all(t == 2_000_000 and p == b"7" for t, p, _ in got[:3])
    assert got[3][0] == 3_000_000 and got[3][2] == Dispatch(request_id="r", dp_rank=0, tokens=[1, 2], max_tokens=3)
    assert len(got) == 4


def test_a_handler_that_raises_ends_its_serve_with_that_error():
    clock = ManualClock()
    net = MemoryNetwork()
    router, worker = net.router_end(), net.worker_end(1)

    def handler(msg: object) -> None:
        raise RuntimeError("registration refused")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.serve, handler)
            await anyio.sleep(0)
            router.send_nowait(peer_id(1), RegisterAck(worker_id=1, accepted=False))
            await anyio.sleep(1)

    with pytest.raises(ExceptionGroup) as info:
        run_virtual(main, clock)
    assert info.group_contains(RuntimeError, match="registration refused")


def test_a_network_outlives_its_loop_messages_sent_between_runs_wait_for_the_next_serve():
    """A receiver that served on one loop and stopped takes what comes later on its next serve, on a new loop
    (deliveries are scheduled on the serving loop, and on the sender's while nobody serves)."""
    clock = ManualClock()
    net = MemoryNetwork(latency_ns=1_000)
    router, worker = net.router_end(), net.worker_end(3)
    got: list[tuple[int, int]] = []

    def serve_for(before: range, during: range, after: range) -> None:
        async def main() -> None:
            for i in before:  # nobody serves yet (the last serve ran on a loop that is closed now)
                worker.send_nowait(Heartbeat(worker_id=i))
            async with anyio.create_task_group() as tg:
                tg.start_soon(router.serve, lambda peer, msg: got.append((clock.now_ns(), msg.worker_id)))
                await anyio.sleep(0)
                for i in during:
                    worker.send_nowait(Heartbeat(worker_id=i))
                await anyio.sleep(0.001)
                tg.cancel_scope.cancel()
            for i in after:  # nobody serves now: kept for the next serve
                worker.send_nowait(Heartbeat(worker_id=i))
            await anyio.sleep(0.001)

        run_virtual(main, clock)

    serve_for(range(0), range(0, 2), range(2, 4))
    assert [w for _, w in got] == [0, 1]
    serve_for(range(4, 5), range(5, 6), range(0))  # a second loop: the backlog first, then the rest in order
    assert [w for _, w in got] == [0, 1, 2, 3, 4, 5]
    assert got[2][0] == got[3][0] < got[4][0] == got[5][0]  # the backlog at once, the rest after the latency


def test_a_closed_end_stops_serving_and_drops_what_comes_later():
    clock = ManualClock()
    net = MemoryNetwork()
    router, worker = net.router_end(), net.worker_end(3)
    got: list[object] = []

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.serve, got.append)
                await anyio.sleep(0)
                await worker.aclose()  # serve returns
        router.send_nowait(peer_id(3), RegisterAck(worker_id=3, accepted=True))
        await anyio.sleep(0.1)

    run_virtual(main, clock)
    assert got == []


def test_wakeup_steps_at_the_instants_asked_and_soon_after_a_poke():
    clock = ManualClock()
    seen: list[int] = []
    plan = iter([5_000, None, 9_000, None])

    def step() -> int | None:
        seen.append(clock.now_ns())
        return next(plan)

    wake = Wakeup(step, clock.now_ns)

    async def main() -> None:
        wake.poke()  # before run: nothing to do yet
        async with anyio.create_task_group() as tg:
            tg.start_soon(wake.run)
            await anyio.sleep(0.000_007)  # steps at 0 and 5 us; then nothing asked
            wake.poke()
            wake.poke()  # one step for both pokes
            await anyio.sleep(0.000_010)
            tg.cancel_scope.cancel()

    run_virtual(main, clock)
    assert seen == [0, 5_000, 7_000, 9_000]


def test_wakeup_arm_keeps_the_earlier_instant():
    clock = ManualClock()
    seen: list[int] = []

    def step() -> int | None:
        seen.append(clock.now_ns())
        return 50_000 if clock.now_ns() < 50_000 else None  # the step's own plan: a step at 50 us

    wake = Wakeup(step, clock.now_ns)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wake.run)
            await anyio.sleep(0.000_001)  # stepped at 0: armed at 50 us
            wake.arm(20_000)  # earlier: moves the timer
            wake.arm(30_000)  # later than the pending 20 us: no change
            wake.arm(None)
            await anyio.sleep(0.000_100)
            tg.cancel_scope.cancel()

    run_virtual(main, clock)
    assert seen == [0, 20_000, 50_000]


def test_wakeup_reraises_a_failing_step_in_its_owners_task():
    def step() -> int | None:
        raise ValueError("engine invariant broken")

    async def main() -> None:
        await Wakeup(step, lambda: 0).run()

    with pytest.raises(ValueError, match="engine invariant broken"):
        run_virtual(main, ManualClock())


def _beating_worker(clock, mode: str, interval_s: float):
    """A registered worker actor with no traffic and a router end that records its heartbeats' times."""
    from kvemu.runtime.kv_bus import MemoryKvBus
    from kvemu.messages import Register
    from workers import EngineConfig, MockWorker
    from workers.actor.actor import WorkerActor

    net = MemoryNetwork()
    router = net.router_end()
    actor = WorkerActor(MockWorker(EngineConfig(num_gpu_blocks=64, block_size=16), worker_id=4), net.worker_end(4),
                        clock, [MemoryKvBus().publisher(4, 0)], mode=mode, heartbeat_interval_s=interval_s)
    beats: list[int] = []

    def on_message(peer: bytes, msg: object) -> None:
        if isinstance(msg, Register):
            router.send_nowait(peer, RegisterAck(worker_id=4, accepted=True))
        elif isinstance(msg, Heartbeat):
            beats.append(clock.now_ns())

    async def run(body) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.serve, on_message)
            await tg.start(actor.run)
            await body(actor)
            tg.cancel_scope.cancel()

    return run, beats


def test_a_worker_heartbeats_one_interval_after_its_last_message_and_never_later():
    """A heartbeat goes out an interval after the last message, not at the next fixed tick: a worker whose last
    message went out just after a tick was silent almost two intervals, and a router whose timeout was 1.5
    intervals dropped it (an idle worker of ``kvemu up`` was re-registered and its KV replayed twice)."""
    clock = ManualClock()
    run, beats = _beating_worker(clock, "virtual", 1.0)

    async def body(actor) -> None:
        await anyio.sleep(2.5)
        actor._send(Heartbeat(worker_id=4))  # any message proves liveness: nothing more is due before 3.5 s
        await anyio.sleep(3.2)

    run_virtual(lambda: run(body), clock)
    s = 1_000_000_000
    assert beats == [1 * s, 2 * s, 2_500_000_000, 3_500_000_000, 4_500_000_000, 5_500_000_000]


def test_heartbeats_also_tick_on_wall_time():
    """Live mode: the same timer on uvloop, scheduled as delays from the worker's clock."""
    from kvemu.clock import WallClock
    from kvemu.runtime.loop import run_live

    run, beats = _beating_worker(WallClock(), "live", 0.1)

    async def body(actor) -> None:
        await anyio.sleep(0.65)

    run_live(lambda: run(body))
    assert 3 <= len(beats) <= 7
    assert all(b - a >= 80_000_000 for a, b in zip(beats, beats[1:]))  # one per tick, not a burst

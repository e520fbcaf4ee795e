"""The run's mode is chosen once (``harness.run.mode``): each mode's clock, loop, sampling and facts."""

from __future__ import annotations

import anyio

from harness.run.mode import LiveRun, VirtualRun, run_mode


def test_a_virtual_run_sleeps_in_no_time_and_reads_the_engines_for_its_samples() -> None:
    mode = run_mode("virtual")
    assert isinstance(mode, VirtualRun) and mode.clock.is_virtual
    seen: list[int] = []

    async def main() -> None:
        await anyio.sleep(3600)  # an hour of scenario time
        seen.append(mode.clock.now_ns())

    mode.run(main)
    assert seen == [3600 * 10**9]
    assert mode.engine_usage(lambda: {(0, 0): {0: 5}}) == {(0, 0): {0: 5}}
    assert (mode.opens_sockets, mode.shares_the_machine, mode.sample_interval_s) == (False, False, 1.0)


def test_a_live_run_counts_wall_time_from_its_start_and_leaves_the_engines_alone() -> None:
    mode = run_mode("live")
    assert isinstance(mode, LiveRun) and not mode.clock.is_virtual
    seen: list[int] = []

    async def main() -> None:
        await anyio.sleep(0.01)
        seen.append(mode.clock.now_ns())

    mode.run(main)
    assert 10**7 <= seen[0] < 60 * 10**9  # from the mode's start, not the machine's
    assert mode.engine_usage(lambda: {(0, 0): {0: 5}}) is None
    assert (mode.opens_sockets, mode.shares_the_machine, mode.sample_interval_s) == (True, True, 0.25)


def test_a_virtual_run_collects_young_objects_rarely_and_puts_the_thresholds_back() -> None:
    """Young collections walk every container that survived since the last (token lists included): a virtual run
    makes one in two million allocations, a live process keeps the tuned 50,000; the process's own come back."""
    import gc

    from harness.run.mode import MODES
    from harness.run.runner import run_scenario
    from harness.scenario import parse_scenario

    assert MODES["virtual"].young_gc_threshold == 2_000_000 and MODES["live"].young_gc_threshold == 50_000
    before = gc.get_threshold()
    seen: set[int] = set()
    text = "name: g\nworkload: {kind: synthetic, rate_rps: 20}\nrun: {mode: virtual, duration_s: 1, seed: 3}\n"
    run_scenario(parse_scenario(text), None, observers=[lambda ev: seen.add(gc.get_threshold()[0])])
    assert seen == {2_000_000}
    assert gc.get_threshold() == before

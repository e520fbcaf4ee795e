"""Heartbeats run only where something can observe them: a virtual run with no fault that silences a worker
schedules none (and no router watchdog) and reports the same bytes as with them; a killed worker, a restarted
router, heartbeat knobs of its own or a live wiring keep them (``harness.run.wiring.liveness_observable``)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import get_args

import anyio
import pytest

import harness.run.wiring
from kvemu import ManualClock
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_virtual
from kvemu.runtime.router import Router
from workers.actor.actor import WorkerActor

from harness.chaos import SILENCING
from harness.run.cluster import cluster
from harness.run.runner import run_scenario
from harness.run.wiring import MemoryWiring, ZmqWiring, liveness_observable
from harness.scenario import ChaosAction, parse_scenario
from tests.harness.test_pinned_reports import summary_digest

ROOT = Path(__file__).resolve().parents[2]
CHAOS = (ROOT / "examples" / "compose-chaos.yaml").read_text().replace("mode: live", "mode: virtual")
QUIET_CHAOS = CHAOS.replace("  policy: kv\n", "  policy: kv\n  network_latency_ms: 20\n").replace(
    "  - {at_s: 5.0, action: restart_router}\n", """\
  - {at_s: 5.0, action: add_worker}
  - {at_s: 6.0, action: remove_worker, worker: 0, graceful: true}
""")
"""compose-chaos with every fault that silences no worker (and no router restart), on a network that lags."""
REPLICAS = (ROOT / "examples" / "replicas-chaos.yaml").read_text()
QUIET_REPLICAS = REPLICAS.replace("  - {at_s: 20, action: restart_router, replica: 2}\n", "").replace(
    "  - {at_s: 30, action: remove_worker, worker: 1, graceful: false}\n", "").replace("duration_s: 60", "duration_s: 30")
"""replicas-chaos (its first 30 s) with its KV-feed faults only: three replicas, each worker reaching every one."""
QUICKSTART = (ROOT / "harness" / "quickstart.yaml").read_text()
KILLED = QUICKSTART.replace("duration_s: 60", "duration_s: 20") + \
    "chaos:\n  - {at_s: 8, action: remove_worker, worker: 1, graceful: false}\n"
"""The quickstart (default heartbeat knobs) with a worker killed at 8 s."""


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts workers' heartbeat ticks and router watchdogs started, from now on."""
    seen: Counter[str] = Counter()
    beat, watch = WorkerActor._heartbeat, Router._watchdog

    def counted_beat(self: WorkerActor) -> int | None:
        seen["heartbeat ticks"] += 1
        return beat(self)

    async def counted_watch(self: Router) -> None:
        seen["watchdogs"] += 1
        await watch(self)

    monkeypatch.setattr(WorkerActor, "_heartbeat", counted_beat)
    monkeypatch.setattr(Router, "_watchdog", counted_watch)
    return seen


def _report(text: str, outdir: Path) -> tuple[str, str]:
    """Run ``text`` into ``outdir``: its summary's digest (as the pinned reports take it) and requests.jsonl's
    sha256."""
    run_scenario(parse_scenario(text), outdir)
    summary = json.loads((outdir / "summary.json").read_text())
    return summary_digest(summary), hashlib.sha256((outdir / "requests.jsonl").read_bytes()).hexdigest()


@pytest.mark.parametrize("text", [QUICKSTART, QUIET_CHAOS, QUIET_REPLICAS], ids=["quickstart", "quiet-chaos",
                                                                             "quiet-replicas"])
def test_a_virtual_run_nothing_can_fall_silent_in_has_no_heartbeat_and_the_same_report(
        text: str, ticks: Counter[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = _report(text, tmp_path / "quiet")
    assert ticks == Counter(), "a heartbeat or a watchdog ran where nothing can observe it"
    monkeypatch.setattr(harness.run.wiring, "liveness_observable", lambda scenario: True)  # today's: always on
    beating = _report(text, tmp_path / "beating")
    assert ticks["heartbeat ticks"] > 0 and ticks["watchdogs"] >= 1
    assert quiet == beating, "heartbeats that nothing observes changed the report"


def test_a_killed_worker_is_still_fenced_by_its_silence(ticks: Counter[str]) -> None:
    """The default knobs: the kill alone keeps the heartbeats, and the watchdog fences the worker one timeout
    (5 s) after it last spoke, at its next look (every 1.25 s)."""
    out = run_scenario(parse_scenario(KILLED))
    assert ticks["heartbeat ticks"] > 0 and ticks["watchdogs"] == 1
    (removed,) = [e for e in out.data.worker_events if e.kind == "worker_removed"]
    assert (removed.worker_id, removed.reason) == (1, "missed heartbeats")
    assert 13e9 <= removed.time_ns <= 13e9 + 1.25e9 + 1


@pytest.mark.parametrize(("extra", "observable"), [
    ("", False),
    ("chaos:\n  - {at_s: 1, action: remove_worker, worker: 0, graceful: false}\n", True),
    ("chaos:\n  - {at_s: 1, action: remove_worker, worker: 0, graceful: true}\n", False),
    ("chaos:\n  - {at_s: 1, action: restart_router}\n", True),
    ("chaos:\n  - {at_s: 1, action: add_worker}\n", False),
    ("chaos:\n  - {at_s: 1, action: kill_rank, worker: 0, dp_rank: 1}\n", False),
    ("chaos:\n  - {at_s: 1, action: drop_kv_events, worker: 0, count: 3}\n", False),
    ("chaos:\n  - {at_s: 1, action: delay_kv_events, lag_ms: 3000}\n", False),
    ("chaos:\n  - {at_s: 1, action: slow_worker, worker: 0, factor: 100}\n", False),
    ("autoscaler: {min_workers: 1, max_workers: 6, graceful: false}\n", True),
    ("autoscaler: {min_workers: 1, max_workers: 6}\n", False),
])
def test_which_runs_can_observe_heartbeats(extra: str, observable: bool) -> None:
    scenario = parse_scenario(QUICKSTART + extra)
    assert liveness_observable(scenario) is observable
    assert MemoryWiring(scenario).heartbeat_interval_s == (1.0 if observable else None)
    assert ZmqWiring(scenario).heartbeat_interval_s == 1.0, "live peers always heartbeat"


@pytest.mark.parametrize("knob", ["cluster.heartbeat_interval_s=0.5", "router.heartbeat_timeout_s=2",
                                  "cluster.heartbeat_interval_s=2"])
def test_heartbeat_knobs_of_its_own_keep_a_run_watched(knob: str) -> None:
    """A scenario that sets them is about liveness (or its timeout fences idle workers): they stay."""
    scenario = parse_scenario(QUICKSTART, overrides=[knob])
    assert liveness_observable(scenario)
    assert MemoryWiring(scenario).heartbeat_interval_s == scenario.cluster.heartbeat_interval_s


def test_every_chaos_action_says_whether_it_silences_a_worker() -> None:
    """A new chaos action must decide whether it makes heartbeats observable (or runs with it lose them)."""
    assert set(SILENCING) == set(get_args(ChaosAction))


def test_a_cluster_that_watches_no_heartbeats_refuses_to_kill_a_worker() -> None:
    """Its router would never notice the silence: the kill is refused (the worker keeps serving), not lost."""
    scenario = parse_scenario("name: q\ncluster: {workers: 2}\nworkload: {kind: synthetic, rate_rps: 1.0, turns: 1}\n")
    clock = ManualClock()

    async def main() -> tuple[str, list[int]]:
        async with cluster(scenario, clock, Hooks()) as c:
            with pytest.raises(ValueError, match="nothing watches this cluster's heartbeats") as refused:
                await c.remove_worker(0, graceful=False)
            await c.remove_worker(1)  # drained and deregistered: no heartbeat needed
            with anyio.fail_after(5):  # (virtual time: its Deregister is on the way)
                while 1 in c.router.workers:
                    await anyio.sleep(0.01)
            return str(refused.value), sorted(c.router.workers)

    why, left = run_virtual(main, clock)
    assert "worker 0 cannot be killed" in why and left == [0]

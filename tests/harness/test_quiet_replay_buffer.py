"""A rank's KV replay buffer keeps vLLM's 10,000 batches only where a router can ask for a replay: a virtual run
with no fault that loses or reorders KV batches, no router restart and one router keeps one batch per rank and
reports the same bytes as with the full buffer (``harness.run.wiring.replay_observable``); a live wiring always
keeps the full buffer."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

import harness.run.wiring
from kvemu.runtime.kv_bus import MemoryKvBus

from harness.chaos import REPLAYING
from harness.run.wiring import KV_BUFFER_STEPS, MemoryWiring, replay_observable
from harness.scenario import ChaosAction, parse_scenario
from tests.harness.test_quiet_heartbeats import CHAOS, QUICKSTART, _report

NO_KV_FAULT = CHAOS.replace("  - {at_s: 1.0, action: drop_kv_events, dp_rank: 1, count: 2}\n", "").replace(
    "  - {at_s: 2.0, action: delay_kv_events, lag_ms: 10}\n", "").replace(
    "  - {at_s: 5.0, action: restart_router}\n", "  - {at_s: 5.0, action: add_worker}\n")
"""compose-chaos in virtual time with every fault but those that lose or reorder KV batches or restart the router."""


@pytest.fixture
def buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The buffer_steps of every in-memory KV bus made from now on."""
    seen: list[int] = []
    init = MemoryKvBus.__init__

    def noted(self: MemoryKvBus, **kwargs: object) -> None:
        init(self, **kwargs)  # type: ignore[arg-type]
        seen.append(self.buffer_steps)

    monkeypatch.setattr(MemoryKvBus, "__init__", noted)
    return seen


@pytest.mark.parametrize("text", [QUICKSTART, NO_KV_FAULT], ids=["quickstart", "no-kv-fault-chaos"])
def test_a_run_no_router_can_ask_for_a_replay_keeps_one_batch_and_the_same_report(
        text: str, buffers: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "kill_rank" in text or text is QUICKSTART
    small = _report(text, tmp_path / "small")
    assert buffers and set(buffers) == {1}
    monkeypatch.setattr(harness.run.wiring, "replay_observable", lambda scenario: True)  # vLLM's 10,000
    full = _report(text, tmp_path / "full")
    assert set(buffers[-1:]) == {KV_BUFFER_STEPS}
    assert small == full, "a replay buffer nobody reads changed the report"


def test_a_dropped_batch_is_still_recovered_from_the_full_buffer(buffers: list[int],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """compose-chaos drops two batches of a rank: the buffer is vLLM's and the router's replay brings them back
    (with one batch kept they would be lost: the buffer is observable there)."""
    from harness.run.runner import run_scenario

    stats = run_scenario(parse_scenario(CHAOS)).data.kv_stats.values()
    assert set(buffers) == {KV_BUFFER_STEPS}
    assert sum(s["lost_batches"] for s in stats) == 0, stats
    replayed = sum(s["replayed_batches"] for s in stats)
    monkeypatch.setattr(harness.run.wiring, "replay_observable", lambda scenario: False)
    stats = run_scenario(parse_scenario(CHAOS)).data.kv_stats.values()
    assert sum(s["replayed_batches"] for s in stats) < replayed, stats


@pytest.mark.parametrize(("extra", "observable"), [
    ("", False),
    ("chaos:\n  - {at_s: 1, action: drop_kv_events, worker: 0, count: 3}\n", True),
    ("chaos:\n  - {at_s: 1, action: delay_kv_events, lag_ms: 3000}\n", True),
    ("chaos:\n  - {at_s: 1, action: restart_router}\n", True),
    ("chaos:\n  - {at_s: 1, action: add_worker}\n", False),
    ("chaos:\n  - {at_s: 1, action: remove_worker, worker: 0, graceful: false}\n", False),
    ("chaos:\n  - {at_s: 1, action: kill_rank, worker: 0, dp_rank: 1}\n", False),
    ("chaos:\n  - {at_s: 1, action: slow_worker, worker: 0, factor: 100}\n", False),
    ("autoscaler: {min_workers: 1, max_workers: 6}\n", False),
])
def test_which_runs_can_observe_the_replay_buffer(extra: str, observable: bool) -> None:
    scenario = parse_scenario(QUICKSTART + extra)
    assert replay_observable(scenario) is observable
    assert MemoryWiring(scenario).kv_buffer_steps == (KV_BUFFER_STEPS if observable else 1)


def test_router_replicas_keep_the_full_buffer() -> None:
    """A replica may register a worker after another replica sent it work: it rebuilds from the buffer."""
    scenario = parse_scenario(QUICKSTART, overrides=["router.replicas=2"])
    assert replay_observable(scenario) and MemoryWiring(scenario).kv_buffer_steps == KV_BUFFER_STEPS


def test_every_chaos_action_says_whether_it_makes_a_replay_observable() -> None:
    """A new chaos action must decide whether a router may replay after it (or runs with it lose their batches)."""
    assert set(REPLAYING) == set(get_args(ChaosAction))

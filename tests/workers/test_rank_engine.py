"""``workers.rank_engine.RankEngine`` is all the actor shell asks of an engine core: each flavour's core has every
member (mypy checks their types in ``workers.mock_worker``; this checks the objects, compiled or not), the one
optional capability (deferring KV events) is an explicit attribute, and the shell never probes a core for what it
has."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kvemu.clock import ManualClock
from kvemu.runtime.kv_bus import MemoryKvBus
from kvemu.runtime.loop import run_virtual
from kvemu.runtime.transport import MemoryNetwork
from workers.actor.actor import WorkerActor
from workers.config import EngineConfig
from workers.mock_worker import MockWorker, engine_core
from workers.rank_engine import RankEngine
from workers.sglang.engine import SglangEngineCore
from workers.vllm.engine import VllmEngineCore

ROOT = Path(__file__).resolve().parents[2]
FLAVOURS = {"vllm": VllmEngineCore, "sglang": SglangEngineCore}
METHODS = sorted(n for n, v in vars(RankEngine).items() if not n.startswith("_") and inspect.isfunction(v))
ATTRIBUTES = sorted({n for n, v in vars(RankEngine).items() if isinstance(v, property)} | set(RankEngine.__annotations__))


def _config(backend: str) -> EngineConfig:
    return EngineConfig(backend=backend, dp_size=2, num_gpu_blocks=64, block_size=16)


def test_the_protocol_names_what_the_shell_uses() -> None:
    assert METHODS == ["abort", "advance_to", "has_request", "next_event_ns", "release_kv", "step"]
    assert ATTRIBUTES == ["busy_until_ns", "can_defer_kv_events", "config", "defer_kv_events", "dp_rank", "kv_usage",
                          "now_ns", "num_running", "num_unfinished", "num_waiting", "spec", "timer"]


@pytest.mark.parametrize("backend", sorted(FLAVOURS))
def test_each_flavours_core_has_every_member(backend: str) -> None:
    core = engine_core(_config(backend), dp_rank=1)
    assert type(core) is FLAVOURS[backend]
    missing = [n for n in METHODS if not callable(getattr(core, n, None))] + \
              [n for n in ATTRIBUTES if not hasattr(core, n)]
    assert missing == []
    assert core.dp_rank == 1 and core.defer_kv_events is False


@pytest.mark.parametrize(("backend", "defers"), [("vllm", False), ("sglang", True)])
def test_deferring_kv_events_is_an_explicit_capability_the_actor_reads(backend: str, defers: bool) -> None:
    """The actor turns deferral on exactly on the cores that can, and says whether any does (the host then syncs)."""
    bus, clock = MemoryKvBus(), ManualClock()
    actor = WorkerActor(MockWorker(_config(backend), worker_id=3), MemoryNetwork().worker_end(3), clock,
                        [bus.publisher(3, r) for r in range(2)], mode="virtual")
    # (read on the cores: a compiled class holds an instance attribute's default as a descriptor, not the value)
    assert [c.can_defer_kv_events for c in actor.cores] == [defers, defers]
    assert actor.defer_kv_events() is defers
    assert [c.defer_kv_events for c in actor.cores] == [defers, defers]

    async def kill() -> None:
        actor.kill_rank(1)  # (it tells the router: a loop runs)

    run_virtual(kill, clock)
    assert [c.defer_kv_events for c in actor.cores] == [defers, defers]  # the dead rank's stand-in defers too


def test_the_actor_shell_never_probes_a_core() -> None:
    """No ``hasattr``/``getattr`` in ``workers/actor/``: what a core has is ``RankEngine``'s, and an optional
    capability is an attribute of it (the actor probed ``hasattr(core, "defer_kv_events")`` before)."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "workers" / "actor").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")]
    assert found == []

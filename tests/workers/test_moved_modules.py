"""The engine flavours' modules moved into ``workers/vllm/`` and ``workers/sglang/``, the actor shell's into
``workers/actor/``. For one release each old path is a deprecated alias: importing it warns (naming the new path, at
the importer's line) and gives the new module's public names as the same objects; the old class names stay aliases
of the new ones; no module of the repository imports an old path."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import workers
from workers.sglang.engine import SglangCore, SglangEngineCore
from workers.vllm.engine import EngineCore, VllmEngineCore
from tests.moved_modules import assert_alias, imports_of

ROOT = Path(__file__).resolve().parents[2]
MOVED = {
    "workers.vllm_engine": "workers.vllm.engine",
    "workers.vllm_fast_forward": "workers.vllm.fast_forward",
    "workers.scheduler": "workers.vllm.scheduler",
    "workers.hybrid": "workers.vllm.hybrid",
    "workers.host_tier": "workers.vllm.host_tier",
    "workers.sglang_engine": "workers.sglang.engine",
    "workers.radix": "workers.sglang.radix",
    "workers.worker_actor": "workers.actor.actor",
    "workers.drivers": "workers.actor.drivers",
    "workers.metrics": "workers.actor.metrics",
    "workers.trace": "workers.hash_id_prompt",
}
"""Old module path -> where it lives now."""


SPLIT = {"workers.trace": ("workers.hash_id_prompt", "harness.workload.traces.mooncake", "harness.workload.traces.rows")}
"""Old paths whose names went to several modules (the reading of traces moved up, into the workload)."""


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_module_path_warns_and_gives_the_new_modules_names(old: str, new: str) -> None:
    if old in SPLIT:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=rf"^{old} is deprecated: import from {new} "):
            alias = importlib.import_module(old)
        homes = [importlib.import_module(m) for m in SPLIT[old]] + [importlib.import_module("kvemu.limits")]
        for name in alias.__all__:
            assert any(getattr(h, name, None) is getattr(alias, name) for h in homes), name
        return
    assert_alias(old, new)


def test_workers_mooncake_request_warns_and_is_the_workloads() -> None:
    """The one name of ``workers``' face that moved up a layer: still there for one release, with a warning."""
    from harness.workload.traces.mooncake import mooncake_request

    with pytest.warns(DeprecationWarning, match="^workers.mooncake_request is deprecated"):
        assert workers.mooncake_request is mooncake_request
    with pytest.raises(AttributeError):
        workers.no_such_name  # noqa: B018


def test_the_old_class_names_are_the_new_classes() -> None:
    assert EngineCore is VllmEngineCore and workers.EngineCore is VllmEngineCore is workers.VllmEngineCore
    assert SglangCore is SglangEngineCore


def test_every_old_path_is_listed_and_the_new_modules_import_without_warning() -> None:
    """The aliases in ``workers/`` are the ones listed here, and the new paths warn of nothing."""
    aliases = {f"workers.{p.stem}" for p in (ROOT / "workers").glob("*.py") if "is deprecated: import from" in p.read_text()}
    assert aliases == set(MOVED)
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", script, "workers",
                           *MOVED.values()], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_no_module_of_the_repository_imports_an_old_path() -> None:
    """Function-local imports and ``import a.b`` included; the aliases themselves and this test aside."""
    found = imports_of(set(MOVED), {"workers"}, Path(__file__))
    assert not found, f"imports of a deprecated module path: {found}"

"""The workload's modules moved into ``harness/workload/`` (the trace formats into ``harness/workload/traces/``, the
missing-trace hint into ``harness/scenario/``), a run's into ``harness/run/``. For one release each old path is a deprecated alias: importing it
warns (naming the new path, at the importer's line) and gives the new module's public names as the same objects;
no module of the repository imports an old path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.moved_modules import assert_alias, imports_of

ROOT = Path(__file__).resolve().parents[2]
TRACES = ("agentic_legacy", "agentic_v2", "applied_compute", "convert", "dynamo", "formats", "graph", "mooncake",
          "names", "rows", "timing", "weka")
MOVED = {
    "harness.sessions": "harness.workload.sessions",
    "harness.player": "harness.workload.players",
    "harness.lanes": "harness.workload.lanes",
    "harness.turns": "harness.workload.turns",
    "harness.trace_sessions": "harness.workload.trace_sessions",
    "harness.synthetic_trace": "harness.workload.synthetic_trace",
    "harness.agentic_corpus": "harness.workload.agentic_corpus",
    "harness.traces.known": "harness.scenario.known_traces",
    **{f"harness.traces.{m}": f"harness.workload.traces.{m}" for m in TRACES},
    "harness.runner": "harness.run.runner",
    "harness.run_mode": "harness.run.mode",
    "harness.wiring": "harness.run.wiring",
    "harness.pools": "harness.run.pools",
    "harness.autoscaler": "harness.run.autoscaler",
    "harness.interrupts": "harness.run.interrupts",
    "harness.progress": "harness.run.progress",
    "harness.replica_stats": "harness.run.replica_stats",
    "harness.routing_truth": "harness.run.routing_truth",
    "harness.cluster": "harness.run.cluster",
}
"""Old module path -> where it lives now (``harness.workload``, once a module, is the package: no alias)."""
SPLIT = {"harness.cluster": ("harness.run.cluster", "harness.run.factories", "harness.plugins")}
"""Old paths whose names went to several modules: the in-process cluster and the factories that build from a
scenario (the router process and the load generators want only those)."""


def _import_old_package() -> None:
    """``harness.traces`` (the old package) imported, its own warning aside: each test then sees its module's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("harness.traces")


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_module_path_warns_and_gives_the_new_modules_names(old: str, new: str) -> None:
    _import_old_package()
    if old in SPLIT:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=rf"^{old} is deprecated: import from {new} "):
            alias = importlib.import_module(old)
        homes = [importlib.import_module(m) for m in SPLIT[old]]
        for name in alias.__all__:
            assert any(getattr(h, name, None) is getattr(alias, name) for h in homes), name
        return
    assert_alias(old, new)


def test_the_old_trace_package_warns() -> None:
    for name in [m for m in sys.modules if m == "harness.traces" or m.startswith("harness.traces.")]:
        sys.modules.pop(name)
    with pytest.warns(DeprecationWarning, match=r"^harness.traces is deprecated: import from harness.workload.traces$"):
        exec("import harness.traces", {})  # noqa: S102


def test_the_workload_package_gives_what_the_old_module_gave() -> None:
    """``from harness.workload import build_sessions`` (the module it was) still works, without a warning; so does
    ``from harness.turns import Sessions`` (the name moved to ``harness.workload.forms``)."""
    import harness.workload
    from harness.workload import build, forms

    assert set(build.__all__) <= set(harness.workload.__all__)
    for name in build.__all__:
        assert getattr(harness.workload, name) is getattr(build, name), name
    _import_old_package()
    sys.modules.pop("harness.turns", None)
    with pytest.warns(DeprecationWarning, match="^harness.turns is deprecated"):
        from harness.turns import Sessions
    assert Sessions is forms.Sessions


def test_every_old_path_is_listed_and_the_new_modules_import_without_warning() -> None:
    """The aliases in ``harness/`` are the ones listed here, and the new paths warn of nothing."""
    aliases = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in (ROOT / "harness").rglob("*.py")
               if "is deprecated: import from" in p.read_text()}
    assert aliases == set(MOVED) | {"harness.traces.__init__"}
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", script, "harness.workload",
                           *MOVED.values()], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_no_module_of_the_repository_imports_an_old_path() -> None:
    """Function-local imports and ``import a.b`` included; the aliases themselves and this test aside."""
    found = imports_of(set(MOVED) | {"harness.traces"}, {"harness", "harness.traces"}, Path(__file__))
    assert not found, f"imports of a deprecated module path: {found}"


def test_the_old_corpus_command_still_writes_the_corpus(tmp_path: Path) -> None:
    """``python -m harness.agentic_corpus`` (docs said so) warns and writes what the new module's command writes."""
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    ran = [subprocess.run([sys.executable, "-m", module, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120) for module, out in (("harness.agentic_corpus", old),
                                                           ("harness.workload.agentic_corpus", new))]
    assert [r.returncode for r in ran] == [0, 0], [r.stderr[-2000:] for r in ran]
    assert "harness.agentic_corpus is deprecated" in ran[0].stderr and "deprecated" not in ran[1].stderr
    assert old.read_bytes() == new.read_bytes() and old.stat().st_size > 0

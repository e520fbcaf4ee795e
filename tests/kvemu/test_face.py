"""kvemu's face: ``import kvemu`` exports the embedder's names and no others; the names it exported before are
deprecated aliases for one release, and kvemu's own code never uses them."""

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvemu

ROOT = Path(__file__).resolve().parents[2]

FACE = [
    # time
    "Clock", "ManualClock", "WallClock", "seconds_to_ns", "ns_to_seconds",
    # the routing core
    "RoutingCore", "WorkerSpec", "EligibilityBuilder", "Selection", "RouterConfig", "RouterOverrides",
    "BusyThresholds", "CustomPolicy",
    # session affinity
    "SessionAffinity", "sibling_group_key",
    # the policy queue
    "PolicyQueue", "QueueClass", "QueueEntry",
    # the request lifecycle, its messages and its record
    "Lifecycle", "LifecycleSettings", "ClientRequest", "Dispatch", "Abort", "DispatchAck", "TokenBatch", "Finished",
    "RequestFailed", "RequestRecord",
    # KV-event records
    "RouterEvent", "BlocksStored", "BlocksRemoved", "AllCleared", "StorageTier",
    # error families
    "KvemuError", "InvalidArgument", "SchedulerError", "KvCacheEventError", "QueueRejected",
    # the build
    "compiled", "__version__",
]


def test_the_face_is_exactly_the_embedders_names() -> None:
    """The face grows only by editing this list: a name added to ``__all__`` by accident fails here."""
    assert sorted(kvemu.__all__) == sorted(FACE)
    assert len(set(kvemu.__all__)) == len(kvemu.__all__)
    assert all(hasattr(kvemu, name) for name in FACE)


def test_no_face_name_is_also_a_deprecated_alias() -> None:
    assert not set(kvemu._MOVED) & set(FACE)


@pytest.mark.parametrize("name", sorted(kvemu._MOVED))
def test_a_name_that_left_the_face_still_imports_and_warns(name: str) -> None:
    module = kvemu._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"^kvemu\.{name} is deprecated: import it from {module}$"):
        alias = getattr(kvemu, name)
    assert alias is getattr(importlib.import_module(module), name)
    assert name in importlib.import_module(module).__all__, f"{name} is not public in {module}"
    with pytest.warns(DeprecationWarning, match=module):
        exec(f"from kvemu import {name}", {})  # noqa: S102  (the spelling outside code uses)


def test_an_unknown_name_raises_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
            kvemu.NoSuchName  # noqa: B018
        assert not hasattr(kvemu, "NoSuchName")
        with pytest.raises(ImportError):
            exec("from kvemu import NoSuchName", {})  # noqa: S102


def test_a_submodule_still_imports_through_the_package() -> None:
    """``from kvemu import transfer`` falls back to the submodule when ``__getattr__`` knows no such name."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        exec("from kvemu import transfer", {})  # noqa: S102


def test_kvemus_own_code_imports_no_deprecated_alias() -> None:
    """No module of kvemu, workers, harness, bench, examples or tests names a deprecated alias (function-local
    imports included), and importing every module raises no deprecation warning of kvemu's."""
    moved = set(kvemu._MOVED)
    found = []
    for folder in ("kvemu", "workers", "harness", "bench", "examples", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "kvemu" / "__init__.py" or path == Path(__file__):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "kvemu" and node.level == 0:
                    found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name in moved]
                elif (isinstance(node, ast.Attribute) and node.attr in moved and isinstance(node.value, ast.Name)
                      and node.value.id == "kvemu"):
                    found.append(f"{path.relative_to(ROOT)}: kvemu.{node.attr}")
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "from kvemu import " in node.value:
                    names = node.value.split("from kvemu import ", 1)[1].split("\n", 1)[0]
                    found += [f"{path.relative_to(ROOT)}: {n.strip()} (in a string)" for n in names.split(",")
                              if n.strip() in moved]
    assert not found, f"deprecated kvemu aliases in kvemu's own code: {found}"
    script = (
        "import importlib, pkgutil, warnings\n"
        "warnings.filterwarnings('error', message=r'kvemu\\.\\w+ is deprecated', category=DeprecationWarning)\n"
        "for package in ('kvemu', 'workers', 'harness', 'bench'):\n"
        "    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + '.'):\n"
        "        if not info.name.endswith('__main__'):\n"
        "            importlib.import_module(info.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_dispatch_reads_its_old_spellings_with_a_warning_for_one_release() -> None:
    """``Dispatch`` spells the request's facts as the request does (``kv_hold``, ``engine_priority``); the old
    attribute names still read, with a DeprecationWarning."""
    import pytest

    from kvemu.messages import Dispatch

    d = Dispatch(request_id="r", dp_rank=0, tokens=[1], max_tokens=1, engine_priority=3, kv_hold=True)
    with pytest.warns(DeprecationWarning, match="kv_hold"):
        assert d.hold_kv is True
    with pytest.warns(DeprecationWarning, match="engine_priority"):
        assert d.priority == 3

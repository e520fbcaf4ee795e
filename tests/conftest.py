"""Shared test plumbing: the reference binding (``ai-dynamo-runtime``) for ``reference`` tests, and the trace.

Every test that replays the Mooncake trace gets it from ``mooncake_trace``: the real one-hour trace where the
development layout has it (``../shared/traces/``), else a deterministic generated trace in its format, so a
fresh clone with nothing beside it runs them too. A test of figures only the real trace has takes
``real_mooncake_trace``, which skips without it (fails under ``KVEMU_REQUIRE_REFERENCE=1``).

Tests marked ``reference`` compare kvemu with Dynamo's own implementation. They get the binding from the
``dynamo_core`` fixture (never by importing it themselves). Without ``KVEMU_REQUIRE_REFERENCE`` a
missing or broken binding skips them with the reason; with ``KVEMU_REQUIRE_REFERENCE=1`` (CI sets it)
it is a test failure saying how to install the binding, and so is *any* skip of a ``reference`` test
(a missing trace, a ``pytest.skip`` or ``importorskip`` added later), so that a CI run cannot pass
with the differential tests silently switched off.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest
from hypothesis import settings

# Property tests are derandomized by default: a run's outcome is a function of the code, so CI cannot go red on
# a draw it never made before. ``HYPOTHESIS_PROFILE=explore`` draws afresh on every run: run it (several times)
# after touching an engine, a queue or the index, and turn what it finds into a regression test.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REQUIRE_ENV = "KVEMU_REQUIRE_REFERENCE"
REFERENCE_DIST = "ai-dynamo-runtime"
REFERENCE_VERSION = "1.6.1"
INSTALL_HINT = (
    f"install it with: pip install '{REFERENCE_DIST}=={REFERENCE_VERSION}' "
    "(x86-64 Linux wheel; it is part of the dev extras: pip install -e '.[dev]')"
)


def reference_required() -> bool:
    """Whether ``KVEMU_REQUIRE_REFERENCE`` asks for the reference tests to run (1/true/yes/on)."""
    return required(REQUIRE_ENV)


def reference_unavailable(reason: str) -> NoReturn:
    """Skip the calling test, or fail it when the reference is required; ``reason`` says what is missing."""
    if reference_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this a failure)")


def import_reference(name: str = "dynamo._core") -> ModuleType:
    """Import a module of the reference binding, or skip / fail (see ``reference_unavailable``)."""
    os.environ.setdefault("DYN_LOG", "warn")  # the binding logs every routing decision at INFO otherwise
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # not installed, or installed but its native library does not load
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    if error is not None:  # outside the except block: the report shows this reason, not a chained traceback
        reference_unavailable(f"the reference binding cannot be imported ({name}: {error}); " + INSTALL_HINT)
    try:
        version = importlib.metadata.version(REFERENCE_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = None  # importable without distribution metadata (a source tree on sys.path): accept it
    if version is not None and version != REFERENCE_VERSION:
        reference_unavailable(f"{REFERENCE_DIST} {version} is installed where the reference tests pin the "
                              f"behaviour of {REFERENCE_VERSION}; " + INSTALL_HINT)
    return module


# ------------------------------------------------------------------ the Mooncake trace, real or generated

ROOT = Path(__file__).resolve().parents[1]
REAL_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
"""Where the development layout keeps the one-hour production trace (``examples/mooncake-3600s.yaml`` points there)."""
SYNTHETIC_ROWS = 3000


@pytest.fixture(scope="session")
def mooncake_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mooncake-format trace: the real one where it is present, else a deterministic one in its format
    (``harness.workload.synthetic_trace``). Differential tests replay it on both sides, so either serves them."""
    if REAL_TRACE.is_file():
        return REAL_TRACE
    if reference_required():  # CI has the real trace beside the project: its absence is a broken layout
        pytest.fail(f"{REQUIRE_ENV}=1 but the Mooncake trace is not at {REAL_TRACE}", pytrace=False)
    from harness.workload.synthetic_trace import write_synthetic_trace

    return write_synthetic_trace(tmp_path_factory.mktemp("trace") / "synthetic-mooncake.jsonl", SYNTHETIC_ROWS)


@pytest.fixture(scope="session")
def real_mooncake_trace() -> Path:
    """The real one-hour trace, for a test whose figures only it has: skips without it (fails under
    ``KVEMU_REQUIRE_REFERENCE=1``)."""
    if not REAL_TRACE.is_file():
        reference_unavailable(f"the Mooncake trace is not at {REAL_TRACE} (examples/mooncake-3600s.yaml says "
                              "where to get it)")
    return REAL_TRACE


@pytest.fixture(scope="session")
def dynamo_core() -> ModuleType:
    """``dynamo._core`` of ``ai-dynamo-runtime==1.6.1`` (skips, or fails under ``KVEMU_REQUIRE_REFERENCE=1``)."""
    return import_reference("dynamo._core")


# ------------------------------------------------------------------ the safety net under the variables

REQUIRED_MARKERS = (("reference", REQUIRE_ENV), ("oracle", "KVEMU_REQUIRE_ORACLE"))
"""Each marker whose tests may not skip while its variable is set: the reference binding's differential tests,
and the engines' oracles' (tests/oracle/conftest.py)."""


def required(variable: str) -> bool:
    """Whether the environment ``variable`` asks for its tests to run (1/true/yes/on)."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, lineno, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Under a marker's variable (``REQUIRED_MARKERS``), a skipped test of that marker is reported as failed."""
    report: pytest.TestReport = yield
    if not report.skipped or hasattr(report, "wasxfail"):
        return report
    for marker, variable in REQUIRED_MARKERS:
        if item.get_closest_marker(marker) is not None and required(variable):
            report.outcome = "failed"
            report.longrepr = (f"{variable}=1: the {marker} test {item.nodeid} was skipped, which counts as a "
                               f"failure: {_skip_reason(report.longrepr)}")
            break
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    """Under a marker's variable, a test module with tests of that marker may not skip itself while being collected.

    (A module-level ``pytest.importorskip`` would otherwise hide all its tests before any mark is seen.)
    """
    report: pytest.CollectReport = yield
    if not report.skipped or not isinstance(collector, pytest.Module):
        return report
    try:
        source = collector.path.read_text(encoding="utf-8")
    except OSError:
        source = ""
    for marker, variable in REQUIRED_MARKERS:
        if f"mark.{marker}" in source and required(variable):
            report.outcome = "failed"
            report.longrepr = (f"{variable}=1: the module {collector.nodeid}, which has {marker} tests, "
                               f"skipped itself while being collected: {_skip_reason(report.longrepr)}")
            break
    return report


RERUN_ENV = "KVEMU_CI_COMPILED_RERUN"
"""Set by ``.ci/fresh-clone``: the compiled build's run of the suite, after the pure-Python one."""


PROCESS_GROUP = "processes"
"""The xdist group of the tests that run kvemu's (or a third party's) processes: under ``--dist loadgroup`` one
worker runs them one at a time, beside the in-process tests on the other core (``.ci/run``'s first step)."""

ORACLE_GROUP = "oracles"
"""The engine oracles' tests: each drives one CPU-bound scheduler process, and a module's batch of workloads is run
once for all its tests, so they too stay on one worker; a group of their own, so that they run beside the process
tests (on the other core) rather than after them."""


PROCESS_MARKERS = (("third_party_routers", "third-party routers"), ("process_supervision", "process supervision"),
                   ("sweep_executors", "sweeps on Dask and Ray"))
PROCESS_PATHS = (("end_to_end", "end-to-end process tests", PROCESS_GROUP),
                 ("test_examples_fresh_clone.py", "the examples' validation", PROCESS_GROUP),
                 ("oracle", "the engine oracles' scheduler processes", ORACLE_GROUP))
"""What drives processes, by marker (or a path part of that name) and by path part, with what it exercises and the
xdist group it runs in (markers: ``PROCESS_GROUP``)."""


def _runs_processes(item: pytest.Item) -> tuple[str, str] | None:
    """What ``item`` exercises if it drives processes (HTTP routers, supervision, sweep executors, end-to-end
    tests, the examples' validation in a bare clone, the engine oracles) and its xdist group, else ``None``."""
    parts = Path(str(item.fspath)).parts
    for marker, ran in PROCESS_MARKERS:
        if marker in item.keywords or marker in parts:
            return ran, PROCESS_GROUP
    return next(((ran, group) for name, ran, group in PROCESS_PATHS if name in parts), None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks as it finds them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The process tests form one xdist group (``PROCESS_GROUP``): two of them at once on two cores would starve
    each other's processes; the oracles' tests another (``ORACLE_GROUP``). ``tests/test_xdist_groups.py`` checks
    that both hold.

    On ``.ci/run``'s compiled re-run they are skipped: they exercise kvemu's HTTP servers, processes, scenario
    files and sweep executors, which the compiled build does not change (its router and engines run in process in
    the rest of the suite), and the first step has run them (this keeps ``.ci/run`` inside its time budget)."""
    rerun = os.environ.get(RERUN_ENV) == "1"
    for item in items:
        found = _runs_processes(item)
        if found is None:
            continue
        ran, group = found
        item.add_marker(pytest.mark.xdist_group(group))
        if rerun:
            item.add_marker(pytest.mark.skip(reason=f"{RERUN_ENV}=1: {ran} ran on .ci/run's first step"))

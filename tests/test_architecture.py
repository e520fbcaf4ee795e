"""The architecture is checked, not remembered: pyproject.toml's import-linter contracts hold (layers, cores that
import no shell, no import circle), their module lists name every module of the core and of the engines and the
no-circle contract reaches every package, so a new module cannot slip past them; the worker reads its run mode in one
place; and ruff's rules hold (mypy runs in .ci/run)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from workers.actor.actor import WorkerActor

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
SHELLS = {"kvemu": {"runtime", "wire", "http"}, "workers": {"actor"}}
"""Each package's shell modules (and folders): the rest of the package is its sans-IO core."""
FLAVOURS = {"vllm", "sglang"}
"""The engine flavours' folders in ``workers/``; ``workers/mock_worker.py`` picks one per rank."""


def _modules(package: str) -> set[str]:
    """The package's direct modules and subpackages, by name."""
    folder = ROOT / package
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


def _contract(source_package: str) -> dict:
    """The contract that keeps the package's core from importing its shells."""
    (contract,) = [c for c in CONTRACTS if c["type"] == "forbidden"
                   and c["source_modules"][0].startswith(source_package + ".")
                   and f"{source_package}.{min(SHELLS[source_package])}" in c["forbidden_modules"]]
    return contract


def _old_paths(package: str) -> dict[str, str]:
    """The package's modules that are only a deprecated alias of a module that moved (one release): each with the
    module it names."""
    found = {p.stem: re.search(r"is deprecated: import from ([\w.]+)", p.read_text()) for p in (ROOT / package).glob("*.py")}
    return {old: m[1] for old, m in found.items() if m}


def _shell_aliases(package: str) -> set[str]:
    """The old paths of modules that moved into one of the package's shells: shell modules themselves (they
    import the shell), so neither in the core's contract nor in the shell's."""
    return {old for old, new in _old_paths(package).items() if new.split(".")[1] in SHELLS[package]}


def _aliases_up(package: str) -> set[str]:
    """The old paths of modules whose names moved up a layer (into the harness): they import it, for one release
    (pyproject.toml's layers contract ignores just those imports), so they sit in no contract of the package."""
    return {old for old in _old_paths(package) if "from harness." in (ROOT / package / f"{old}.py").read_text()}


@pytest.mark.parametrize("package", ["kvemu", "workers"])
def test_a_forbidden_contract_covers_every_core_module_of_its_package(package: str) -> None:
    listed = {name.removeprefix(package + ".") for name in _contract(package)["source_modules"]}
    assert listed == _modules(package) - SHELLS[package] - _shell_aliases(package) - _aliases_up(package), \
        "pyproject.toml's [tool.importlinter] lists other modules"
    assert {f"{package}.{m}" for m in SHELLS[package]} <= set(_contract(package)["forbidden_modules"])


def test_the_shared_engine_modules_import_no_flavour_and_the_flavours_not_each_other() -> None:
    """Every module of workers' core but the flavours, ``mock_worker`` (it picks one) and the old paths is kept
    from importing a flavour, and each flavour from importing the other, so a flavour's code stays in its folder."""
    (shared,) = [c for c in CONTRACTS if c["type"] == "forbidden"
                 and set(c["forbidden_modules"]) == {f"workers.{f}" for f in FLAVOURS}]
    listed = {name.removeprefix("workers.") for name in shared["source_modules"]}
    assert listed == _modules("workers") - SHELLS["workers"] - FLAVOURS - {"mock_worker"} - set(_old_paths("workers"))
    (apart,) = [c for c in CONTRACTS if c["type"] == "independence"]
    assert set(apart["modules"]) == {f"workers.{f}" for f in FLAVOURS}
    assert FLAVOURS <= _modules("workers")


def test_the_no_circle_contract_reaches_every_package() -> None:
    """The acyclic_siblings contract starts at every root package and goes as deep as the deepest package, so a
    circle between the modules of any (new) subpackage breaks it."""
    (contract,) = [c for c in CONTRACTS if c["type"] == "acyclic_siblings"]
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    assert sorted(contract["ancestors"]) == sorted(roots)
    deepest = max(len(init.relative_to(ROOT / root).parts) - 1 for root in roots
                  for init in (ROOT / root).rglob("__init__.py"))
    assert contract.get("depth", 10) >= deepest, "raise the depth of pyproject.toml's acyclic_siblings contract"


@pytest.mark.parametrize(("old", "new"), [
    ("harness.run.runner.Terminated", "harness.run.interrupts.Terminated"),
    ("harness.cli.signals.held_signals", "harness.run.interrupts.held_signals"),
    ("harness.cli.signals.terminate_as_interrupt", "harness.run.interrupts.terminate_as_interrupt"),
    ("harness.workload.sessions.Player", "harness.workload.players.Player"),
    ("harness.workload.sessions.awaiting", "harness.workload.players.awaiting"),
    ("harness.procs.replica_door.RouterLink", "harness.procs.replica_backend.RouterLink"),
    ("harness.procs.replica_door.RouterProcesses", "harness.procs.replica_backend.RouterProcesses"),
    ("harness.procs.replica_door.ReplicaCollector", "harness.procs.replica_backend.ReplicaCollector"),
    ("harness.report.sla.Sla", "harness.scenario.sections.Sla"),
])
def test_a_name_moved_to_break_a_circle_keeps_its_old_path(old: str, new: str) -> None:
    def resolve(dotted: str) -> object:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)

    assert resolve(old) is resolve(new)
    assert old.rpartition(".")[2] in importlib.import_module(old.rpartition(".")[0]).__all__


RUN_MODES = {"virtual", "live"}


def _run_mode_branches(source: str) -> list[tuple[str, int]]:
    """Where ``source`` compares with, or matches on, a run mode's name: (enclosing function, line)."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        elif isinstance(node, ast.Compare | ast.MatchValue) and \
                any(isinstance(c, ast.Constant) and c.value in RUN_MODES for c in ast.walk(node)):
            found.append((func, node.lineno))
            return
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), "<module>")
    return found


def test_the_worker_actor_never_asks_which_run_mode_it_is_in() -> None:
    """Advancing, re-arming and waking differ by mode behind ``workers.actor.drivers.ModeDriver``; the actor asks
    its driver, not its mode (it had 9 branches on ``self.mode``: the same sandwich written several times)."""
    source = Path(inspect.getfile(WorkerActor)).read_text()
    assert _run_mode_branches(source) == []
    assert not [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr == "mode"]


def test_the_workers_read_the_run_mode_in_one_place() -> None:
    found = sorted(hit for path in (ROOT / "workers").rglob("*.py") for hit in _run_mode_branches(path.read_text()))
    assert [name for name, _ in found] == ["mode_driver"], found


def test_the_import_contracts_hold() -> None:
    """lint-imports (grimp counts function-local imports too) keeps every contract."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in proc.stdout


def test_ruff_finds_nothing() -> None:
    """The lint rules of pyproject.toml's [tool.ruff] hold on the whole tree (kvemu, workers, harness, tests, bench)."""
    ruff = Path(sys.executable).with_name("ruff")
    proc = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]



def test_the_shape_figures_only_go_down() -> None:
    """bench.architecture's counts may fall, never rise: each ceiling is the figure when it was last lowered
    (lower it with the change that earns it)."""
    from bench.architecture import count

    c = count()
    got = {"run-mode branches": sum(c.branches.values()), "clock-kind questions": sum(c.clock_questions.values()),
           "function-local imports": c.local_imports,
           "type ignores": c.type_ignores, "uses of Any": c.anys}
    ceilings = {"run-mode branches": 0, "clock-kind questions": 0, "function-local imports": 178, "type ignores": 172,
                "uses of Any": 301}
    assert {k: v for k, v in got.items() if v > ceilings[k]} == {}, got


STRICT_FLAGS = ("disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_calls", "disallow_untyped_defs",
                "disallow_incomplete_defs", "disallow_untyped_decorators", "warn_return_any", "no_implicit_reexport",
                "strict_equality")
"""What ``mypy --strict`` turns on per module: the flags of pyproject.toml's strict overrides."""
STRICT_PACKAGES = ("kvemu.http", "kvemu.wire", "harness.cli", "harness.procs", "harness.sweep")
"""The packages checked strictly beside the kvemu core (the second strict override)."""


def _strict_override(member: str) -> dict:
    """pyproject.toml's strict mypy override (one that sets every strict flag) whose module list holds ``member``."""
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    (found,) = [o for o in overrides if member in o["module"] and all(o.get(flag) for flag in STRICT_FLAGS)]
    return found


def _covers(pattern: str, module: str) -> bool:
    """Whether a mypy override's module pattern applies to ``module`` (``pkg.*``: the package and every module
    under it)."""
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def test_mypy_checks_every_core_module_of_kvemu_strictly() -> None:
    """pyproject.toml's strict mypy override names every module of the kvemu core (all but its shells), so a new
    core module is checked strictly from its first line."""
    strict = _strict_override("kvemu")
    core = {"kvemu"} | {f"kvemu.{m}" for m in _modules("kvemu") - SHELLS["kvemu"]}
    packages = {m for m in core if (ROOT / m.replace(".", "/") / "__init__.py").is_file() and m != "kvemu"}
    assert set(strict["module"]) == core | {f"{p}.*" for p in packages}


def test_mypy_checks_every_module_of_the_strict_packages_strictly() -> None:
    """The second strict override covers every module of ``STRICT_PACKAGES`` (a module added to one, or a package
    renamed, is checked strictly from its first line or fails here), with the core override's flags, and no module
    of the core's list."""
    strict = _strict_override(f"{STRICT_PACKAGES[0]}.*")
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for package in STRICT_PACKAGES for path in (ROOT / package.replace(".", "/")).rglob("*.py")}
    assert set(STRICT_PACKAGES) <= modules, "a strict package is gone: update STRICT_PACKAGES and pyproject.toml"
    assert sorted(m for m in modules if not any(_covers(p, m) for p in strict["module"])) == []
    core = _strict_override("kvemu")
    assert {k: v for k, v in strict.items() if k != "module"} == {k: v for k, v in core.items() if k != "module"}
    assert not [m for m in core["module"] if any(_covers(p, m) for p in strict["module"])]

"""Figures of the code's shape that #45 tracks: what a newcomer meets, counted the same way every time.

Run with ``python -m bench.architecture`` (``--quick`` is the same: it reads sources and runs one short virtual
``kvemu run``). Every figure is printed on stdout as ``figure name: value unit``. The counts read the source
with ``ast`` and ``tokenize`` over the packages ``kvemu``, ``workers`` and ``harness``:

- clock-kind questions: reads of a clock's ``is_virtual`` outside the choosers (the mode asked of the clock);
- run-mode branches: a comparison with the string ``"virtual"`` or ``"live"`` on one side and a name or
  attribute spelled ``mode``/``run_mode``/``*_mode`` on the other, outside the modules that choose the mode and
  the report (which describes a finished run's recorded mode);
- function-local imports: ``import`` statements inside a function body (all, then those of the project's own
  packages);
- ``type: ignore`` comments and uses of ``typing.Any`` (a name ``Any`` outside import lines);
- public names: the length of ``kvemu.__all__`` (the embedders' face), and of every module's ``__all__``;
- classes carrying a request id: classes that declare a ``request_id`` field (the forms a request and the
  messages about it take on its way);
- files one ``kvemu run`` loads: project modules in ``sys.modules`` after a short virtual run, in a fresh
  process.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tempfile
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import kvemu

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvemu", "workers", "harness")
MODE_WORDS = {"virtual", "live"}
CHOOSERS = frozenset({"workers/actor/drivers.py", "harness/run/mode.py", "harness/run/wiring.py"})
"""The modules that choose the mode's driver: the one place each that may ask which mode it is."""
DESCRIBERS = ("harness/report/",)
"""Where a finished run's mode is a recorded fact to describe (its summary's ``kvemu.mode``), not a branch."""

LOADED = """
import sys
from harness.cli import main
main(["run", "--quiet", "-o", sys.argv[1], sys.argv[2]])
root = sys.argv[3]
print(sum(1 for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(root)))
"""


def _sources() -> Iterator[tuple[str, str]]:
    """(module path relative to the root, source) of every project module."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()


def _is_mode(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "mode" or name.endswith("_mode")


def mode_branches(tree: ast.AST) -> int:
    """Comparisons of a mode with ``"virtual"``/``"live"``."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            sides = [node.left, node.comparators[0]]
            words = [s for s in sides if isinstance(s, ast.Constant) and s.value in MODE_WORDS]
            if words and any(_is_mode(s) for s in sides):
                count += 1
    return count


def clock_questions(tree: ast.AST) -> int:
    """Reads of a clock's ``is_virtual`` (the mode asked of the clock rather than by name)."""
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "is_virtual"
               and isinstance(node.ctx, ast.Load))


def local_imports(tree: ast.AST) -> tuple[int, int]:
    """(all, project's own) import statements inside function bodies."""
    total = own = 0
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import | ast.ImportFrom):
                total += 1
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level or \
                        any(n.split(".")[0] in PACKAGES for n in names):
                    own += 1
    return total, own


def ignores_and_any(source: str) -> tuple[int, int]:
    """(``type: ignore`` comments, uses of the name ``Any`` outside imports)."""
    ignores = anys = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and "type: ignore" in tok.string:
            ignores += 1
        elif tok.type == tokenize.NAME and tok.string == "Any" and not tok.line.lstrip().startswith(
                ("from ", "import ")):
            anys += 1
    return ignores, anys


def request_shapes(tree: ast.AST) -> list[str]:
    """Classes declaring a ``request_id`` field (an annotated class attribute)."""
    return [cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            and any(isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and s.target.id == "request_id" for s in cls.body)]


def public_names(tree: ast.AST) -> int:
    """The length of the module's literal ``__all__`` (0 without one)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, ast.List | ast.Tuple):
                return len(node.value.elts)
    return 0


def loaded_by_one_run(tmp: Path) -> int:
    """Project modules a short virtual ``kvemu run`` of the quickstart loads."""
    scenario = ROOT / "harness" / "quickstart.yaml"
    proc = subprocess.run([sys.executable, "-c", LOADED, str(tmp / "out"), str(scenario), str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return int(proc.stdout.split()[-1])


class Counts(NamedTuple):
    """The source counts, over every project module."""

    files: int
    branches: dict[str, int]
    clock_questions: dict[str, int]
    local_imports: int
    own_local_imports: int
    type_ignores: int
    anys: int
    public_names: int
    request_classes: list[str]


def count() -> Counts:
    """Read every project module once."""
    branches: dict[str, int] = {}
    questions: dict[str, int] = {}
    files = local = own = ignores = anys = public = 0
    shapes: list[str] = []
    for name, source in _sources():
        tree = ast.parse(source)
        files += 1
        if name not in CHOOSERS and not name.startswith(DESCRIBERS) and (n := mode_branches(tree)):
            branches[name] = n
        if name not in CHOOSERS and (n := clock_questions(tree)):
            questions[name] = n
        module_local, module_own = local_imports(tree)
        module_ignores, module_anys = ignores_and_any(source)
        local, own = local + module_local, own + module_own
        ignores, anys = ignores + module_ignores, anys + module_anys
        public += public_names(tree)
        shapes += request_shapes(tree)
    return Counts(files, branches, questions, local, own, ignores, anys, public, shapes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.architecture", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same figures (they take seconds)")
    parser.parse_args(argv)
    c = count()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = loaded_by_one_run(Path(tmp))
    for name, n in sorted(c.branches.items()):
        print(f"  {name}: {n} run-mode branches", file=sys.stderr)
    print(f"  classes carrying a request id: {', '.join(sorted(c.request_classes))}", file=sys.stderr)
    print(f"modules: {c.files} files")
    print(f"run-mode branches: {sum(c.branches.values())} branches")
    print(f"files with run-mode branches: {len(c.branches)} files")
    for name, n in sorted(c.clock_questions.items()):
        print(f"  {name}: {n} reads of clock.is_virtual", file=sys.stderr)
    print(f"clock-kind questions: {sum(c.clock_questions.values())} reads")
    print(f"function-local imports: {c.local_imports} imports")
    print(f"function-local imports of the project: {c.own_local_imports} imports")
    print(f"type ignores: {c.type_ignores} comments")
    print(f"uses of Any: {c.anys} names")
    print(f"kvemu public names: {len(kvemu.__all__)} names")
    print(f"public names in every __all__: {c.public_names} names")
    print(f"classes carrying a request id: {len(c.request_classes)} classes")
    print(f"modules loaded by one kvemu run: {loaded} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

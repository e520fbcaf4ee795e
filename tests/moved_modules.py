"""Checks shared by the tests of modules that moved (``tests/*/test_moved_modules.py``): an old path is a
deprecated alias that warns at the importer's line and gives the new module's names; no module imports an old path."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kvemu", "workers", "harness", "bench", "examples", "tests")


def assert_alias(old: str, new: str) -> None:
    """Importing ``old`` for the first time warns (naming ``new``, blaming the importer) and gives ``new``'s
    public names as the same objects."""
    moved = importlib.import_module(new)
    sys.modules.pop(old, None)  # a first import in this process: the warning is the module's own code
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is deprecated: import from {re.escape(new)}$") as got:
        exec(f"import {old}", {})  # noqa: S102  (the statement outside code writes)
    assert [w.filename for w in got if w.category is DeprecationWarning] == ["<string>"], "blame the importer"
    alias = sys.modules[old]
    assert moved.__all__ and sorted(alias.__all__) == sorted(moved.__all__)
    for name in moved.__all__:
        assert getattr(alias, name) is getattr(moved, name), name


def imports_of(old: set[str], packages: set[str], skip: Path) -> list[str]:
    """``file:line: module`` for every import of a module in ``old`` by the repository's modules (function-local
    imports, ``import a.b`` and ``from package import module`` of a package in ``packages`` included), the old
    modules themselves and ``skip`` aside."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
            if path == skip or module in old:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if isinstance(node, ast.ImportFrom) and node.module in packages:
                    names += [f"{node.module}.{a.name}" for a in node.names]
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n in old]
    return found

"""The API pages (docs/api/*.md) name only objects that exist, and every public name of a module they document.

Each ``::: dotted.name`` line of a page is an object mkdocstrings renders from its docstring, under its own
heading (anchor ``dotted.name``). A name must resolve twice: by import, and by griffe's static analysis, which is
what mkdocstrings reads (a name bound by tuple unpacking, say, imports but cannot be collected, and the build
fails). Every name in the ``__all__`` of a module a page documents (``kvemu``, ``kvemu.kv_events``, ...) has an
entry (a class or function re-exported by the face, under one of its names), so a new public name cannot go
undocumented, and each has a docstring. ``mkdocs build --strict``
in CI renders them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
PAGES = sorted(API.glob("*.md"))
IDENTIFIER = re.compile(r"^::: ([A-Za-z_][\w.]*)\s*$", re.MULTILINE)


def identifiers() -> dict[str, Path]:
    """Every ``::: name`` of the API pages, with the page naming it (a name documented twice fails here)."""
    seen: dict[str, Path] = {}
    for page in PAGES:
        for name in IDENTIFIER.findall(page.read_text()):
            assert name not in seen, f"{name} is documented on both {seen[name].name} and {page.name}"
            seen[name] = page
    return seen


def module_of(name: str) -> tuple[ModuleType, str]:
    """The longest importable module prefix of ``name``, and the attribute path after it ('' for the module)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        return module, ".".join(parts[cut:])
    raise ModuleNotFoundError(name)


def test_the_api_pages_exist_and_name_objects() -> None:
    assert PAGES and all(IDENTIFIER.search(p.read_text()) for p in PAGES if p.name != "index.md"), PAGES


def test_every_identifier_imports() -> None:
    """... and under their own module's name, not a deprecated alias of the face (``kvemu.Flight``)."""
    missing = []
    for name, page in identifiers().items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                resolve(name)
        except (ImportError, AttributeError, DeprecationWarning) as e:
            missing.append(f"{page.name}: {name} ({e})")
    assert not missing, f"API pages name objects that do not import: {missing}"


@functools.cache
def collected() -> tuple[dict[str, object], list[str]]:
    """What griffe (mkdocstrings' reader) finds for each identifier, and the identifiers it cannot collect."""
    griffe = pytest.importorskip("griffe")
    # sources only, as mkdocs.yml says: beside a compiled build's .so, inspecting would find mypyc's functions
    # without their docstrings
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], allow_inspection=False)
    for package in sorted({name.split(".")[0] for name in identifiers()}):
        loader.load(package)
    loader.resolve_aliases(implicit=False, external=False)
    modules = loader.modules_collection
    found, missing = {}, []
    for name, page in identifiers().items():
        top, _, rest = name.partition(".")
        try:
            obj = modules[top][rest] if rest else modules[top]
            obj.kind  # noqa: B018  (an alias resolves its target here, or raises)
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError) as e:
            missing.append(f"{page.name}: {name} ({type(e).__name__}: {e})")
        else:
            found[name] = obj
    return found, missing


def test_every_identifier_is_found_by_static_analysis() -> None:
    missing = collected()[1]
    assert not missing, f"API pages name objects mkdocstrings cannot collect: {missing}"


def test_every_documented_object_has_a_docstring() -> None:
    bare = [name for name, obj in collected()[0].items() if not getattr(obj, "docstring", None)]
    assert not bare, f"public objects with no docstring (a line: what it is, and why): {bare}"


def resolve(name: str) -> object:
    """The object a dotted name imports as."""
    module, attrs = module_of(name)
    obj: object = module
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def test_every_public_name_of_a_documented_module_has_an_entry() -> None:
    """A class or function is documented once: ``kvemu.Dispatch`` (the face) is covered by the entry of
    ``kvemu.messages.Dispatch``, and ``kvemu.errors.KvemuError`` by that of ``kvemu.KvemuError``."""
    names = identifiers()
    modules = {module_of(name)[0] for name in names} | {importlib.import_module("kvemu")}
    covered = {id(obj) for obj in map(resolve, names) if isinstance(obj, type) or inspect.isroutine(obj)}
    missing = [f"{module.__name__}.{public}" for module in sorted(modules, key=lambda m: m.__name__)
               for public in getattr(module, "__all__", ())
               if not public.startswith("__") and f"{module.__name__}.{public}" not in names
               and not ((isinstance(obj := getattr(module, public), type) or inspect.isroutine(obj))
                        and id(obj) in covered)]
    assert not missing, f"public names with no ::: entry in docs/api/*.md: {missing}"


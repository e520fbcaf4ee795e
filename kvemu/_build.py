"""Which build runs: the mypyc-compiled hot modules or their pure-Python sources (the reference).

``kvemu/__init__.py`` imports this first, before any compiled module can load. It reads the manifest the
compiled build wrote (``kvemu/_mypyc_manifest.json``: each compiled module's source hash) and installs
``PurePythonFinder`` on ``sys.meta_path``, so every compiled module is imported from its ``.py`` instead, when
``KVEMU_PURE_PYTHON=1`` or when a source changed since the build (a stale extension must never run old code
silently; that case warns once). Never compiled itself.

It also decides, once, whether the native C extensions the build recorded under ``"native"`` (today
``kvemu._blockhash``, the rolling sequence hash; ``kvemu._loadtable``, ``kvemu.load.LoadTracker``'s block table;
``kvemu._blockpool``, ``workers.blocks.BlockPool``'s tables; ``kvemu._blockmap``, ``kvemu.index.PrefixIndex``'s
per-block maps)
are used: not under ``KVEMU_PURE_PYTHON=1``, not when their C source changed since the build; their callers ask
``use_native(name)`` and otherwise run the Python reference.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

__all__ = ["COMPILED_MODULES", "NATIVE_MODULES", "PurePythonFinder", "build_name", "is_compiled", "STALE",
           "use_native"]

_MANIFEST = Path(__file__).with_name("_mypyc_manifest.json")
_ROOT = Path(__file__).resolve().parent.parent


def _read_manifest(key: str = "modules") -> dict[str, str]:
    """Module name -> source sha256 at build time (``"modules"``: mypyc-compiled, source ``<module>.py``;
    ``"native"``: C extensions, ``native_digest``); empty when that part was not built."""
    try:
        return {str(k): str(v) for k, v in json.loads(_MANIFEST.read_text())[key].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _source(name: str) -> Path:
    return _ROOT.joinpath(*name.split(".")).with_suffix(".py")


def native_source(name: str) -> Path:
    """The C source of native module ``name`` (``kvemu._blockhash`` -> ``kvemu/_native/blockhash.c``)."""
    package, _, leaf = name.rpartition(".")
    return _ROOT.joinpath(*package.split("."), "_native", leaf.lstrip("_") + ".c")


def _source_digest(name: str) -> str:
    """sha256 of compiled module ``name``'s ``.py`` source, as the build recorded it."""
    return hashlib.sha256(_source(name).read_bytes()).hexdigest()


def native_digest(name: str) -> str:
    """sha256 of native module ``name``'s C source followed by every header beside it (``kvemu/_native/*.h``, by
    name), as setup.py records it: an edited shared header makes every native module stale."""
    source = native_source(name)
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()


def _stale(modules: dict[str, str], digest: Callable[[str], str] = _source_digest) -> list[str]:
    """The compiled modules whose source no longer matches the one they were compiled from."""
    out = []
    for name, recorded in modules.items():
        try:
            current = digest(name)
        except OSError:
            continue  # an install without the sources: nothing to compare, nothing to fall back to
        if current != recorded:
            out.append(name)
    return out


class PurePythonFinder:
    """A meta-path finder that imports the named modules from their ``.py`` files, never an extension."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self.names:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path if path is not None else sys.path:
            candidate = os.path.join(entry, leaf)
            if os.path.isfile(candidate):
                loader = importlib.machinery.SourceFileLoader(fullname, candidate)
                return importlib.util.spec_from_file_location(fullname, candidate, loader=loader)
        return None


_HASHES = _read_manifest()
COMPILED_MODULES: tuple[str, ...] = tuple(sorted(_HASHES))
"""The modules the installed build compiled (empty for a pure-Python install)."""

STALE: tuple[str, ...] = ()
"""Compiled modules found stale at import (their sources were edited after the build)."""

_forced = os.environ.get("KVEMU_PURE_PYTHON", "") not in ("", "0")
if COMPILED_MODULES:
    if not _forced:
        STALE = tuple(_stale(_HASHES))
        if STALE:
            warnings.warn(
                f"kvemu: {len(STALE)} compiled module(s) are older than their sources ({', '.join(STALE[:3])}"
                f"{', ...' if len(STALE) > 3 else ''}); running pure Python. Rebuild: pip install -e .",
                RuntimeWarning, stacklevel=2)
    if _forced or STALE:
        sys.meta_path.insert(0, PurePythonFinder(COMPILED_MODULES))


_NATIVE_HASHES = _read_manifest("native")
_NATIVE_STALE = () if _forced else tuple(_stale(_NATIVE_HASHES, native_digest))
if _NATIVE_STALE:
    warnings.warn(f"kvemu: native module(s) {', '.join(_NATIVE_STALE)} are older than their C sources; running "
                  "their pure-Python reference. Rebuild: pip install -e .", RuntimeWarning, stacklevel=2)
NATIVE_MODULES: tuple[str, ...] = () if _forced else tuple(sorted(set(_NATIVE_HASHES) - set(_NATIVE_STALE)))
"""The native C modules this process uses (built, fresh, and KVEMU_PURE_PYTHON not set)."""


def use_native(name: str) -> bool:
    """Whether native module ``name`` may be imported in place of its pure-Python reference."""
    return name in NATIVE_MODULES


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension (compiled), not from Python source."""
    return not str(getattr(module, "__file__", "") or "").endswith((".py", ".pyc"))


def build_name() -> str:
    """``"compiled"`` when every compiled module imported so far is the extension, ``"pure"`` when none is
    (or no compiled build is installed), ``"mixed"`` otherwise (a bug: reported, not hidden)."""
    loaded = [sys.modules[name] for name in COMPILED_MODULES if name in sys.modules]
    flags = {is_compiled(m) for m in loaded}
    if flags == {True}:
        return "compiled"
    if True in flags:
        return "mixed"
    return "pure"

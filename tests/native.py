"""Loading a native module under test, for the ``tests/kvemu/test_native_<leaf>.py`` files.

``.ci/sanitize`` builds each ``kvemu/_native/<leaf>.c`` alone under ASan+UBSan and names the ``.so`` in
``KVEMU_NATIVE_<LEAF>``; the tests then run against that file. Otherwise they run against the installed build,
skipping when it is absent (a ``KVEMU_NO_COMPILE=1`` or compiler-less install) or failing under
``KVEMU_REQUIRE_COMPILED=1``. ``KVEMU_NATIVE_EXAMPLES`` sets the hypothesis examples of their differential and
fuzz tests (raised by ``.ci/sanitize`` for a bounded fuzz).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = int(os.environ.get("KVEMU_NATIVE_EXAMPLES", "300"))
"""Hypothesis examples for a native module's differential and fuzz tests."""


def override_env(name: str) -> str:
    """The variable naming a sanitizer build of native module ``name`` (``kvemu._blockhash`` ->
    ``KVEMU_NATIVE_BLOCKHASH``)."""
    return "KVEMU_NATIVE_" + name.rpartition(".")[2].lstrip("_").upper()


def under_sanitizer(name: str) -> bool:
    """Whether a sanitizer build outside the package is under test (installed-build checks then skip)."""
    return bool(os.environ.get(override_env(name)))


def load_native(name: str) -> ModuleType:
    """The extension under test: the ``.so`` its ``KVEMU_NATIVE_<LEAF>`` names, else the built module."""
    path = os.environ.get(override_env(name))
    try:
        if path:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None, path
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except ImportError as exc:
        reason = f"{name} is not built ({exc}): a KVEMU_NO_COMPILE=1 or compiler-less install"
    if os.environ.get("KVEMU_REQUIRE_COMPILED", "") not in ("", "0"):
        pytest.fail(f"KVEMU_REQUIRE_COMPILED=1 but {reason}")
    pytest.skip(reason)


def selected(name: str, probe: str, *, pure: bool) -> dict[str, bool]:
    """What a fresh process reports of native module ``name``: ``probe`` prints a JSON object (whether the
    native path is in use: ``native``), to which ``loaded`` (the module was imported) is added. ``pure``: with
    ``KVEMU_PURE_PYTHON=1``; the sanitizer override is never passed on."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVEMU_PURE_PYTHON", override_env(name))}
    if pure:
        env["KVEMU_PURE_PYTHON"] = "1"
    code = f"{probe}\nimport json, sys\nprint(json.dumps({{**SELECTED, 'loaded': {name!r} in sys.modules}}))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def assert_built_and_selected(name: str, probe: str) -> None:
    """The installed build records ``name`` in its manifest and a process without the switch uses it (skipped
    when a sanitizer build outside the package is under test)."""
    from kvemu import _build

    if under_sanitizer(name):
        pytest.skip("a sanitizer build outside the package is under test")
    if name not in _build._read_manifest("native"):
        pytest.fail(f"{name} imports but the build manifest does not record it")
    assert selected(name, probe, pure=False) == {"native": True, "loaded": True}


def assert_stale_when_edited(name: str) -> None:
    """The same guard as for the mypyc modules: an old extension never runs silently over a changed source."""
    from kvemu import _build

    source = _build.native_source(name)
    assert source == ROOT / "kvemu" / "_native" / (name.rpartition(".")[2].lstrip("_") + ".c") and source.is_file()
    assert _build._stale({name: "0" * 64}, _build.native_digest) == [name]
    assert _build._stale({name: _build.native_digest(name)}, _build.native_digest) == []

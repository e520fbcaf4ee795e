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
import os
from types import ModuleType

import pytest

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

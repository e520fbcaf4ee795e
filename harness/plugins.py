"""Code a scenario names (``module:callable``): imported off the working directory unless allowed."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from harness.scenario import ScenarioError

__all__ = ["ALLOW_LOCAL_POLICIES_ENV", "import_callable"]

ALLOW_LOCAL_POLICIES_ENV = "KVEMU_ALLOW_LOCAL_POLICIES"
"""Set to ``1`` (``--allow-local-policies``) to let scenario policies import modules from the working directory."""


def _import_module(module: str, allow_local: bool) -> Any:
    """Import a policy's module with the working directory first on the import path if ``allow_local``, else off
    it, so that a file next to a scenario stands in for the module the scenario names only when the user says so
    (an installed console script never has the working directory on the path; ``python -m`` always has)."""
    cwd = os.path.realpath(os.getcwd())
    saved = sys.path[:]
    others = [p for p in saved if os.path.realpath(p or ".") != cwd]
    sys.path[:] = [cwd, *others] if allow_local else others
    try:
        return importlib.import_module(module)
    finally:
        sys.path[:] = saved


def import_callable(name: str, key: str) -> Any:
    """The object ``module:attr`` names; a ``ScenarioError`` naming the scenario ``key`` if it cannot be had."""
    module, _, attr = name.partition(":")
    local = os.environ.get(ALLOW_LOCAL_POLICIES_ENV) == "1"
    try:
        return getattr(_import_module(module, local), attr)
    except ImportError as exc:
        hint = "" if local else "; the working directory is not searched (--allow-local-policies searches it)"
        raise ScenarioError(f"{key}: cannot import module {module!r} ({exc}); is it on PYTHONPATH?{hint}") from None
    except AttributeError:
        raise ScenarioError(f"{key}: module {module!r} has no {attr!r}") from None

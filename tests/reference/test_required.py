"""``KVEMU_REQUIRE_REFERENCE=1`` turns a missing or broken reference binding into failures (tests/conftest.py).

Each case runs pytest in a subprocess with a plugin (``-p``) that breaks the binding first, and reads the
outcome of every test from a JUnit XML report. Not a ``reference`` test itself: it needs no binding.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import pytest_outcomes
from tests.pytest_outcomes import Outcomes

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = Path(__file__).parents[1] / "conftest.py"
INSTALL = "pip install 'ai-dynamo-runtime==1.6.1'"

BREAK_IMPORT = '''
import sys

class _Broken:
    """Every import of dynamo._core raises, as when the wheel's native library cannot be loaded."""

    def find_spec(self, name, path=None, target=None):
        if name == "dynamo._core":
            raise ImportError("libdynamo.so: cannot open shared object file (simulated)")
        return None

sys.modules.pop("dynamo._core", None)
sys.meta_path.insert(0, _Broken())
'''

WRONG_VERSION = '''
import importlib.metadata
import sys
import types

sys.modules["dynamo._core"] = types.ModuleType("dynamo._core")  # importable, whatever is installed
_version = importlib.metadata.version

def version(name):
    return "1.5.0" if name == "ai-dynamo-runtime" else _version(name)

importlib.metadata.version = version
'''

SYNTHETIC_TESTS = '''
import pytest


@pytest.mark.reference
def test_uses_the_binding(dynamo_core):
    pass


@pytest.mark.reference
def test_reference_skipping_for_another_reason():
    pytest.skip("the trace is not there")


def test_ordinary_skip():
    pytest.skip("not a reference test")


@pytest.mark.reference
@pytest.mark.xfail(reason="a known divergence", strict=True)
def test_reference_xfail():
    assert False
'''

MODULE_SKIP = '''
import pytest

pytest.skip("no binding, no module", allow_module_level=True)

pytestmark = pytest.mark.reference


def test_never_collected():
    pass
'''


def run_pytest(tmp_path: Path, shim: str, args: list[str], *, require: bool, cwd: Path) -> tuple[int, Outcomes, str]:
    """Run pytest with ``shim`` loaded as a plugin; (exit code, {test name: (outcome, message)}, output)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "kvemu_test_shim.py").write_text(shim)
    env = {k: v for k, v in os.environ.items() if k not in ("KVEMU_REQUIRE_REFERENCE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugins), *filter(None, [env.get("PYTHONPATH")])])
    if require:
        env["KVEMU_REQUIRE_REFERENCE"] = "1"
    return pytest_outcomes.run_pytest(["-p", "kvemu_test_shim", *args], env=env, cwd=cwd,
                                      report=tmp_path / f"report-{require}.xml")


REAL_TESTS = [
    "tests/kvemu/wire/test_convert.py::test_mm_hashes_match_the_reference_binding",  # fixture in a test
    "tests/reference/test_index.py::test_invalid_tokens_rejected_by_both",  # fixture bound for a module
]


def test_broken_binding_skips_reference_tests_without_the_variable(tmp_path):
    code, outcomes, out = run_pytest(tmp_path, BREAK_IMPORT, REAL_TESTS, require=False, cwd=ROOT)
    assert code == 0, out
    assert len(outcomes) == 2 and all(o == "skipped" for o, _ in outcomes.values()), outcomes
    for _, message in outcomes.values():
        assert "cannot open shared object file (simulated)" in message and INSTALL in message, message
        assert "KVEMU_REQUIRE_REFERENCE=1" in message


def test_broken_binding_fails_reference_tests_under_the_variable(tmp_path):
    code, outcomes, out = run_pytest(tmp_path, BREAK_IMPORT, REAL_TESTS, require=True, cwd=ROOT)
    assert code == 1, out
    assert len(outcomes) == 2 and all(o == "error" for o, _ in outcomes.values()), outcomes  # fails in setup
    for _, message in outcomes.values():
        assert "KVEMU_REQUIRE_REFERENCE=1 but the reference binding cannot be imported" in message, message
        assert "cannot open shared object file (simulated)" in message and INSTALL in message, message
    assert "KVEMU_REQUIRE_REFERENCE=1 but the reference binding cannot be imported" in out  # on the console


def _synthetic(tmp_path: Path) -> Path:
    tree = tmp_path / "project"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    (tree / "tests" / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
    (tree / "tests" / "test_module_skip.py").write_text(MODULE_SKIP)
    (tree / "pytest.ini").write_text("[pytest]\nmarkers =\n    reference: needs the reference binding\n")
    return tree


def test_safety_net_without_the_variable_leaves_skips_alone(tmp_path):
    tree = _synthetic(tmp_path)
    code, outcomes, out = run_pytest(tmp_path, WRONG_VERSION, ["--continue-on-collection-errors"],
                                     require=False, cwd=tree)
    assert code == 0, out
    assert outcomes["test_uses_the_binding"][0] == "skipped"
    assert "ai-dynamo-runtime 1.5.0 is installed where the reference tests pin" in outcomes["test_uses_the_binding"][1]
    assert outcomes["test_reference_skipping_for_another_reason"][0] == "skipped"
    assert outcomes["test_ordinary_skip"][0] == "skipped"
    assert outcomes["test_reference_xfail"][0] == "xfailed"
    module = [o for name, o in outcomes.items() if "module_skip" in name]
    assert module and module[0][0] == "skipped", outcomes


def test_safety_net_under_the_variable_fails_every_reference_skip(tmp_path):
    tree = _synthetic(tmp_path)
    code, outcomes, out = run_pytest(tmp_path, WRONG_VERSION, ["--continue-on-collection-errors"],
                                     require=True, cwd=tree)
    assert code == 1, out
    outcome, message = outcomes["test_uses_the_binding"]
    assert outcome == "error" and "KVEMU_REQUIRE_REFERENCE=1 but ai-dynamo-runtime 1.5.0 is installed" in message
    assert INSTALL in message
    outcome, message = outcomes["test_reference_skipping_for_another_reason"]
    assert outcome == "failure" and "was skipped, which counts as a failure: the trace is not there" in message
    assert outcomes["test_ordinary_skip"][0] == "skipped"  # only reference tests are affected
    assert outcomes["test_reference_xfail"][0] == "xfailed"  # an expected failure is not a skip
    module = [o for name, o in outcomes.items() if "module_skip" in name]
    assert module and module[0][0] == "error", outcomes
    assert "skipped itself while being collected: no binding, no module" in module[0][1]

"""``KVEMU_REQUIRE_ORACLE=1`` turns a missing oracle venv, and any skip of an ``oracle`` test, into failures.

Each case runs pytest in a subprocess (``KVEMU_ORACLE_VENV`` pointing at an empty folder) and reads every
test's outcome from a JUnit XML report. Not an ``oracle`` test itself: it needs no oracle.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import pytest_outcomes
from tests.pytest_outcomes import Outcomes

ROOT = Path(__file__).resolve().parents[2]
BUILD = "python -m tests.oracle.env"

SYNTHETIC_CONFTEST = '''
from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
from tests.oracle.conftest import oracle_python  # noqa: F401
'''

SYNTHETIC_TESTS = '''
import pytest


@pytest.mark.oracle
def test_uses_the_oracle(oracle_python):
    pass


@pytest.mark.oracle
def test_oracle_skipping_for_another_reason():
    pytest.skip("the trace is not there")


def test_ordinary_skip():
    pytest.skip("not an oracle test")
'''

MODULE_SKIP = '''
import pytest

pytest.skip("no oracle, no module", allow_module_level=True)

pytestmark = pytest.mark.oracle


def test_never_collected():
    pass
'''


def run_pytest(tmp_path: Path, args: list[str], *, require: bool, cwd: Path) -> tuple[int, Outcomes, str]:
    """(exit code, {test name: (outcome, message)}, output) of pytest run with no oracle venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVEMU_REQUIRE_ORACLE", "PYTEST_ADDOPTS")}
    env["KVEMU_ORACLE_VENV"] = str(tmp_path / "no-oracle-here")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if require:
        env["KVEMU_REQUIRE_ORACLE"] = "1"
    return pytest_outcomes.run_pytest(args, env=env, cwd=cwd, report=tmp_path / f"report-{require}.xml")


def test_missing_oracle_skips_with_the_build_command(tmp_path: Path) -> None:
    code, outcomes, out = run_pytest(tmp_path, ["tests/oracle/test_driver.py"], require=False, cwd=ROOT)
    assert code == 0, out
    assert outcomes and all(o == "skipped" for o, _ in outcomes.values()), outcomes
    for _, message in outcomes.values():
        assert "no oracle venv at" in message and BUILD in message and "KVEMU_REQUIRE_ORACLE=1" in message


def test_missing_oracle_fails_under_the_variable(tmp_path: Path) -> None:
    code, outcomes, out = run_pytest(tmp_path, ["tests/oracle/test_driver.py"], require=True, cwd=ROOT)
    assert code == 1, out
    assert outcomes and all(o == "error" for o, _ in outcomes.values()), outcomes  # fails in setup
    for _, message in outcomes.values():
        assert "KVEMU_REQUIRE_ORACLE=1 but no oracle venv at" in message and BUILD in message


def _synthetic(tmp_path: Path) -> Path:
    tree = tmp_path / "project"
    (tree / "checks").mkdir(parents=True)
    (tree / "checks" / "conftest.py").write_text(SYNTHETIC_CONFTEST)
    (tree / "checks" / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
    (tree / "checks" / "test_module_skip.py").write_text(MODULE_SKIP)
    (tree / "pytest.ini").write_text("[pytest]\nmarkers =\n    oracle: needs the oracle venv\n")
    return tree


def test_safety_net_without_the_variable_leaves_skips_alone(tmp_path: Path) -> None:
    code, outcomes, out = run_pytest(tmp_path, ["--continue-on-collection-errors"], require=False,
                                     cwd=_synthetic(tmp_path))
    assert code == 0, out
    assert {name: o for name, (o, _) in outcomes.items() if name.startswith("test_")} == {
        "test_uses_the_oracle": "skipped", "test_oracle_skipping_for_another_reason": "skipped",
        "test_ordinary_skip": "skipped"}
    module = [o for name, (o, _) in outcomes.items() if "module_skip" in name]
    assert module == ["skipped"], outcomes


def test_safety_net_under_the_variable_fails_every_oracle_skip(tmp_path: Path) -> None:
    code, outcomes, out = run_pytest(tmp_path, ["--continue-on-collection-errors"], require=True,
                                     cwd=_synthetic(tmp_path))
    assert code == 1, out
    outcome, message = outcomes["test_uses_the_oracle"]
    assert outcome == "error" and "KVEMU_REQUIRE_ORACLE=1 but no oracle venv" in message
    outcome, message = outcomes["test_oracle_skipping_for_another_reason"]
    assert outcome == "failure" and "was skipped, which counts as a failure: the trace is not there" in message
    assert outcomes["test_ordinary_skip"][0] == "skipped"  # only oracle tests are affected
    module = [(o, m) for name, (o, m) in outcomes.items() if "module_skip" in name]
    assert module and module[0][0] == "error", outcomes
    assert "skipped itself while being collected: no oracle, no module" in module[0][1]

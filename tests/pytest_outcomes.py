"""Run pytest in a subprocess and read every test's outcome from its JUnit XML report.

The required-variable tests (tests/reference/test_required.py, tests/oracle/test_required.py) check what a
whole pytest run reports under ``KVEMU_REQUIRE_REFERENCE`` / ``KVEMU_REQUIRE_ORACLE``, which no in-process
test can see.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

Outcomes = dict[str, tuple[str, str]]
"""{test name: (outcome, message)}; outcome is passed, failure, error, skipped or xfailed."""


def run_pytest(args: list[str], *, env: dict[str, str], cwd: Path, report: Path) -> tuple[int, Outcomes, str]:
    """(exit code, outcomes, console output) of ``python -m pytest args`` in ``cwd`` with ``env``."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                           f"--junitxml={report}", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    outcomes: Outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, f"{child.get('message', '')}\n{child.text or ''}"
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                break
        outcomes[case.get("name", "")] = (outcome, message)
    return proc.returncode, outcomes, proc.stdout + proc.stderr

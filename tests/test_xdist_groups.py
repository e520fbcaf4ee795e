"""The process tests run one at a time on one pytest-xdist worker (``tests/conftest.py``'s ``PROCESS_GROUP``), and
the oracles' tests on one worker (``ORACLE_GROUP``), as ``.ci/run`` asks with ``--dist loadgroup``. Checked in a
small pytest session of its own, because the grouping fails silently (pytest 9.2 with pytest-xdist 3.8, or a group
mark added after xdist read the marks), and then process tests starve each other on two cores and a module's
expensive fixture is built once per worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import RERUN_ENV

ROOT = Path(__file__).resolve().parents[1]

_CONFTEST = "from tests.conftest import pytest_collection_modifyitems  # noqa: F401 - the hook under test\n"
_GROUPED = '''import os


def _ran(name):
    with open({ran!r}, "a") as f:
        f.write(f"{{name}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")


{tests}
'''


def test_the_process_tests_run_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    def module(path: Path, kind: str, n: int, mark: str = "") -> None:
        """A test module of ``n`` tests that note their ``kind`` and their worker."""
        tests = "\n".join(f"{mark}def test_{i}():\n    _ran({kind!r})\n" for i in range(n))
        path.parent.mkdir(exist_ok=True)
        path.write_text(_GROUPED.format(ran=str(tmp_path / "ran.txt"), tests=f"import pytest\n\n{tests}"))

    (tmp_path / "conftest.py").write_text(_CONFTEST)
    for i in range(3):  # grouped by their path (end_to_end) and by their marker
        module(tmp_path / "end_to_end" / f"test_e2e_{i}.py", "process", 4)
    module(tmp_path / "test_marked.py", "process", 4, "@pytest.mark.process_supervision\n")
    for i in range(2):
        module(tmp_path / "oracle" / f"test_oracle_{i}.py", "oracle", 3)
    module(tmp_path / "test_plain.py", "plain", 40)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop(RERUN_ENV, None)  # (the compiled re-run skips process tests; this session runs them all)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert len(ran) == 62
    assert len({worker for kind, worker in ran if kind == "process"}) == 1, ran
    assert len({worker for kind, worker in ran if kind == "oracle"}) == 1, ran
    assert len({worker for kind, worker in ran}) == 2, ran  # the other tests ran beside them

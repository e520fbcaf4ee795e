"""``kvemu up`` run from a project that has its own ``harness/``, ``workers/`` and ``kvemu/`` folders: the
router, worker and loadgen child processes must import kvemu's packages, never the project's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

_script = Path(sys.executable).with_name("kvemu")
# The installed console script, as a user runs it (its own sys.path[0] is its bin directory, not the working
# directory); without one, ``-P`` keeps this parent process itself off the decoys.
KVEMU = [str(_script)] if _script.exists() else [sys.executable, "-P", "-m", "harness.cli"]

DECOY = """import pathlib
pathlib.Path({marker!r}).write_text(__name__ + " imported from " + __file__)
raise ImportError("decoy {name} imported instead of kvemu's")
"""


@pytest.mark.process_supervision
@pytest.mark.parametrize("decoys", [("harness", "workers", "kvemu"), ("workers",)], ids=["all", "workers"])
def test_up_children_do_not_import_the_working_directorys_packages(tmp_path, decoys):
    project = tmp_path / "project"
    markers = tmp_path / "markers"
    markers.mkdir()
    for name in decoys:
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(DECOY.format(marker=str(markers / name), name=name))
        (project / name / "cli.py").write_text(DECOY.format(marker=str(markers / f"{name}.cli"), name=name))
    (project / "s.yaml").write_text("""
name: decoys
cluster: {workers: 1, dp_size: 1, engine: {speedup_ratio: 50, decode_speedup_ratio: 50, block_size: 16}}
workload: {kind: synthetic, rate_rps: 10, turns: 1, system_prefix_tokens: 32,
           isl: {kind: constant, mean: 64}, osl: {kind: constant, mean: 4}}
run: {mode: live, seed: 1, duration_s: 0.5}
""")
    res = subprocess.run([*KVEMU, "up", "s.yaml", "-o", "out"], cwd=project, capture_output=True, text=True,
                         timeout=90)
    imported = {p.name: p.read_text() for p in markers.iterdir()}
    assert not imported, f"decoys imported: {imported}\n{res.stderr[-2000:]}"
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((project / "out" / "summary.json").read_text())  # relative paths still mean the cwd
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    assert (project / "out" / "report.md").exists()

"""A sweep through a real Dask cluster: a scheduler and two workers as processes on 127.0.0.1 give sweep.csv
byte for byte as the local process pool does (every run is deterministic, wherever it runs)."""

import json

import pytest

from bench.sweep import local_dask_cluster
from tests.harness.test_cli import kvemu

pytest.importorskip("distributed", reason="dask.distributed is not installed: pip install 'kvemu[dask]'")

SWEEP = ("set: {run.duration_s: 5, workload.rate_rps: 1}\n"
         "axes:\n  cluster.workers: [1, 2, 3]\n")


@pytest.fixture
def dask_cluster(tmp_path):
    """``tcp://127.0.0.1:PORT`` of a scheduler with two single-threaded workers, all bound to 127.0.0.1."""
    with local_dask_cluster(tmp_path, workers=2) as address:
        assert address.startswith("tcp://127.0.0.1:")
        yield address


@pytest.mark.sweep_executors
def test_a_sweep_on_dask_equals_the_local_pool_byte_for_byte(tmp_path, dask_cluster):
    (tmp_path / "s.yaml").write_text(SWEEP)
    local = kvemu("sweep", "s.yaml", "--jobs", "2", "-o", "local", "--quiet", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    remote = kvemu("sweep", "s.yaml", "--address", dask_cluster, "-o", "dask", "--quiet", cwd=tmp_path)
    assert remote.returncode == 0, remote.stderr
    assert f"on Dask at {dask_cluster}" in remote.stderr and "3 ok (3 ran now, 0 reused)" in remote.stderr
    csv = (tmp_path / "local" / "sweep.csv").read_bytes()
    assert csv.count(b",ok,") == 3
    assert (tmp_path / "dask" / "sweep.csv").read_bytes() == csv
    timing = json.loads((tmp_path / "dask" / "sweep.json").read_text())["timing"]
    assert timing["executor"] == f"Dask at {dask_cluster}" and timing["runs_ran"] == 3

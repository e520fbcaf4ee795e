"""A sweep through a real Dask cluster: a scheduler and two workers as processes on 127.0.0.1 give sweep.csv
byte for byte as the local process pool does (every run is deterministic, wherever it runs)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import kvemu

distributed = pytest.importorskip("distributed", reason="dask.distributed is not installed: pip install 'kvemu[dask]'")

SWEEP = ("set: {run.duration_s: 5, workload.rate_rps: 1}\n"
         "axes:\n  cluster.workers: [1, 2, 3]\n")


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """A Dask process in a session of its own (its nanny's worker process too), to stop as a group."""
    return subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@pytest.fixture
def dask_cluster(tmp_path):
    """``tcp://127.0.0.1:PORT`` of a scheduler with two single-threaded workers, all bound to 127.0.0.1."""
    info = tmp_path / "scheduler.json"
    procs = [start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                    "--scheduler-file", str(info)], tmp_path)]
    try:
        deadline = time.monotonic() + 60
        while not info.exists() and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the scheduler writes its address once it listens
        assert info.exists(), "the Dask scheduler did not start"
        address = json.loads(info.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        for _ in range(2):
            procs.append(start(["distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                                "--nworkers", "1", "--no-dashboard"], tmp_path))
        with distributed.Client(address, timeout="30s") as client:
            client.wait_for_workers(2, timeout=90)
        yield address
    finally:
        stop(procs)


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

"""A sweep through a real Ray cluster gives sweep.csv byte for byte as the local process pool does.

Ray binds to the machine's primary interface and probes the network, so the cluster runs inside a private
network namespace (``unshare -rn``: a user and network namespace whose only interface is loopback): ``ray
start --head`` there, then ``kvemu sweep --address auto`` against it. Skipped, with the reason, where Ray is
not installed or such a namespace cannot be made.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness.test_cli import KVEMU, kvemu

pytest.importorskip("ray", reason="ray is not installed: pip install 'kvemu[ray]'")

SWEEP = ("set: {run.duration_s: 5, workload.rate_rps: 1}\n"
         "axes:\n  cluster.workers: [1, 2, 3]\n")
TIMEOUT_S = 240

SCRIPT = """
set -eu
ip link set lo up
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
trap 'exit 143' TERM
ray start --head --port 6379 --node-ip-address 127.0.0.1 --num-cpus 2 --include-dashboard=false \\
  --disable-usage-stats --temp-dir "$RAY_TMP" >"$RAY_TMP/start.log" 2>&1
export RAY_ADDRESS=127.0.0.1:6379
"$@"
"""


def namespace_problem() -> str | None:
    """Why a private network namespace with loopback cannot be made here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (iproute2) is not installed"
    try:
        probe = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -rn failed: {exc}"
    if probe.returncode != 0:
        return f"unshare -rn is not permitted here: {probe.stderr.strip() or probe.returncode}"
    return None


@pytest.mark.sweep_executors
def test_a_sweep_on_ray_equals_the_local_pool_byte_for_byte(tmp_path):
    problem = namespace_problem()
    ray_cli = Path(sys.executable).with_name("ray")
    if problem is None and not ray_cli.exists():
        problem = f"the ray command is not beside {sys.executable}"
    if problem is not None:
        print(f"skipping the Ray sweep test: {problem}")
        pytest.skip(problem)
    (tmp_path / "s.yaml").write_text(SWEEP)
    local = kvemu("sweep", "s.yaml", "--jobs", "2", "-o", "local", "--quiet", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    ray_tmp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "HOME": ray_tmp, "RAY_TMP": ray_tmp, "PATH": f"{ray_cli.parent}:{os.environ['PATH']}"}
    command = ["unshare", "-rn", "sh", "-c", SCRIPT, "sh", *KVEMU, "sweep", "s.yaml", "--address", "auto",
               "-o", "ray", "--quiet"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"the Ray sweep took more than {TIMEOUT_S} s: {err[-2000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, err[-3000:]
    assert "on Ray at auto" in err and "3 ok (3 ran now, 0 reused)" in err
    csv = (tmp_path / "local" / "sweep.csv").read_bytes()
    assert csv.count(b",ok,") == 3
    assert (tmp_path / "ray" / "sweep.csv").read_bytes() == csv

"""The oracle venv's pins and stamp, and the driver's refusal of a malformed workload: no oracle needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.oracle import env


def test_every_requirement_is_an_exact_pin_without_cuda() -> None:
    pins = env.pinned_requirements()  # raises on a line that is not name==version, or a CUDA package
    assert pins["torch"] == env.TORCH_VERSION
    assert pins["vllm"] == env.VLLM_VERSION
    assert not [name for name in pins if env.FORBIDDEN.search(name)]
    # vLLM 0.34.0's own pins for what its scheduler path imports
    assert pins["xgrammar"] == "0.2.8" and pins["apache-tvm-ffi"] == "0.1.11"
    assert pins["transformers"].startswith("5.") and (5, 16, 1) <= tuple(map(int, pins["transformers"].split("."))) \
        < (5, 23, 0)
    assert pins["llguidance"].startswith("1.7.")


def test_stamp_status_says_why(tmp_path: Path) -> None:
    python, reason = env.stamp_status(tmp_path / "absent")
    assert python is None and "no oracle venv" in reason and env.BUILD_COMMAND in reason
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    python, reason = env.stamp_status(venv)
    assert python is None and "no stamp" in reason
    (venv / env.STAMP_NAME).write_text(json.dumps({"requirements_sha256": "0" * 64}))
    python, reason = env.stamp_status(venv)
    assert python is None and "another tests/oracle/requirements.txt" in reason
    (venv / env.STAMP_NAME).write_text(json.dumps({"requirements_sha256": env.requirements_digest()}))
    assert env.stamp_status(venv) == (venv / "bin" / "python", "")


def test_venv_location_follows_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(env.ENV_VAR, str(tmp_path / "o"))
    assert env.venv_dir() == tmp_path / "o"
    monkeypatch.delenv(env.ENV_VAR)
    assert env.venv_dir() == Path.home() / ".cache" / "kvemu" / "oracle-vllm-0.34.0"


@pytest.mark.parametrize(("workload", "message"), [
    ({"config": {"block_size": 16}, "requests": []}, "config['num_gpu_blocks'] is required"),
    ({"config": {}, "requests": [], "typo": 1}, "unknown workload keys"),
])
def test_driver_refuses_a_malformed_workload(workload: dict, message: str) -> None:
    # The workload is checked before vLLM is imported: kvemu's own python runs the driver this far.
    proc = subprocess.run([sys.executable, str(env.DRIVER)], input=json.dumps(workload), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""

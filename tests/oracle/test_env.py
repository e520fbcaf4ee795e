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


def test_the_sglang_pins_are_exact_and_cpu_only() -> None:
    pins = env.pinned_requirements(env.SGLANG)
    assert pins["torch"] == env.TORCH_VERSION and pins["sglang"] == env.SGLANG.version
    assert not [name for name in pins if env.FORBIDDEN.search(name)]
    assert pins["transformers"] == "5.19.0" and pins["apache-tvm-ffi"] == "0.1.11"  # SGLang 0.5.23's own pins


def test_the_sglang_venv_has_its_own_place_and_stamp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(env.SGLANG.env_var, raising=False)
    assert env.venv_dir(env.SGLANG) == Path.home() / ".cache" / "kvemu" / "oracle-sglang-0.5.23"
    monkeypatch.setenv(env.SGLANG.env_var, str(tmp_path / "s"))
    assert env.venv_dir(env.SGLANG) == tmp_path / "s" and env.venv_dir() != tmp_path / "s"
    python, reason = env.stamp_status(tmp_path / "absent", env.SGLANG)
    assert python is None and env.SGLANG.build_command in reason
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / env.STAMP_NAME).write_text(json.dumps({"requirements_sha256": env.requirements_digest()}))
    python, reason = env.stamp_status(venv, env.SGLANG)  # a vLLM stamp does not do for SGLang
    assert python is None and "another tests/oracle/sglang_requirements.txt" in reason
    (venv / env.STAMP_NAME).write_text(json.dumps({"requirements_sha256": env.requirements_digest(env.SGLANG)}))
    assert env.stamp_status(venv, env.SGLANG) == (venv / "bin" / "python", "")


@pytest.mark.parametrize(("workload", "message"), [
    ({"config": {"block_size": 1}, "requests": []}, "config['num_gpu_blocks'] is required"),
    ({"config": {**env.SMOKE_CONFIG, "block_size": 1, "async_scheduling": True}, "requests": []},
     "overlap loop"),
    ({"config": {**env.SMOKE_CONFIG, "block_size": 1, "policy": "priority"}, "requests": []}, "policy"),
])
def test_sglang_driver_refuses_what_it_does_not_cover(workload: dict, message: str) -> None:
    # checked before SGLang is imported: kvemu's own python runs the driver this far
    proc = subprocess.run([sys.executable, str(env.SGLANG.driver)], input=json.dumps(workload),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""

"""The oracle's plumbing for tests: the oracle venvs' pythons, and runners of the engines' schedulers.

Tests marked ``oracle`` run vLLM 0.34.0's real scheduler in the oracle venv (``tests/oracle/env.py``) through
``vllm_driver.py``, or SGLang 0.5.23's in the SGLang oracle venv (``python -m tests.oracle.env --sglang``)
through ``sglang_driver.py``. They get the venv's python from the ``oracle_python`` or ``sglang_oracle_python``
fixture, never by looking for it themselves. ``KVEMU_REQUIRE_ORACLE`` covers both oracles alike. Without it a
missing (or stale) oracle venv skips them with the reason and the command that builds it
(``python -m tests.oracle.env [--sglang]``); with ``KVEMU_REQUIRE_ORACLE=1`` it is a failure, and so
is *any* skip of an ``oracle`` test, so that a run cannot pass with the differential tests silently switched off
(tests/conftest.py's net, which holds ``KVEMU_REQUIRE_REFERENCE`` for the ``reference`` tests too).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from collections.abc import Generator
from typing import Any, NoReturn

import pytest

from tests.conftest import required
from tests.oracle.env import DRIVER, SGLANG, VLLM, Oracle, stamp_status

REQUIRE_ENV = "KVEMU_REQUIRE_ORACLE"
RUN_TIMEOUT = 600.0  # seconds for one driver process (imports ~10 s, then thousands of steps per second)


def oracle_required() -> bool:
    """Whether ``KVEMU_REQUIRE_ORACLE`` asks for the oracle tests to run (1/true/yes/on)."""
    return required(REQUIRE_ENV)


def oracle_unavailable(reason: str) -> NoReturn:
    """Skip the calling test, or fail it when the oracle is required; ``reason`` says what is missing."""
    if oracle_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this a failure)")


@pytest.fixture(scope="session")
def oracle_python() -> Path:
    """The oracle venv's python (skips, or fails under ``KVEMU_REQUIRE_ORACLE=1``, when it is not built)."""
    return _oracle_python(VLLM)


@pytest.fixture(scope="session")
def sglang_oracle_python() -> Path:
    """The SGLang oracle venv's python (skips, or fails under ``KVEMU_REQUIRE_ORACLE=1``, when it is not built)."""
    return _oracle_python(SGLANG)


def _oracle_python(oracle: Oracle) -> Path:
    python, reason = stamp_status(oracle=oracle)
    if python is None:
        if os.environ.get(oracle.env_var):
            reason += f" [{oracle.env_var}={os.environ[oracle.env_var]} is honoured by the builder too]"
        oracle_unavailable(reason)
    return python


def _driver_env(hash_seed: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "VIRTUAL_ENV"):  # the oracle is its own world
        env.pop(name, None)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = str(hash_seed)
    return env


def _run_driver(oracle_python: Path, payload: Any, args: list[str], timeout: float,
                hash_seed: int | None = None, driver: Path = DRIVER) -> list[dict[str, Any]]:
    cmd = [str(oracle_python), str(driver), *args]
    try:
        proc = subprocess.run(cmd, input=json.dumps(payload), capture_output=True, text=True, timeout=timeout,
                              env=_driver_env(hash_seed), check=False)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the oracle driver did not finish in {timeout} s; its stderr ended with:\n{stderr[-4000:]}",
                    pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"the oracle driver exited {proc.returncode}; its stderr ended with:\n{proc.stderr[-4000:]}",
                    pytrace=False)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def run_oracle(oracle_python: Path, workload: dict[str, Any], timeout: float = RUN_TIMEOUT,
               hash_seed: int | None = None) -> list[dict[str, Any]]:
    """Run vLLM 0.34.0's scheduler on ``workload`` (the driver's input format); one record per step.
    ``hash_seed``: the driver's ``PYTHONHASHSEED`` (else random, as for any process)."""
    return _run_driver(oracle_python, workload, [], timeout, hash_seed)


def run_oracle_batch(oracle_python: Path, workloads: list[dict[str, Any]], timeout: float = RUN_TIMEOUT,
                     hash_seed: int | None = None, driver: Path = DRIVER) -> list[list[dict[str, Any]]]:
    """Run several workloads in one driver process (one start-up of vLLM's imports); their records, in order."""
    runs: list[list[dict[str, Any]]] = [[] for _ in workloads]
    for record in _run_driver(oracle_python, workloads, ["--batch"], timeout, hash_seed, driver):
        runs[record.pop("workload")].append(record)
    return runs


def run_sglang_oracle(sglang_oracle_python: Path, workload: dict[str, Any], timeout: float = RUN_TIMEOUT,
                      hash_seed: int | None = None) -> list[dict[str, Any]]:
    """Run SGLang 0.5.23's scheduler on ``workload`` (vllm_driver's input format); one record per step."""
    return _run_driver(sglang_oracle_python, workload, [], timeout, hash_seed, SGLANG.driver)


def run_sglang_oracle_batch(sglang_oracle_python: Path, workloads: list[dict[str, Any]],
                            timeout: float = RUN_TIMEOUT, hash_seed: int | None = None) -> list[list[dict[str, Any]]]:
    """Several workloads through SGLang's scheduler in one driver process (~20 s of imports, then a fresh
    Scheduler per workload); their records, in order."""
    return run_oracle_batch(sglang_oracle_python, workloads, timeout, hash_seed, SGLANG.driver)


class OracleServer:
    """One driver process in ``--serve`` mode: a workload in, its records out (hypothesis draws many)."""

    def __init__(self, oracle_python: Path, driver: Path = DRIVER) -> None:
        self._proc = subprocess.Popen([str(oracle_python), str(driver), "--serve"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_driver_env())

    def run(self, workload: dict[str, Any]) -> list[dict[str, Any]]:
        """The oracle's records for ``workload`` (a refused workload fails the test with vLLM's reason)."""
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(workload, separators=(",", ":")) + "\n")
        proc.stdin.flush()
        records: list[dict[str, Any]] = []
        for line in proc.stdout:
            record = json.loads(line)
            if record.get("end"):
                if "error" in record:
                    pytest.fail(f"the oracle refused the workload: {record['error']}", pytrace=False)
                return records
            records.append(record)
        pytest.fail(f"the oracle driver exited ({proc.wait(timeout=RUN_TIMEOUT)}) in the middle of a workload",
                    pytrace=False)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


@pytest.fixture(scope="session")
def oracle_server(oracle_python: Path) -> Generator[OracleServer, None, None]:
    """vLLM's scheduler behind one long-lived driver process (``--serve``)."""
    server = OracleServer(oracle_python)
    yield server
    server.close()


@pytest.fixture(scope="session")
def sglang_oracle_server(sglang_oracle_python: Path) -> Generator[OracleServer, None, None]:
    """SGLang's scheduler behind one long-lived driver process (``--serve``)."""
    server = OracleServer(sglang_oracle_python, SGLANG.driver)
    yield server
    server.close()

"""Build and check the oracle venvs: vLLM 0.34.0's scheduler (the default) or SGLang 0.5.23's (``--sglang``) on
the CPU build of torch, each in its own venv beside kvemu's.

    python -m tests.oracle.env           # build it (reuses a venv whose stamp matches requirements.txt)
    python -m tests.oracle.env --check   # only verify it (exit 1 saying why when it is missing or broken)
    python -m tests.oracle.env --path    # print its python (exit 1 when it is not built)
    python -m tests.oracle.env --sglang [--check | --path]   # the same for the SGLang oracle

Where: ``$KVEMU_ORACLE_VENV`` if set, else ``~/.cache/kvemu/oracle-vllm-0.34.0``; for SGLang
``$KVEMU_SGLANG_ORACLE_VENV``, else ``~/.cache/kvemu/oracle-sglang-0.5.23``. What: every package of
``tests/oracle/requirements.txt`` (SGLang: ``sglang_requirements.txt``), each pinned with ``==`` and installed
with ``pip install --no-deps`` (so nothing unpinned comes in, and no CUDA package: vLLM's and SGLang's own
dependency lists would pull a multi-GB CUDA stack). The build then checks that torch is 2.13.0 without CUDA
(``torch.version.cuda is None``), that no installed distribution is named like nvidia/triton/cuda/flashinfer/
sgl-kernel/torchvision, that every pinned version is the one installed, that the engine's scheduler modules
import, and that its driver (``vllm_driver.py``, ``sglang_driver.py``) runs a one-request workload to its end.
Only when all of that passed does it write the stamp (the sha256 of the requirements file), which is what the
test fixtures look at.

A fresh vLLM build took 106 s here (87 s of pip install with the wheels in pip's cache, then ~20 s of checks)
and makes a 1.76 GB venv; a fresh SGLang build took 125 s (97 s of pip install) and makes a 1.43 GB venv.

The venv's python must be CPython 3.11 on x86-64 Linux (the wheel of torch 2.13.0+cpu that pip takes from this
machine's disk): the builder creates it from the interpreter running it, which must be 3.11.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH_VERSION = "2.13.0"
FORBIDDEN = re.compile(r"nvidia|triton|cuda|flashinfer|sgl-kernel|sglang-kernel|torchvision", re.IGNORECASE)
CHECK_TIMEOUT = 300  # seconds for one check subprocess (imports take ~10-20 s warm, more on a cold disk)


@dataclass(frozen=True)
class Oracle:
    """One engine's oracle venv: its pins, its driver, where it lives and what its build checks."""

    engine: str  # the distribution and import name: "vllm", "sglang"
    version: str
    requirements: Path
    driver: Path
    env_var: str
    default_venv: Path
    build_command: str
    modules: tuple[str, ...]  # the scheduler path: each must import
    prelude: str = ""  # code the check runs before importing them (SGLang's CPU stubs)

    def describe(self) -> str:
        return f"{self.engine} {self.version}"


SMOKE_REQUEST = {"id": "smoke", "prompt": list(range(1, 21)), "output": [7, 8], "arrive_step": 0, "priority": 0,
                 "abort_step": None}
SMOKE_CONFIG = {"num_gpu_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 64,
                "enable_chunked_prefill": True, "enable_prefix_caching": True, "policy": "fcfs",
                "async_scheduling": False, "max_model_len": 256, "long_prefill_token_threshold": 0}

VLLM = Oracle(
    engine="vllm", version="0.34.0", requirements=HERE / "requirements.txt", driver=HERE / "vllm_driver.py",
    env_var="KVEMU_ORACLE_VENV", default_venv=Path("~/.cache/kvemu/oracle-vllm-0.34.0"),
    build_command="python -m tests.oracle.env",
    modules=("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler",
             "vllm.v1.core.kv_cache_manager", "vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_utils",
             "vllm.v1.request", "vllm.v1.outputs", "vllm.distributed.kv_events", "vllm.v1.structured_output",
             "vllm.config"),
)
SGLANG = Oracle(
    engine="sglang", version="0.5.23", requirements=HERE / "sglang_requirements.txt",
    driver=HERE / "sglang_driver.py", env_var="KVEMU_SGLANG_ORACLE_VENV",
    default_venv=Path("~/.cache/kvemu/oracle-sglang-0.5.23"), build_command="python -m tests.oracle.env --sglang",
    modules=("sglang.srt.managers.scheduler", "sglang.srt.managers.schedule_policy",
             "sglang.srt.managers.schedule_batch", "sglang.srt.mem_cache.unified_radix_cache",
             "sglang.srt.mem_cache.allocator", "sglang.srt.disaggregation.kv_events", "sglang.srt.server_args"),
    prelude=(f"sys.path.insert(0, {str(HERE)!r})\nimport sglang_stubs\nsglang_stubs.install_import_stubs()\n"),
)

# The vLLM oracle's names, as the rest of tests/oracle imports them.
DRIVER, ENV_VAR, BUILD_COMMAND, VLLM_VERSION = VLLM.driver, VLLM.env_var, VLLM.build_command, VLLM.version
STAMP_NAME = "kvemu-oracle.stamp"


class OracleEnvError(RuntimeError):
    """The oracle venv is missing, stale or fails a check; the message says which and why."""


def venv_dir(oracle: Oracle = VLLM) -> Path:
    """Where an oracle venv lives: its variable (``$KVEMU_ORACLE_VENV``, ``$KVEMU_SGLANG_ORACLE_VENV``), else
    its default under ``~/.cache/kvemu``."""
    return Path(os.environ.get(oracle.env_var) or oracle.default_venv).expanduser()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def requirements_digest(oracle: Oracle = VLLM) -> str:
    return hashlib.sha256(oracle.requirements.read_bytes()).hexdigest()


def pinned_requirements(oracle: Oracle = VLLM) -> dict[str, str]:
    """``{normalized name: version}`` of the oracle's requirements file; every line must pin with ``==``."""
    pins: dict[str, str] = {}
    path = oracle.requirements
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if match is None:
            raise OracleEnvError(f"{path}:{number}: not an exact pin (name==version): {line!r}")
        name = _normalize(match.group(1))
        if FORBIDDEN.search(name):
            raise OracleEnvError(f"{path}:{number}: {name} is a CUDA package; the oracle runs on the CPU")
        pins[name] = match.group(2)
    return pins


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stamp_status(venv: Path | None = None, oracle: Oracle = VLLM) -> tuple[Path | None, str]:
    """``(python, "")`` when the venv is built and its stamp matches the requirements file, else
    ``(None, reason)``.

    Cheap (no subprocess): the stamp is written only after every check of a build passed.
    """
    venv = venv_dir(oracle) if venv is None else venv
    python = venv_python(venv)
    stamp = venv / STAMP_NAME
    command = oracle.build_command
    if not python.exists():
        return None, f"no oracle venv at {venv} ({oracle.describe()}; build it with: {command})"
    if not stamp.is_file():
        return None, (f"the oracle venv at {venv} has no stamp: a build did not finish or failed a check "
                      f"(rebuild it with: {command})")
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8")).get("requirements_sha256")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded != requirements_digest(oracle):
        return None, (f"the oracle venv at {venv} was built from another tests/oracle/{oracle.requirements.name} "
                      f"(rebuild it with: {command})")
    return python, ""


# ------------------------------------------------------------------ the checks

_CHECK_SCRIPT = r"""
import importlib, importlib.metadata as md, json, re, sys
names = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:
        names[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
out = {"python": list(sys.version_info[:2]), "dists": names}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    exec(PRELUDE)
    for module in MODULES:
        importlib.import_module(module)
    out["engine"] = importlib.import_module(ENGINE).__version__
except Exception as exc:  # reported, not raised: the builder says why
    out["import_error"] = f"{type(exc).__name__}: {exc}"
print("KVEMU-ORACLE-CHECK " + json.dumps(out))
"""


def smoke_workload(oracle: Oracle = VLLM) -> dict:
    """One request of 20 prompt tokens and 2 generated; SGLang's pages are single tokens (128 of them)."""
    block_size, blocks = (16, 8) if oracle is VLLM else (1, 128)
    return {"config": {**SMOKE_CONFIG, "block_size": block_size, "num_gpu_blocks": blocks},
            "requests": [SMOKE_REQUEST], "max_steps": 20}


SMOKE_WORKLOAD = smoke_workload(VLLM)


def _run(cmd: list[str], timeout: float = CHECK_TIMEOUT, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise OracleEnvError(f"{' '.join(cmd)} did not finish in {timeout} s") from exc


def check(venv: Path, oracle: Oracle = VLLM) -> list[str]:
    """Every check of a built venv (no stamp involved); returns what passed, raises OracleEnvError otherwise."""
    python = venv_python(venv)
    if not python.exists():
        raise OracleEnvError(f"no python at {python}")
    script = (f"MODULES = {oracle.modules!r}\nENGINE = {oracle.engine!r}\nPRELUDE = {oracle.prelude!r}\n"
              + _CHECK_SCRIPT)
    proc = _run([str(python), "-c", script])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("KVEMU-ORACLE-CHECK ")), None)
    if proc.returncode != 0 or line is None:
        raise OracleEnvError(f"the check script failed in {venv} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    found = json.loads(line.removeprefix("KVEMU-ORACLE-CHECK "))
    passed: list[str] = []
    if found["python"] != [3, 11]:
        raise OracleEnvError(f"the venv's python is {found['python']}, not 3.11 (the torch wheel is cp311)")
    forbidden = sorted(name for name in found["dists"] if FORBIDDEN.search(name))
    if forbidden:
        raise OracleEnvError(f"CUDA packages are installed in {venv}: {', '.join(forbidden)}")
    passed.append(f"no distribution named like nvidia/triton/cuda among {len(found['dists'])}")
    wrong = []
    for name, version in pinned_requirements(oracle).items():
        have = found["dists"].get(name)
        if have is None or have.split("+", 1)[0] != version:
            wrong.append(f"{name}: pinned {version}, installed {have}")
    if wrong:
        more = f"; and {len(wrong) - 12} more" if len(wrong) > 12 else ""
        raise OracleEnvError(f"installed versions differ from {oracle.requirements.name}: " + "; ".join(wrong[:12])
                             + more)
    passed.append("every pinned version is installed")
    if "import_error" in found:
        raise OracleEnvError(f"{oracle.engine}'s scheduler path does not import: {found['import_error']}")
    if found["torch"].split("+", 1)[0] != TORCH_VERSION or found["torch_cuda"] is not None:
        raise OracleEnvError(f"torch is {found['torch']} (CUDA {found['torch_cuda']}); the oracle needs "
                             f"{TORCH_VERSION} without CUDA (the CPU build)")
    passed.append(f"torch {found['torch']} without CUDA")
    if found["engine"] != oracle.version:
        raise OracleEnvError(f"{oracle.engine} is {found['engine']}, not {oracle.version}")
    passed.append(f"{oracle.engine} {found['engine']}: {len(oracle.modules)} scheduler modules import")
    proc = _run([str(python), str(oracle.driver)], stdin=json.dumps(smoke_workload(oracle)))
    try:
        records = [json.loads(line) for line in proc.stdout.splitlines()]
    except ValueError:
        records = []
    finished = [f for record in records for f in record["finished"]]
    if proc.returncode != 0 or finished != [["smoke", "length"]]:
        raise OracleEnvError(f"the driver's smoke run failed (exit {proc.returncode}, finished {finished}):\n"
                             f"{proc.stderr[-3000:]}")
    passed.append(f"the driver ran a one-request workload in {len(records)} steps")
    return passed


# ------------------------------------------------------------------ the build


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total


def build(venv: Path, log=print, oracle: Oracle = VLLM) -> Path:
    """Build the venv at ``venv`` unless its stamp already matches; returns its python."""
    python, _reason = stamp_status(venv, oracle)
    if python is not None:
        log(f"the oracle venv at {venv} is up to date (stamp matches {oracle.requirements.name})")
        return python
    if sys.version_info[:2] != (3, 11):
        raise OracleEnvError(f"run the builder with CPython 3.11 (this is {sys.version.split()[0]}): the venv "
                             "is made from the running interpreter and torch 2.13.0+cpu is a cp311 wheel")
    pins = pinned_requirements(oracle)  # fails early on a malformed file
    started = time.monotonic()
    if venv.exists():
        log(f"removing the stale oracle venv at {venv}")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating {venv} with {sys.executable}")
    # From a venv's python, `-m venv` uses the base interpreter: the oracle venv does not see kvemu's packages.
    proc = _run([sys.executable, "-m", "venv", str(venv)], timeout=600)
    if proc.returncode != 0:
        raise OracleEnvError(f"python -m venv failed:\n{proc.stderr}")
    python = venv_python(venv)
    log(f"installing {len(pins)} pinned packages with --no-deps (torch, {oracle.engine} and the scheduler path's)")
    cmd = [str(python), "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--only-binary=:all:", "-r", str(oracle.requirements)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise OracleEnvError(f"pip install failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-3000:]}")
    installed = time.monotonic()
    for line in check(venv, oracle):
        log(f"  ok: {line}")
    stamp = {"requirements_sha256": requirements_digest(oracle),
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "install_seconds": round(installed - started, 1)}
    (venv / STAMP_NAME).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    log(f"built {venv} in {time.monotonic() - started:.0f} s ({installed - started:.0f} s to install), "
        f"{_size(venv) / 1e9:.2f} GB")
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.oracle.env", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="only verify the venv (stamp and every check)")
    group.add_argument("--path", action="store_true", help="print the venv's python (exit 1 when not built)")
    parser.add_argument("--sglang", action="store_true", help="the SGLang 0.5.23 oracle (default: vLLM 0.34.0)")
    args = parser.parse_args(argv)
    oracle = SGLANG if args.sglang else VLLM
    venv = venv_dir(oracle)
    try:
        if args.path:
            python, reason = stamp_status(venv, oracle)
            if python is None:
                print(reason, file=sys.stderr)
                return 1
            print(python)
            return 0
        if args.check:
            python, reason = stamp_status(venv, oracle)
            if python is None:
                raise OracleEnvError(reason)
            for line in check(venv, oracle):
                print(f"ok: {line}")
            print(f"the oracle venv at {venv} is ready: {python}")
            return 0
        build(venv, oracle=oracle)
        return 0
    except OracleEnvError as exc:
        print(f"oracle venv: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

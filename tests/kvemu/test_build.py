"""The compiled build and its pure-Python fallback (``kvemu._build``, ``setup.py``).

Both builds must give byte-identical reports except ``kvemu.build`` and wall time; ``KVEMU_PURE_PYTHON=1``
must really import the ``.py`` sources; a source edited after the build must not run its stale extension.
Tests that need the compiled build skip without it, and fail instead under ``KVEMU_REQUIRE_COMPILED=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvemu
from kvemu import _build
from harness.report.summary import WALL_CLOCK_KEYS

ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "KVEMU_REQUIRE_COMPILED"

_PROBE = """
import json, sys
import kvemu, workers, harness.cli
from kvemu import _build
for name in _build.COMPILED_MODULES:
    __import__(name)
print(json.dumps({"compiled": kvemu.compiled, "build": _build.build_name(), "stale": list(_build.STALE),
                  "files": {n: sys.modules[n].__file__ for n in _build.COMPILED_MODULES}}))
"""


def _env(pure: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVEMU_PURE_PYTHON"}
    if pure:
        env["KVEMU_PURE_PYTHON"] = "1"
    return env


def _probe(pure: bool, cwd: Path = ROOT, extra_path: Path | None = None) -> tuple[dict, str]:
    env = _env(pure)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def _require_compiled() -> None:
    """Skip (or fail under KVEMU_REQUIRE_COMPILED=1) when the compiled build is not what this install runs."""
    if os.environ.get("KVEMU_PURE_PYTHON", "") not in ("", "0"):
        reason = "KVEMU_PURE_PYTHON is set in this run"
    elif not _build.COMPILED_MODULES:
        reason = "no compiled build is installed (pure-Python install: no mypyc or no C compiler at install time)"
    elif _build.STALE:
        reason = f"the compiled build is stale ({', '.join(_build.STALE)}): rebuild with pip install -e ."
    else:
        return
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


def test_pure_python_switch_imports_every_compiled_module_from_its_source():
    info, _ = _probe(pure=True)
    assert info["compiled"] is False and info["build"] == "pure"
    assert all(path.endswith(".py") for path in info["files"].values()), info["files"]


def test_kvemu_compiled_says_which_build_is_imported():
    info, _ = _probe(pure=False)
    compiled = [not path.endswith(".py") for path in info["files"].values()]
    assert info["compiled"] == (bool(compiled) and all(compiled))
    assert info["build"] == ("compiled" if info["compiled"] else "pure")
    assert kvemu.compiled == (_build.build_name() == "compiled")


def test_the_compiled_build_is_the_one_imported():
    _require_compiled()
    info, stderr = _probe(pure=False)
    assert info["compiled"] is True and info["stale"] == [], stderr
    assert not any(path.endswith(".py") for path in info["files"].values()), info["files"]


def test_a_source_edited_after_the_build_runs_pure_python_with_one_warning(tmp_path):
    """A copy of the installed packages with one compiled module's source edited: every compiled module
    falls back to its source (a stale extension would run the old code), and the process warns once."""
    _require_compiled()
    site = Path(_build.__file__).resolve().parent.parent
    for package in ("kvemu", "workers", "harness"):
        shutil.copytree(site / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    for lib in site.glob("*__mypyc*"):
        shutil.copy2(lib, tmp_path / lib.name)
    info, stderr = _probe(pure=False, cwd=tmp_path, extra_path=tmp_path)
    assert info["compiled"] is True, stderr  # the copy itself still runs compiled
    edited = tmp_path / "kvemu" / "index.py"
    edited.write_text(edited.read_text() + "\n# edited after the build\n")
    info, stderr = _probe(pure=False, cwd=tmp_path, extra_path=tmp_path)
    assert info["stale"] == ["kvemu.index"] and info["compiled"] is False and info["build"] == "pure"
    assert all(path.endswith(".py") and path.startswith(str(tmp_path)) for path in info["files"].values())
    assert stderr.count("older than their sources") == 1, stderr


def test_the_finder_prefers_the_source_over_an_extension_beside_it(tmp_path):
    (tmp_path / "shadowed.py").write_text("WHERE = 'source'\n")
    (tmp_path / f"shadowed{_ext_suffix()}").write_bytes(b"not a real extension")
    finder = _build.PurePythonFinder(["shadowed"])
    spec = finder.find_spec("shadowed", [str(tmp_path)])
    assert spec is not None and spec.origin == str(tmp_path / "shadowed.py")
    assert finder.find_spec("other", [str(tmp_path)]) is None


def _ext_suffix() -> str:
    from importlib.machinery import EXTENSION_SUFFIXES

    return EXTENSION_SUFFIXES[0]


def _report(out: Path, pure: bool, *args: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "harness.cli", "run", *args, "--quiet", "-o", str(out)], cwd=ROOT,
                         env=_env(pure), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return json.loads((out / "summary.json").read_text())


def _without_build_and_wall(summary: dict) -> tuple[str, str]:
    """The build's name, and summary.json as written minus that key and the wall-clock keys (as text, so that
    an int turned float, 3 vs 3.0, is a difference)."""
    build = summary["kvemu"].pop("build")
    for key in WALL_CLOCK_KEYS:
        summary.pop(key)
    return build, json.dumps(summary, indent=2)


@pytest.mark.parametrize("args", [(), ("examples/compose-chaos.yaml", "--set", "run.mode=virtual")],
                         ids=["quickstart", "chaos-virtual"])
def test_both_builds_give_byte_identical_reports(tmp_path, args):
    _require_compiled()
    compiled_build, compiled = _without_build_and_wall(_report(tmp_path / "compiled", False, *args))
    pure_build, pure = _without_build_and_wall(_report(tmp_path / "pure", True, *args))
    assert (compiled_build, pure_build) == ("compiled", "pure")
    assert compiled == pure
    assert (tmp_path / "compiled" / "requests.jsonl").read_bytes() == (tmp_path / "pure" / "requests.jsonl").read_bytes()


def test_a_machine_without_a_c_compiler_installs_pure_python_and_says_so_in_one_line(tmp_path):
    """No compiler: no mypyc module and no native one is built, nothing is recorded (every process then runs the
    pure-Python reference), and the build says why in one line instead of failing."""
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "kvemu" / "_native", tmp_path / "kvemu" / "_native")
    (tmp_path / "kvemu" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "KVEMU_NO_COMPILE"}
    env["CC"] = str(tmp_path / "no-such-cc")
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("kvemu:")]
    assert said == [f"kvemu: installing pure Python, not the compiled build (no C compiler ({env['CC']} not "
                    "found))"], out.stderr
    built = [p.name for p in tmp_path.rglob("*") if p.suffix in (".so", ".pyd") or p.name == "_mypyc_manifest.json"]
    assert built == []


def test_an_edited_shared_header_makes_every_native_module_stale(tmp_path, monkeypatch):
    """A header every native module includes (``kvemu/_native/*.h``) is part of each one's recorded digest (setup.py
    records it by the same rule: a fresh build's modules are selected, ``tests.native.assert_built_and_selected``): an
    extension built from the old header never runs over a new one."""
    native = tmp_path / "_native"
    shutil.copytree(ROOT / "kvemu" / "_native", native)
    monkeypatch.setattr(_build, "native_source", lambda name: native / (name.rpartition(".")[2].lstrip("_") + ".c"))
    names = ["kvemu._blockhash", "kvemu._blockmap", "kvemu._blockpool", "kvemu._loadtable"]
    recorded = {name: _build.native_digest(name) for name in names}
    assert _build._stale(recorded, _build.native_digest) == []
    header = native / "u64.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert _build._stale(recorded, _build.native_digest) == names

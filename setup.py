"""Build hook: compile kvemu's hot modules with mypyc when it and a C compiler are available.

The same ``.py`` files are installed either way and are the pure-Python fallback: if mypyc is missing, the
compiler is missing or compilation fails, the install goes on pure Python and says so once. A successful build
records each compiled module's source hash in ``kvemu/_mypyc_manifest.json``; ``kvemu._build`` reads it at
import (stale extension -> pure Python, ``KVEMU_PURE_PYTHON=1`` -> pure Python). ``KVEMU_NO_COMPILE=1`` skips
compilation. Everything else about the package lives in ``pyproject.toml``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MANIFEST = "kvemu/_mypyc_manifest.json"

# The modules compiled (measured: docs/architecture.md, "The compiled build"); the manifest written below is what
# kvemu._build reads. Not compiled on purpose: kvemu/queue.py (its exceptions must pickle with a __dict__ and its
# spec checks see run-time types) and workers/hash_id_prompt.py (it checks untrusted hash ids by their run-time types).
COMPILED = [
    "kvemu/router_events.py",
    "kvemu/hashing.py",
    "kvemu/index.py",
    "kvemu/load.py",
    "kvemu/selector.py",
    "kvemu/eligibility.py",
    "kvemu/routing_core.py",
    "kvemu/lifecycle.py",
    "kvemu/packed_tokens.py",
    "kvemu/token_sequence.py",
    "kvemu/wire/stream.py",
    "workers/blocks.py",
    "workers/engine_base.py",
    "workers/pass_events.py",
    "workers/vllm/scheduler.py",
    "workers/sequence.py",
    "workers/speculative.py",
    "workers/timing.py",
    "workers/vllm/engine.py",
    "workers/vllm/fast_forward.py",
]

NATIVE = {
    "kvemu._blockhash": "kvemu/_native/blockhash.c",
    "kvemu._loadtable": "kvemu/_native/loadtable.c",
    "kvemu._blockpool": "kvemu/_native/blockpool.c",
    "kvemu._blockmap": "kvemu/_native/blockmap.c",
}
"""Native module -> its C source (kvemu._build.native_source knows the same layout)."""
HEADERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvemu" / "_native").glob("*.h"))
"""What every native module may include (``kvemu/_native/*.h``): a dependency of each."""


def _native_digest(source: str) -> str:
    """sha256 of a C source followed by every header (by name): ``kvemu._build.native_digest``'s rule."""
    digest = hashlib.sha256((ROOT / source).read_bytes())
    for header in HEADERS:
        digest.update((ROOT / header).read_bytes())
    return digest.hexdigest()


def _warn(reason: str) -> None:
    """The one line a pure-Python install prints."""
    print(f"kvemu: installing pure Python, not the compiled build ({reason})", file=sys.stderr, flush=True)


def _module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


def _source_hashes(paths: list[str]) -> dict[str, str]:
    return {_module_name(p): hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in paths}


def _stale_outputs() -> list[Path]:
    """Extensions and manifest a previous in-place (editable) build left in the source tree: every extension in
    the compiled packages, so that one of a module since renamed or no longer compiled cannot still be imported."""
    found = [ROOT / MANIFEST]
    for package in sorted({Path(p).parts[0] for p in COMPILED}):
        found += (ROOT / package).rglob("*.cpython-*.so")
        found += (ROOT / package).rglob("*.pyd")
    found += ROOT.glob("*__mypyc.cpython-*.so")
    return [f for f in found if f.exists()]


def _parallel_compile(compiler, jobs: int) -> None:
    """Compile one extension's C files ``jobs`` at a time (distutils compiles them one by one; mypyc's
    multi-file output is one file per module, so the compile scales with the cores)."""
    from concurrent.futures import ThreadPoolExecutor

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        todo = [(obj, *build[obj]) for obj in objects if obj in build]
        with ThreadPoolExecutor(jobs) as pool:
            for _ in pool.map(lambda t: compiler._compile(t[0], t[1], t[2], cc_args, extra_postargs, pp_opts), todo):
                pass
        return objects

    compiler.compile = compile


class BuildExt(build_ext):
    """build_ext that falls back to pure Python on any failure and writes the source-hash manifest."""

    def build_extension(self, ext) -> None:
        if ext.name not in NATIVE:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - a native module that does not compile: its Python reference runs
            print(f"kvemu: {ext.name} not built, its pure-Python reference runs ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr, flush=True)
            self._native_failed.add(ext.name)

    def run(self) -> None:
        self._native_failed: set[str] = set()
        in_tree = self.inplace or getattr(self, "editable_mode", False)
        if in_tree:
            for stale in _stale_outputs():  # a failed rebuild must not leave old code shadowing the sources
                stale.unlink()
        if not self.extensions:
            return
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means the pure-Python install
            _warn(f"compilation failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            for out in self.get_outputs():
                Path(out).unlink(missing_ok=True)
            for stale in _stale_outputs() if in_tree else []:
                stale.unlink()
            self.extensions = []
            return
        built = {str(Path(*ext.name.split(".")).with_suffix(".py")) for ext in self.extensions}
        compiled = sorted(built & set(COMPILED))
        native = {e.name: _native_digest(NATIVE[e.name]) for e in self.extensions if e.name in NATIVE}
        manifest = json.dumps({"modules": _source_hashes(compiled), "native": native}, indent=1, sort_keys=True) + "\n"
        for base in {Path(self.build_lib), *([ROOT] if in_tree else [])}:
            (base / MANIFEST).parent.mkdir(parents=True, exist_ok=True)
            (base / MANIFEST).write_text(manifest)

    def build_extensions(self) -> None:
        jobs = int(os.environ.get("KVEMU_BUILD_JOBS", "0")) or os.cpu_count() or 1
        if jobs > 1:
            _parallel_compile(self.compiler, jobs)
        super().build_extensions()
        for ext in [e for e in self.extensions if e.name in self._native_failed]:
            # gone before the in-place copy and the outputs list: an older build's file must not be installed
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            self.extensions.remove(ext)

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()
        return [*outputs, str(Path(self.build_lib) / MANIFEST)] if self.extensions else outputs


_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop", "bdist"}


def _ext_modules() -> list:
    """mypyc's extensions, or none (pure Python, said once; an editable install then also deletes the extensions
    a previous compiled install left in the tree, which would otherwise still be imported).

    Only for a command that builds: pip also runs this file for metadata, which needs no type-check.
    """
    if not _BUILDS.intersection(sys.argv[1:]):
        return []
    exts = _compiled_ext_modules()
    if not exts and {"editable_wheel", "develop"}.intersection(sys.argv[1:]):
        for stale in _stale_outputs():
            stale.unlink()
    return exts


def _compiled_ext_modules() -> list:
    if os.environ.get("KVEMU_NO_COMPILE") == "1":
        _warn("KVEMU_NO_COMPILE=1")
        return []
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    cc = getattr(compiler, "compiler_so", None) or ["cc"]
    from shutil import which

    if which(cc[0]) is None:
        _warn(f"no C compiler ({cc[0]} not found)")
        return []
    return _mypyc_ext_modules() + [Extension(name, [source], depends=HEADERS) for name, source in NATIVE.items()]


def _mypyc_ext_modules() -> list:
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypy reads pyproject.toml's [tool.mypy] and resolves the paths from here
    try:
        only = os.environ.get("KVEMU_MYPYC_ONLY")  # for measuring a group: e.g. "workers/" or "kvemu/index.py"
        paths = [p for p in COMPILED if any(p.startswith(o) for o in only.split(","))] if only else COMPILED
        return mypycify(paths, opt_level=os.environ.get("KVEMU_MYPYC_OPT", "3"), multi_file=True)
    except BaseException as exc:  # mypycify exits on type errors
        _warn(f"mypyc failed: {type(exc).__name__}: {exc}")
        return []
    finally:
        os.chdir(cwd)


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": BuildExt})

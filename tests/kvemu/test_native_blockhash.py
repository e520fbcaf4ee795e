"""The native rolling sequence hash (``kvemu._blockhash``) against its pure-Python reference.

Bit-exact on every chain, the same exception type (and message) on every hostile input, and chosen by
``kvemu.hashing`` only when ``KVEMU_PURE_PYTHON`` is unset. Skipped when the extension is not built (a
``KVEMU_NO_COMPILE=1`` install); a failure instead under ``KVEMU_REQUIRE_COMPILED=1``. ``.ci/sanitize`` runs this
file's tests not marked ``installed_build`` against a sanitizer build (``tests.native``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from array import array
from pathlib import Path
from types import ModuleType

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.hashing import BASE_SEED, U64_MASK, extend_sequence_hashes_py
from tests.native import EXAMPLES, assert_built_and_selected, assert_stale_when_edited, load_native, selected

ROOT = Path(__file__).resolve().parents[2]
NAME = "kvemu._blockhash"

# tests/kvemu/test_hashing.py's spec vectors: the local hashes of range(64) in blocks of 16, and their chain
PLAIN = [15310707395893867146, 15292316782987903195, 5532946206955930018, 14928757266181269122]
SEQ_PLAIN = [15310707395893867146, 13769157705258532664, 11879827756109914528, 3888788807566526800]


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return load_native(NAME)


def _outcome(fn, parent, local) -> tuple[str, object]:
    """("ok", result) or (exception type name, None): what both implementations must agree on (the messages
    differ where the mypyc-compiled reference checks an argument's type itself)."""
    try:
        return "ok", fn(parent, local)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc).__name__, None


u64s = st.one_of(st.sampled_from([0, 1, U64_MASK, U64_MASK - 1, 1 << 63]), st.integers(0, U64_MASK))
parents = st.one_of(st.none(), st.just(0), st.just(U64_MASK), u64s)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parent=parents, local=st.lists(u64s, max_size=80))
def test_native_chain_equals_the_reference(native, parent, local):
    assert native.extend_sequence_hashes(parent, local) == extend_sequence_hashes_py(parent, local)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parent=parents, local=st.lists(u64s, max_size=8))
def test_native_link_is_xxh3_of_the_two_le64_words(native, parent, local):
    """Checked against the xxhash package itself, not only against kvemu's reference."""
    out = native.extend_sequence_hashes(parent, local)
    prev = parent
    for h, got in zip(local, out, strict=True):
        prev = h if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, h), BASE_SEED)
        assert got == prev


def test_native_gives_the_spec_chain(native):
    assert native.extend_sequence_hashes(None, PLAIN) == SEQ_PLAIN
    assert native.extend_sequence_hashes(SEQ_PLAIN[1], PLAIN[2:]) == SEQ_PLAIN[2:]
    assert native.extend_sequence_hashes(12345, []) == []
    assert native.extend_sequence_hashes(None, []) == []


HOSTILE = [
    (-1, [1]), (U64_MASK + 1, [1]), (U64_MASK + 1, []), (-1, []), (1.0, [1]), ("1", []), (b"\x01", [1]),
    (None, [-1]), (None, [U64_MASK + 1]), (None, [1, -1]), (None, [1, U64_MASK + 1]), (None, [-(1 << 1000)]),
    (None, [10 ** 5000]), (7, [1 << 64]), (None, [1.5]), (None, [1, 2.0]), (None, [1, None]), (None, [None]),
    (None, ["2"]), (None, [-1, 1.5]), (None, [1.5, -1]), (None, [1, 2, 3, object()]), (None, None), (None, 5),
    (None, [True, False]), (False, [1]), (None, (1, 2, 3)), (None, range(4)), (5, array("Q", [1, U64_MASK])),
]


@pytest.mark.parametrize(("parent", "local"), HOSTILE, ids=[f"case{i}" for i in range(len(HOSTILE))])
def test_hostile_input_meets_the_same_outcome(native, parent, local):
    """A non-int or a value outside [0, 2**64) raises the reference's exception type; never a crash."""
    assert _outcome(native.extend_sequence_hashes, parent, local) == _outcome(extend_sequence_hashes_py, parent,
                                                                              local)


DIGIT_EDGES = [0, 1, True, False, (1 << 30) - 1, 1 << 30, (1 << 60) - 1, 1 << 60, 1 << 63, (1 << 64) - 1,
               1 << 64, (1 << 64) + 1, (1 << 89) - 1, 1 << 89, (1 << 90) - 1, 1 << 90, -1, -(1 << 30), -(1 << 64)]
"""Ints either side of every 30-bit digit boundary ``kvemu/_native/u64.h`` reads an int's digits at, and of 2**64."""


@pytest.mark.parametrize("value", DIGIT_EDGES, ids=[str(v) for v in DIGIT_EDGES])
def test_the_shared_u64_reader_agrees_with_the_reference_at_every_digit_boundary(native, value):
    assert _outcome(native.extend_sequence_hashes, value, [value]) == _outcome(extend_sequence_hashes_py, value,
                                                                               [value])


def test_hostile_types_are_type_and_overflow_errors(native):
    with pytest.raises(TypeError, match=r"local_hashes\[1\] must be an int"):
        native.extend_sequence_hashes(None, [1, None])
    with pytest.raises(OverflowError, match=r"parent must be in \[0, 2\*\*64\)"):
        native.extend_sequence_hashes(-1, [])


def test_wrong_arity_is_a_type_error(native):
    with pytest.raises(TypeError):
        native.extend_sequence_hashes(None)
    with pytest.raises(TypeError):
        native.extend_sequence_hashes(None, [], [])


junk = st.one_of(u64s, st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True), st.none(), st.text(max_size=3),
                 st.booleans(), st.binary(max_size=8))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parent=st.one_of(parents, junk), local=st.lists(junk, max_size=12))
def test_random_junk_meets_the_same_outcome(native, parent, local):
    assert _outcome(native.extend_sequence_hashes, parent, local) == _outcome(extend_sequence_hashes_py, parent,
                                                                              local)


def test_a_long_chain_and_a_bad_value_at_its_end(native):
    """200,000 links (bounded: well under a second native): equal, and one bad last value fails both alike."""
    local = [(i * 0x9E3779B97F4A7C15) & U64_MASK for i in range(200_000)]
    assert native.extend_sequence_hashes(3, local) == extend_sequence_hashes_py(3, local)
    local.append(-5)
    assert _outcome(native.extend_sequence_hashes, 3, local)[0] == "OverflowError"
    assert _outcome(extend_sequence_hashes_py, 3, local)[0] == "OverflowError"


_PROBE = """
import kvemu.hashing as h
SELECTED = {"native": h.extend_sequence_hashes is not h.extend_sequence_hashes_py}
"""


@pytest.mark.installed_build
def test_pure_python_switch_selects_the_reference(native):
    assert selected(NAME, _PROBE, pure=True) == {"native": False, "loaded": False}


@pytest.mark.installed_build
def test_the_built_extension_is_selected_without_the_switch(native):
    assert_built_and_selected(NAME, _PROBE)


@pytest.mark.installed_build
def test_a_c_source_edited_after_the_build_is_stale():
    assert_stale_when_edited(NAME)


_SETUP_WITHOUT_MYPYC = """
import runpy, sys
sys.modules["mypyc.build"] = None  # as if mypyc were not installed
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")
"""


def _build_copy(where: Path) -> tuple[str, set[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "KVEMU_NO_COMPILE"}  # (CI's pure-Python step sets it)
    out = subprocess.run([sys.executable, "-c", _SETUP_WITHOUT_MYPYC], cwd=where, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    files = {p.name for p in (where / "kvemu").iterdir()}
    return out.stderr, files, json.loads((where / "kvemu" / "_mypyc_manifest.json").read_text())


@pytest.mark.installed_build
def test_setup_builds_it_without_mypyc_and_leaves_it_out_when_it_fails_to_compile(tmp_path):
    """Built with no mypyc; then, its source broken, the rebuild says so in one line, installs no older copy of
    it and records none, and the install goes on."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "kvemu" / "_native", tmp_path / "kvemu" / "_native")  # the sources and their headers
    (tmp_path / "kvemu" / "__init__.py").write_text("")
    source = tmp_path / "kvemu" / "_native" / "blockhash.c"
    others = {"kvemu._" + c.stem for c in (ROOT / "kvemu" / "_native").glob("*.c")} - {NAME}
    _, files, manifest = _build_copy(tmp_path)
    assert any(f.startswith("_blockhash.") for f in files) and NAME in manifest["native"]
    source.write_text(source.read_text() + "\nint broken(\n")
    later = source.stat().st_mtime + 10  # newer than the first build's output, which distutils would reuse
    os.utime(source, (later, later))
    for fresh in (False, True):  # beside the first build's output, then with no build directory at all
        if fresh:
            shutil.rmtree(tmp_path / "build")
        stderr, files, manifest = _build_copy(tmp_path)
        assert not any(f.startswith("_blockhash.") for f in files), files
        assert set(manifest["native"]) == others  # the other native modules still built
        assert stderr.count(f"kvemu: {NAME} not built, its pure-Python reference runs") == 1, stderr
        assert "compilation failed" not in stderr, stderr  # the rest of the install went on

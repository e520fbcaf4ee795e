"""The examples as a new user meets them: a clone with nothing beside it (no ``../shared/traces``).

The five examples that replay the one-hour Mooncake trace cannot find it there; their error must say where the
real trace comes from and the commands that generate a stand-in and run on it, and those commands must work as
written. Every other example validates as it is.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

MOONCAKE_CONVERSATION_URL = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
                             "conversation_trace.jsonl")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
ON_THE_MOONCAKE_TRACE = {"mooncake-3600s.yaml", "mooncake-3600s-speculative.yaml",
                         "mooncake-3600s-hybrid-speculative.yaml", "disagg-4p12d.yaml", "sglang-16.yaml"}
_script = Path(sys.executable).with_name("kvemu")
KVEMU = [str(_script)] if _script.exists() else [sys.executable, "-m", "harness.cli"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/ whose ``../../shared`` (where the examples look for the trace) does not exist."""
    root = tmp_path_factory.mktemp("fresh") / "kvemu"
    shutil.copytree(ROOT / "examples", root / "examples")
    assert not (root.parent / "shared").exists()
    return root


def _kvemu(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_examples_on_the_mooncake_trace_are_the_ones_named():
    on_trace = {p.name for p in EXAMPLES if "mooncake_conversation_trace.jsonl" in p.read_text()}
    assert on_trace == ON_THE_MOONCAKE_TRACE


@pytest.mark.parametrize("name", sorted(ON_THE_MOONCAKE_TRACE))
def test_a_missing_mooncake_trace_says_where_it_comes_from_and_the_commands_of_a_stand_in(
        clone, capsys, monkeypatch, tmp_path, name):
    """The error names the trace's public source, a download command to the path the example reads, and the
    synth command; following it as written (from the working directory) makes the example valid."""
    monkeypatch.chdir(tmp_path)
    example = clone / "examples" / name
    code, _, err = _kvemu(capsys, "validate", str(example))
    assert code == 2
    expected = clone.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    assert f"file not found: {expected}" in err
    assert MOONCAKE_CONVERSATION_URL in err and f"curl -L --create-dirs -o {expected} " in err
    synth, then = "kvemu trace synth mooncake-standin.jsonl --rows 12031", "--set workload.trace=mooncake-standin.jsonl"
    assert synth in err and then in err
    assert _kvemu(capsys, *synth.split()[1:])[0] == 0
    code, out, err = _kvemu(capsys, "validate", str(example), *then.split(), "--set", "run.max_requests=500")
    assert code == 0, err
    assert out.startswith(f"ok: {example.stem}: ") and ", 500 requests" in out


def test_another_missing_mooncake_format_trace_gets_the_synth_command_and_an_agentic_one_does_not(
        clone, capsys, tmp_path):
    _, _, err = _kvemu(capsys, "validate", str(clone / "examples" / "mooncake-3600s.yaml"),
                       "--set", f"workload.trace={tmp_path / 'mine.jsonl'}")
    assert "kvemu trace synth mooncake-standin.jsonl --rows 3000" in err and MOONCAKE_CONVERSATION_URL not in err
    _, _, err = _kvemu(capsys, "validate", str(clone / "examples" / "agentic-lanes.yaml"),
                       "--set", f"workload.trace={tmp_path / 'mine.jsonl'}")
    assert "file not found" in err and "synth" not in err


def test_a_trace_named_on_the_command_line_gets_the_same_hint(clone, capsys, tmp_path):
    code, _, err = _kvemu(capsys, "validate", str(tmp_path / "conversation_trace.jsonl"))
    assert code == 2 and "trace not found" in err and MOONCAKE_CONVERSATION_URL in err
    assert "kvemu trace synth mooncake-standin.jsonl --rows 12031" in err


def test_the_example_comment_downloads_the_trace_to_the_path_it_reads():
    """Run from the clone's root, the comment's curl writes the file ``trace:`` names (relative to examples/)."""
    text = (ROOT / "examples" / "mooncake-3600s.yaml").read_text()
    written = text.split("curl -L --create-dirs -o ", 1)[1].split()[0]
    read = text.split("\n  trace: ", 1)[1].split()[0]
    assert Path("/clone", written).resolve() == Path("/clone/examples", read).resolve()
    assert f"#     {MOONCAKE_CONVERSATION_URL}\n" in text
    assert "kvemu trace synth mooncake-standin.jsonl --rows 12031" in text


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates_in_a_fresh_clone(clone, capsys, tmp_path, path):
    """The trace examples on a generated stand-in (as their error says), the sweep with ``--validate``."""
    example = clone / "examples" / path.name
    if path.name.startswith("sweep-"):
        code, out, err = _kvemu(capsys, "sweep", str(example), "--validate")
    else:
        extra = []
        if path.name in ON_THE_MOONCAKE_TRACE:
            assert _kvemu(capsys, "trace", "synth", str(tmp_path / "t.jsonl"), "--rows", "600")[0] == 0
            extra = ["--set", f"workload.trace={tmp_path / 't.jsonl'}"]
        code, out, err = _kvemu(capsys, "validate", str(example), *extra, "--set", "run.max_requests=300",
                                "--set", "run.duration_s=30")  # (building the whole workload is not the point)
    assert code == 0, err
    assert out.startswith("ok: ")


def test_a_mooncake_example_runs_on_a_synthesized_trace_as_a_user_types_it(clone, tmp_path):
    """``kvemu trace synth`` then ``kvemu run ... --set workload.trace=...``: separate processes, bounded."""
    def kvemu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*KVEMU, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)

    made = kvemu("trace", "synth", "mooncake-standin.jsonl", "--rows", "300", "--seed", "3")
    assert made.returncode == 0, made.stderr
    ran = kvemu("run", str(clone / "examples" / "mooncake-3600s.yaml"), "--set",
                "workload.trace=mooncake-standin.jsonl", "-o", "report", "--quiet")
    assert ran.returncode == 0, ran.stderr
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["num_requests"] == summary["completed_requests"] == 300
    assert summary["kvemu"]["scenario"] == "mooncake-3600s"


def test_synth_writes_the_same_bytes_for_a_seed_and_keeps_an_existing_file(capsys, tmp_path):
    assert _kvemu(capsys, "trace", "synth", str(tmp_path / "a.jsonl"), "--rows", "200", "--seed", "4")[0] == 0
    assert _kvemu(capsys, "trace", "synth", str(tmp_path / "b.jsonl"), "--rows", "200", "--seed", "4")[0] == 0
    assert _kvemu(capsys, "trace", "synth", str(tmp_path / "c.jsonl"), "--rows", "200", "--seed", "5")[0] == 0
    a, b, c = ((tmp_path / f"{x}.jsonl").read_bytes() for x in "abc")
    assert a == b != c and len(a.splitlines()) == 200
    real = tmp_path / "a.jsonl"
    code, _, err = _kvemu(capsys, "trace", "synth", str(real), "--rows", "10")
    assert code == 2 and "exists" in err and real.read_bytes() == a
    assert _kvemu(capsys, "trace", "validate", str(real))[1].startswith(f"ok: {real}: mooncake, 200 requests")
    with pytest.raises(SystemExit):
        main(["trace", "synth", str(tmp_path / "d.jsonl"), "--rows", "0"])
    assert not (tmp_path / "d.jsonl").exists()

"""What a trace path may be, and what a run of a trace will need: a FIFO, socket or device is refused at once
saying what it is (opening a FIFO waited for a writer)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from harness import memory_budget
from harness.workload import build as workload
from harness.memory_budget import MAX_MEMORY_ENV, parse_size
from harness.scenario import ScenarioError, default_scenario_text, parse_scenario
from harness.workload.traces.formats import load_graph
from harness.workload import build_sessions
from kvemu.errors import InvalidArgument
from harness.workload.traces.rows import MAX_TRACE_ROWS
from harness.workload.traces.mooncake import read_mooncake

from tests.harness.test_cli import KVEMU


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "trace.jsonl"
    os.mkfifo(path)
    return path


def test_a_fifo_named_as_a_scenarios_trace_is_refused_saying_what_it_is(tmp_path, fifo):
    with pytest.raises(ScenarioError) as info:
        parse_scenario(f"workload:\n  kind: trace\n  trace: {fifo}\n", source="s.yaml")
    assert str(info.value) == (f"s.yaml: workload.trace (line 3): a FIFO (named pipe), not a file: kvemu reads a "
                               f"trace from a regular file: {fifo}")


def test_a_fifo_is_refused_by_every_trace_reader_without_waiting_for_a_writer(fifo):
    """Each reader opens without blocking and checks what it opened (a FIFO's plain open waits for a writer)."""
    proc = subprocess.run([*KVEMU, "trace", "validate", str(fifo)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"invalid: {fifo}: a FIFO (named pipe), not a file: kvemu reads a trace from a regular file"
    start = time.monotonic()
    for read in (lambda: load_graph(fifo, "mooncake", 16), lambda: load_graph(fifo, "auto", 16),
                 lambda: next(read_mooncake(fifo))):
        with pytest.raises(InvalidArgument, match="a FIFO"):
            read()
    assert time.monotonic() - start < 5


# ------------------------------------------------------------------ what a run will hold, refused up front


def _trace(path, rows: int, bad_last: bool = False):
    lines = [json.dumps({"timestamp": i, "input_length": 32, "output_length": 4, "hash_ids": [i]}) for i in range(rows)]
    if bad_last:
        lines[-1] = "not json"
    path.write_text("\n".join(lines) + "\n")
    return path


def _scenario(trace, extra: str = "") -> str:
    return f"workload:\n  kind: trace\n  trace: {trace}\n  trace_block_size: 16\nrun:\n  mode: virtual\n{extra}"


def test_a_trace_that_will_not_fit_under_the_declared_bound_is_refused_before_a_row_is_read(tmp_path, monkeypatch):
    trace = _trace(tmp_path / "t.jsonl", 2000, bad_last=True)  # a row read would fail on its last line first
    monkeypatch.setenv(MAX_MEMORY_ENV, "100M")  # 96 MiB + 2,000 x 6 KiB is past it
    with pytest.raises(ScenarioError) as info:
        build_sessions(parse_scenario(_scenario(trace)))
    assert str(info.value).startswith(f"{trace}: 2,000 lines: a run of 2,000 requests needs about 108 MiB")
    assert "more than --max-memory (KVEMU_MAX_MEMORY): 100 MiB" in str(info.value)
    # run.max_requests bounds what is kept: the first 10 rows fit
    assert len(build_sessions(parse_scenario(_scenario(_trace(trace, 2000), "  max_requests: 10\n")))) == 10


def test_a_trace_of_max_trace_rows_is_refused_from_its_line_count_where_memory_cannot_hold_it(tmp_path, monkeypatch):
    """10^7 rows (``MAX_TRACE_ROWS``) passed validate, then kvemu run passed 10 GB in 193 s with no report. The
    line count is stood in for (a real 10^7-line file is 800 MB); no row is parsed."""
    trace = _trace(tmp_path / "t.jsonl", 3)
    monkeypatch.delenv(MAX_MEMORY_ENV, raising=False)
    monkeypatch.setattr(workload, "line_count", lambda path: MAX_TRACE_ROWS)
    monkeypatch.setattr(memory_budget, "available_memory", lambda: 24 << 30)  # this machine: 24 GB
    monkeypatch.setattr(workload, "load_trace", lambda *a, **k: pytest.fail("rows were read"))
    start = time.monotonic()
    with pytest.raises(ScenarioError, match=r"10,000,000 requests needs about 57.3 GiB .* more than the memory "
                                            r"available: 24.0 GiB"):
        build_sessions(parse_scenario(_scenario(trace)))
    assert time.monotonic() - start < 5


def test_validate_and_run_say_it_naming_the_bound_and_run_writes_nothing(tmp_path):
    trace = _trace(tmp_path / "t.jsonl", 2000)
    (tmp_path / "s.yaml").write_text(_scenario(trace))
    env = {**os.environ, MAX_MEMORY_ENV: ""}
    for command in (["validate"], ["run", "-o", str(tmp_path / "out"), "--quiet"]):
        proc = subprocess.run([*KVEMU, *command, str(tmp_path / "s.yaml"), "--max-memory", "100M"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2, proc.stderr
        assert "needs about 108 MiB" in proc.stderr and "more than --max-memory" in proc.stderr
    assert not (tmp_path / "out" / "report.md").exists()


def test_a_synthetic_workload_is_counted_once_built(monkeypatch):
    monkeypatch.setenv(MAX_MEMORY_ENV, "97M")
    with pytest.raises(ScenarioError, match=r"^the workload: a run of [0-9,]+ requests needs about"):
        build_sessions(parse_scenario(default_scenario_text()))


def test_sizes_are_read_in_binary_units():
    assert [parse_size(s) for s in ("8G", "512M", "1.5g", "64KiB", "1000")] == [8 << 30, 512 << 20, 3 << 29,
                                                                                64 << 10, 1000]
    for bad in ("", "-1G", "0", "8 parsecs", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)

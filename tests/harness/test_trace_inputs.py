"""What a trace path may be, and what a run of a trace will need: a FIFO, socket or device is refused at once
saying what it is (opening a FIFO waited for a writer)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from harness.scenario import ScenarioError, parse_scenario
from harness.traces.formats import load_graph
from kvemu.errors import InvalidArgument
from workers.trace import read_mooncake

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

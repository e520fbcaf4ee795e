"""bench.instructions reads callgrind's totals by event name: instructions and the last-level misses, which callgrind
prints in the order of its ``events:`` line (with the cache simulated, Ir is only the first of nine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.instructions import LL_MISSES, event_totals, first_rows, total_instructions

CACHE_SIM = """version: 1
creator: callgrind-3.22.0
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
fl=(1) x.c
fn=(1) main
3 10 2 1 0 0 0 0 0 0
summary: 1000 300 200 40 30 20 4 3 2
totals: 1000 300 200 40 30 20 4 3 2
"""


def test_the_events_are_read_by_name_and_the_last_level_misses_are_the_three_ll_events() -> None:
    totals = event_totals(CACHE_SIM)
    assert totals["Ir"] == 1000 == total_instructions(CACHE_SIM)
    assert sum(totals[e] for e in LL_MISSES) == 4 + 3 + 2


def test_a_run_without_the_cache_simulated_has_instructions_only() -> None:
    plain = "events: Ir\nsummary: 5421\n"
    assert event_totals(plain) == {"Ir": 5421} and sum(event_totals(plain).get(e, 0) for e in LL_MISSES) == 0
    with pytest.raises(ValueError):
        event_totals("events: Ir\n")


def test_the_reference_replays_the_rows_kvemu_replays(tmp_path: Path) -> None:
    """kvemu's ``run.max_requests`` N replays the trace's first N rows; the reference gets exactly those."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3}\n')
    assert first_rows(trace, 2, tmp_path).read_text() == '{"a": 1}\n{"a": 2}\n'

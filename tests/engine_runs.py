"""Driving an engine core to the end in tests: every request added, event to event, invariants checked."""

from __future__ import annotations

from typing import Any

from kvemu.records import RequestRecord
from workers.request import Request


def run_to_end(eng: Any, reqs: list[Request]) -> dict[str, RequestRecord]:
    """Add ``reqs`` to ``eng``, advance from one next event to the next until nothing is pending (checking the
    core's invariants after each step); the completed records by request id."""
    for r in reqs:
        eng.add_request(r)
    done: dict[str, RequestRecord] = {}
    while (t := eng.next_event_ns()) is not None:
        for rec in eng.advance_to(t).completed:
            done[rec.request_id] = rec
        eng.check_invariants()
    return done

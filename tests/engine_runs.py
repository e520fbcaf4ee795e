"""Driving an engine core to the end in tests: every request added, event to event, invariants checked."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvemu.records import RequestRecord
from workers.request import Request
from workers.results import StepResult


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


def steps(eng: Any, reqs: Iterable[Request] = (), next_start: Callable[[], int | None] | None = None
          ) -> Iterator[StepResult]:
    """Add ``reqs`` to ``eng``, then step it at each pass start until there is none (checking the core's invariants
    after each step), yielding each step's result. ``next_start`` (by default the engine's ``next_pass_start_ns``)
    says where the next step starts, None to stop: a test may act on the engine there first."""
    for r in reqs:
        eng.add_request(r)
    where = eng.next_pass_start_ns if next_start is None else next_start
    while (s := where()) is not None:
        res = eng.step(s)
        eng.check_invariants()
        yield res

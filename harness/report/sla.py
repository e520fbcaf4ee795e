"""Goodput (``run.sla``): which completed requests met the scenario's latency targets, as the reference replay counts.

The targets and what meeting them means are the scenario's section ``harness.scenario.sections.Sla`` (re-exported
here); goodput is the requests (and their output tokens) that met them, over the run's duration.
"""

from __future__ import annotations

import msgspec

from kvemu.records import RequestRecord

from harness.scenario.sections import Sla

__all__ = ["Sla", "Goodput", "goodput"]


class Goodput(msgspec.Struct, frozen=True, kw_only=True):
    """The requests that met the SLA, and their rate over the run (the summary's ``goodput_*`` keys)."""

    completed_requests: int
    request_throughput_rps: float | None
    """None: the run has no duration."""
    output_throughput_tok_s: float | None


def goodput(sla: Sla, records: list[RequestRecord], duration_s: float | None) -> Goodput:
    """The reference's goodput for ``records`` over ``duration_s`` (None: no duration)."""
    met = [r for r in records if sla.met(r)]
    tokens = sum(len(r.token_times_ns) for r in met)
    return Goodput(completed_requests=len(met),
                   request_throughput_rps=len(met) / duration_s if duration_s else None,
                   output_throughput_tok_s=tokens / duration_s if duration_s else None)

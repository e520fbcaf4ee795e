"""Goodput (``run.sla``): which completed requests met the scenario's latency targets, as the reference replay counts.

The targets and what meeting them means are the scenario's section ``harness.scenario.sections.Sla`` (re-exported
here); goodput is the requests (and their output tokens) that met them, over the run's duration.
"""

from __future__ import annotations

from kvemu.records import RequestRecord

from harness.scenario.sections import Sla

__all__ = ["Sla", "goodput"]


def goodput(sla: Sla, records: list[RequestRecord], duration_s: float | None) -> dict[str, float | int | None]:
    """The reference's ``goodput_*`` summary keys for ``records`` over ``duration_s`` (None: no duration)."""
    met = [r for r in records if sla.met(r)]
    tokens = sum(len(r.token_times_ns) for r in met)
    return {
        "goodput_completed_requests": len(met),
        "goodput_request_throughput_rps": len(met) / duration_s if duration_s else None,
        "goodput_output_throughput_tok_s": tokens / duration_s if duration_s else None,
    }

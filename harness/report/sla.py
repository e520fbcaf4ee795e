"""Latency targets (``run.sla``) and goodput: which completed requests met them, as the reference replay counts.

A request meets the SLA when it completed and its TTFT is at most ``ttft_ms`` and its mean inter-token latency
((last token − first token) / (output tokens − 1); a one-token reply has none and passes) at most ``itl_ms``;
or, with ``e2e_ms`` instead, when its end-to-end latency is at most that. Bounds are inclusive. Goodput is the
requests (and their output tokens) that met it, over the run's duration.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvemu.errors import InvalidArgument
from kvemu.records import RequestRecord
from kvemu.validation import check_struct

__all__ = ["Sla", "goodput"]

NS_PER_MS = 1_000_000
Millis = Annotated[float, Meta(gt=0, le=1e12)]


class Sla(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Per-request latency targets in ms: ``ttft_ms`` and/or ``itl_ms``, or ``e2e_ms`` alone."""

    ttft_ms: Millis | None = None
    itl_ms: Millis | None = None
    e2e_ms: Millis | None = None

    def __post_init__(self) -> None:
        check_struct(self)
        if self.e2e_ms is not None and (self.ttft_ms is not None or self.itl_ms is not None):
            raise InvalidArgument("e2e_ms is mutually exclusive with ttft_ms and itl_ms (as in the reference "
                                  "replay): give ttft_ms and/or itl_ms, or e2e_ms alone", field="e2e_ms")
        if self.ttft_ms is None and self.itl_ms is None and self.e2e_ms is None:
            raise InvalidArgument("an SLA needs a target: ttft_ms and/or itl_ms, or e2e_ms", field="ttft_ms")

    def met(self, rec: RequestRecord) -> bool:
        """Whether ``rec`` completed within every target."""
        if not rec.done or rec.first_token_ns is None or rec.completion_ns is None:  # done has a completion: narrows
            return False
        if self.e2e_ms is not None:
            return (rec.completion_ns - rec.arrival_ns) / NS_PER_MS <= self.e2e_ms
        if self.ttft_ms is not None and (rec.first_token_ns - rec.arrival_ns) / NS_PER_MS > self.ttft_ms:
            return False
        if self.itl_ms is not None:
            times = rec.token_times_ns
            if len(times) >= 2 and (times[-1] - times[0]) / (len(times) - 1) / NS_PER_MS > self.itl_ms:
                return False
        return True


def goodput(sla: Sla, records: list[RequestRecord], duration_s: float | None) -> dict[str, float | int | None]:
    """The reference's ``goodput_*`` summary keys for ``records`` over ``duration_s`` (None: no duration)."""
    met = [r for r in records if sla.met(r)]
    tokens = sum(len(r.token_times_ns) for r in met)
    return {
        "goodput_completed_requests": len(met),
        "goodput_request_throughput_rps": len(met) / duration_s if duration_s else None,
        "goodput_output_throughput_tok_s": tokens / duration_s if duration_s else None,
    }

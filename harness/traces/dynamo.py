"""Deprecated alias of ``harness.workload.traces.dynamo`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.dynamo import SCHEMA, load_dynamo

__all__ = ["SCHEMA", "load_dynamo"]

warnings.warn("harness.traces.dynamo is deprecated: import from harness.workload.traces.dynamo",
              DeprecationWarning, stacklevel=2)

"""Deprecated alias of ``harness.workload.turns`` (the workload's modules have their folder now), kept for one release.

``Sessions``, once here, is ``harness.workload.forms.Sessions``."""

import warnings

from harness.workload.forms import Sessions  # noqa: F401  (the old name, for one release)
from harness.workload.turns import Session, SessionList, Turn, Workload, sessions_in_words

__all__ = ["Turn", "Session", "SessionList", "Workload", "sessions_in_words"]

warnings.warn("harness.turns is deprecated: import from harness.workload.turns",
              DeprecationWarning, stacklevel=2)

"""Autoscaling policies the tests name as ``autoscaler.policy: tests.autoscale_policies:NAME`` (imported by
tests/harness/test_autoscaler.py first, so the plugin loader finds it in ``sys.modules``; see tests/README.md)."""

from kvemu.autoscale import AutoscaleConfig, MetricsSnapshot, ScaleDecision

SEEN: list[MetricsSnapshot] = []
"""Every snapshot the last ``Scripted`` policy was shown."""

S = 1_000_000_000


class Scripted:
    """Adds one worker at the first tick and removes one at the third, whatever the load; keeps what it saw."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.ticks = 0
        SEEN.clear()

    def decide(self, snapshot: MetricsSnapshot) -> list[ScaleDecision]:
        SEEN.append(snapshot)
        self.ticks += 1
        if self.ticks == 1:
            return [ScaleDecision(action="add", reason="scripted: first tick")]
        if self.ticks == 3:
            return [ScaleDecision(action="remove", reason="scripted: third tick")]
        return []


def no_decide(config: AutoscaleConfig) -> object:
    """Not a policy: it has no ``decide``."""
    return object()

"""Deprecated alias of ``workers.actor.drivers`` (the actor shell has its folder now), kept for one release."""

import warnings

from workers.actor.drivers import DriverHost, LiveDriver, ModeDriver, RunMode, VirtualDriver, mode_driver

__all__ = ["DriverHost", "LiveDriver", "ModeDriver", "RunMode", "VirtualDriver", "mode_driver"]

warnings.warn("workers.drivers is deprecated: import from workers.actor.drivers",
              DeprecationWarning, stacklevel=2)

"""Interpolated timing: pass latencies read from profile data measured on a real GPU (the reference mocker's
``dynamo_profile`` provider; how it interpolates is said in ``model``).

Profile files are untrusted input: sizes are bounded before anything is read, NPZ arrays are read without
pickles, and every error is an ``InvalidArgument`` naming the field, array or CSV line at fault.

Where each part lives: ``data`` (``ProfileData`` and its bounds), ``model`` (``ProfileTiming``, the
interpolation), ``files`` (``load_profile``, ``save_profile``: NPZ and CSV), ``sampling``
(``profile_from_model``) and ``cache`` (``cached_profile_timing``).
"""

from __future__ import annotations

from workers.profile.cache import cached_profile_timing
from workers.profile.data import MAX_AXIS_POINTS, MAX_GRID_CELLS, ProfileData
from workers.profile.files import CSV_HEADER, MAX_FILE_BYTES, PROFILE_KEYS, load_profile, save_profile
from workers.profile.model import ProfileTiming
from workers.profile.sampling import profile_from_model

__all__ = [
    "ProfileData",
    "ProfileTiming",
    "load_profile",
    "save_profile",
    "profile_from_model",
    "cached_profile_timing",
    "PROFILE_KEYS",
    "CSV_HEADER",
    "MAX_AXIS_POINTS",
    "MAX_GRID_CELLS",
    "MAX_FILE_BYTES",
]

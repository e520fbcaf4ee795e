"""``cached_profile_timing``: one ``ProfileTiming`` per profile file version, shared by every rank of a cluster."""

from __future__ import annotations

import os
from pathlib import Path

from kvemu.errors import InvalidArgument
from workers.profile.model import ProfileTiming

__all__ = ["cached_profile_timing"]

_CACHE: dict[tuple[str, int, int], ProfileTiming] = {}
_CACHE_KEPT = 8


def cached_profile_timing(path: str | os.PathLike[str]) -> ProfileTiming:
    """``ProfileTiming.from_path(path)``, read once per file version (every rank of a cluster shares it)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise InvalidArgument(f"profile {p}: cannot read it: {exc.strerror}", field="path") from None
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    model = _CACHE.get(key)
    if model is None:
        if len(_CACHE) >= _CACHE_KEPT:
            _CACHE.clear()
        model = _CACHE[key] = ProfileTiming.from_path(p)
    return model

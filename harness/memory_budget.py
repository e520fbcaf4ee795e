"""What a run of ``kvemu run`` will hold in memory, estimated from its request count before anything runs, and
the bound it must fit: the memory available (``/proc/meminfo``, the cgroup's limit) or a declared
``--max-memory`` (``KVEMU_MAX_MEMORY``). A run past it is refused up front, naming the bound, instead of
growing until the machine stops it with no report (10^7 trace rows passed 10 GB in 193 s)."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["BASE_BYTES", "BYTES_PER_REQUEST", "MAX_MEMORY_ENV", "available_memory", "declared_memory",
           "memory_problem", "parse_size"]

BYTES_PER_REQUEST = 6 << 10
"""Memory a request holds until the report is written (its record, token times, the report's tables): about
5.5 KB measured over 10^6 Mooncake rows in virtual time (5.5 GB), rounded up."""
BASE_BYTES = 96 << 20
"""Memory a run holds whatever its size (the interpreter, kvemu, the cluster, the report's libraries)."""
MAX_MEMORY_ENV = "KVEMU_MAX_MEMORY"
"""A declared bound (``8G``, ``512M``, bytes) that ``--max-memory`` sets; the run must fit under it too."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``8G``, ``512MB``, ``1.5g``, ``1000000`` as bytes (binary units); ``ValueError`` for anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size: write it as 8G, 512M or a number of bytes")
    return min(int(float(match.group(1)) * _UNITS[match.group(2)]), 1 << 62)


def declared_memory() -> int | None:
    """The bound ``--max-memory`` / ``KVEMU_MAX_MEMORY`` declares (None: none)."""
    text = os.environ.get(MAX_MEMORY_ENV)
    return parse_size(text) if text else None


def available_memory() -> int | None:
    """Bytes this process could still take: ``MemAvailable``, lowered to what the cgroup's ``memory.max`` leaves
    (None where neither can be read)."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((cgroup / "memory.current").read_text())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _size(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):,.0f} MiB"


def memory_problem(requests: int, what: str) -> str | None:
    """Why ``requests`` requests (of ``what``: "the trace's 10,000,000 rows") will not fit in memory, naming the
    bound they pass, or None when they fit (or no bound is known)."""
    need = BASE_BYTES + requests * BYTES_PER_REQUEST
    bounds = [(b, name) for b, name in ((declared_memory(), f"--max-memory ({MAX_MEMORY_ENV})"),
                                          (available_memory(), "the memory available")) if b is not None]
    if not bounds:
        return None
    bound, name = min(bounds)
    if need <= bound:
        return None
    return (f"{what}: a run of {requests:,} requests needs about {_size(need)} ({BYTES_PER_REQUEST >> 10} KiB a "
            f"request, kept until the report is written), more than {name}: {_size(bound)}; set run.max_requests "
            "or run.duration_s to run part of it, or split the trace")

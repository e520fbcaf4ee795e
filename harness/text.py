"""Small wording helpers for what kvemu prints: counts with their nouns agreeing."""

from __future__ import annotations

__all__ = ["counted"]


def counted(n: int | float, noun: str, plural: str | None = None) -> str:
    """``1 worker``, ``2 workers``, ``1 DP rank``, ``3 processes`` (``plural`` when adding an s will not do)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"

"""A token bucket told the time: how often something may happen, with a burst allowance; sans-IO."""

from __future__ import annotations

from kvemu.clock import NS_PER_S
from kvemu.errors import InvalidArgument

__all__ = ["TokenBucket"]


class TokenBucket:
    """``burst`` tokens at first, refilled at ``rate_per_s``; ``take`` spends one when there is one.

    Tokens are kept in integer nano-tokens, so refills are exact and deterministic under a virtual clock.
    """

    __slots__ = ("rate_per_s", "burst", "_nano", "_at_ns")

    def __init__(self, rate_per_s: float, burst: int, now_ns: int = 0) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise InvalidArgument(f"a token bucket needs rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._nano = burst * NS_PER_S  # tokens × 10^9
        self._at_ns = now_ns

    def _refill(self, now_ns: int) -> None:
        if now_ns > self._at_ns:
            self._nano = min(self.burst * NS_PER_S, self._nano + round((now_ns - self._at_ns) * self.rate_per_s))
            self._at_ns = now_ns

    def take(self, now_ns: int) -> bool:
        """Spend one token if there is one (and say whether there was)."""
        self._refill(now_ns)
        if self._nano >= NS_PER_S:
            self._nano -= NS_PER_S
            return True
        return False

    def wait_s(self, now_ns: int) -> float:
        """Seconds until the next token (0 when one is there)."""
        self._refill(now_ns)
        missing = NS_PER_S - self._nano
        return 0.0 if missing <= 0 else missing / self.rate_per_s / NS_PER_S

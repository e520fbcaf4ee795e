"""The interpolation model: pass latencies read from profile data measured on a real GPU (the reference mocker's
``dynamo_profile`` provider).

Prefill time is a 1-D linear interpolation over the new prompt tokens of the pass, extrapolated past both
ends with the end segment's slope and clamped at 0. Decode time is a bilinear interpolation over
(active KV tokens, mean context length = active // batch size), extrapolated past every edge with the end
cell (cross term included) and floored at 1 ms. The pool's capacity plays no part. (Measured against
ai-dynamo-runtime 1.6.1; see docs/profiles.md for the file formats and how to measure a GPU.)
"""

from __future__ import annotations

import os
from bisect import bisect_right

from kvemu.errors import InvalidArgument
from workers.profile.data import ProfileData
from workers.profile.files import load_profile

__all__ = ["ProfileTiming"]

_PREFILL_MEMO = 1 << 16
"""Prefill results kept per model (by token count); past it the memo starts afresh."""


class ProfileTiming:
    """Timing model interpolating a ``ProfileData`` (the reference's ``dynamo_profile`` provider)."""

    __slots__ = ("data", "_px", "_py", "_pslope", "_prefill_memo", "_dx", "_dy", "_grid")

    batch_aware = True
    """``decode_ms`` takes the number of decoding requests (``PassTimer`` passes it)."""

    def __init__(self, data: ProfileData) -> None:
        if not isinstance(data, ProfileData):
            raise InvalidArgument(f"ProfileTiming needs a ProfileData, got {type(data).__name__}", field="data")
        self.data = data
        xs, ys = list(data.prefill_isl), list(data.prefill_ttft_ms)
        self._px, self._py = xs, ys
        self._pslope = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
        self._prefill_memo: dict[int, float] = {}
        self._dx = list(data.decode_active_kv_tokens)
        self._dy = list(data.decode_context_length)
        self._grid = [list(r) for r in data.decode_itl]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> ProfileTiming:
        """The model of the profile file at ``path`` (``.npz`` or ``.csv``; see ``load_profile``)."""
        return cls(load_profile(path))

    def prefill_ms(self, new_tokens: int) -> float:
        """Pass time for ``new_tokens`` new prompt tokens: linear in between points, end slopes beyond; >= 0."""
        if new_tokens <= 0:
            return 0.0
        memo = self._prefill_memo
        t = memo.get(new_tokens)
        if t is None:
            t = self._prefill(new_tokens)
            if len(memo) >= _PREFILL_MEMO:
                memo.clear()
            memo[new_tokens] = t
        return t

    def _prefill(self, n: float) -> float:
        xs, ys, slope = self._px, self._py, self._pslope
        # anchored on the point at or below n (the last point past the end, the first before the start) so
        # that every measured point is reproduced exactly
        if n >= xs[-1]:
            t = ys[-1] + (n - xs[-1]) * slope[-1]
        elif n < xs[0]:
            t = ys[0] + (n - xs[0]) * slope[0]
        else:
            i = bisect_right(xs, n) - 1
            a, b = ys[i], ys[i + 1]
            t = a + (n - xs[i]) * slope[i]
            # never past a neighbour through rounding
            t = (a if t < a else b if t > b else t) if a <= b else (b if t < b else a if t > a else t)
        return t if t > 0.0 else 0.0  # also maps a NaN (an overflowing slope) to 0, as the reference does

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, batch_size: int) -> float:
        """Pass time for ``batch_size`` decodes holding ``active_kv_tokens``: bilinear on (active, active //
        batch) with the end cells extended beyond the grid; floored at 1 ms. ``total_kv_tokens`` is unused."""
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size!r}", field="batch_size")
        return self.decode_at(active_kv_tokens, active_kv_tokens // batch_size)

    def decode_at(self, active_kv_tokens: float, context_length: float) -> float:
        """Decode pass time at an explicit grid coordinate (``decode_ms`` with the mean context given)."""
        x, y = active_kv_tokens, context_length
        xs, ys = self._dx, self._dy
        i = bisect_right(xs, x) - 1
        i = 0 if i < 0 else len(xs) - 2 if i > len(xs) - 2 else i
        j = bisect_right(ys, y) - 1
        j = 0 if j < 0 else len(ys) - 2 if j > len(ys) - 2 else j
        tx = (x - xs[i]) / (xs[i + 1] - xs[i])
        ty = (y - ys[j]) / (ys[j + 1] - ys[j])
        r0, r1 = self._grid[i], self._grid[i + 1]
        ux, uy = 1.0 - tx, 1.0 - ty
        t = (r0[j] * ux + r1[j] * tx) * uy + (r0[j + 1] * ux + r1[j + 1] * tx) * ty
        return t if t > 1.0 else 1.0  # a NaN is floored too, as the reference does

    def __repr__(self) -> str:
        rows, cols = self.data.grid_shape
        return (f"ProfileTiming(prefill: {len(self._px)} points, "
                f"decode: {rows}x{cols} grid of active_kv_tokens x context_length)")

"""``profile_from_model``: a ``ProfileData`` sampled from another timing model (the benchmark runs kvemu and the
reference mocker side by side on such a profile)."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable
from typing import Any

from kvemu.errors import InvalidArgument
from workers.profile.data import MAX_AXIS_POINTS, MAX_GRID_CELLS, ProfileData, float_tuple

__all__ = ["profile_from_model"]


def _token_points(field: str, points: Iterable[int]) -> list[int]:
    out = []
    for i, p in enumerate(float_tuple(field, points, MAX_AXIS_POINTS)):
        if not p.is_integer():
            raise InvalidArgument(f"{field}[{i}] must be a whole number of tokens, got {p!r}", field=field)
        out.append(int(p))
    return out


def _takes_batch(decode_ms: Any) -> bool:
    """Whether ``decode_ms`` accepts ``(active, total, batch_size)`` (the 2-argument form is the older one)."""
    try:
        inspect.signature(decode_ms).bind(0, 1, 1)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume the current protocol
        return True
    return True


def profile_from_model(model: Any, *, prefill_points: Iterable[int], active_kv_points: Iterable[int],
                       context_points: Iterable[int], total_kv_tokens: int) -> ProfileData:
    """``ProfileData`` sampled from another timing model at the given token counts.

    Decode cell (a, c) is ``model.decode_ms(a, total_kv_tokens, max(1, a // c))``, so the batch's mean context
    is about ``c`` (a batch of ``max(1, a)`` for ``c`` = 0); a model whose ``decode_ms`` takes only
    ``(active, total)`` is called that way. The benchmark writes such a profile to run kvemu and the
    reference mocker side by side on the same timings.
    """
    if isinstance(total_kv_tokens, bool) or not isinstance(total_kv_tokens, numbers.Integral) or total_kv_tokens < 1:
        raise InvalidArgument(f"total_kv_tokens must be an integer >= 1, got {total_kv_tokens!r}",
                              field="total_kv_tokens")
    prefill = _token_points("prefill_isl", prefill_points)
    active = _token_points("decode_active_kv_tokens", active_kv_points)
    context = _token_points("decode_context_length", context_points)
    if len(active) * len(context) > MAX_GRID_CELLS:
        raise InvalidArgument(f"the decode grid would have {len(active) * len(context):,} cells, more than "
                              f"{MAX_GRID_CELLS:,}", field="decode_itl")
    decode = model.decode_ms
    with_batch = _takes_batch(decode)
    total = int(total_kv_tokens)

    def cell(a: int, c: int) -> float:
        if not with_batch:
            return decode(a, total)
        return decode(a, total, max(1, a // c) if c > 0 else max(1, a))

    return ProfileData(
        prefill_isl=prefill,
        prefill_ttft_ms=[model.prefill_ms(n) for n in prefill],
        decode_active_kv_tokens=active,
        decode_context_length=context,
        decode_itl=[[cell(a, c) for c in context] for a in active],
    )

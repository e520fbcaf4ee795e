"""Forward-pass timing: the reference mocker's polynomial model, pluggable, in integer nanoseconds.

A pass that holds prefill chunks and decodes lasts prefill time + decode time: the reference mocker
runs the two phases of a step one after the other, and a mixed batch does strictly more work than
either part alone, so taking the max would make piggy-backed decodes free.

The decode part's KV occupancy is the summed context length of the requests *decoding* in the pass
(prompt + output tokens, the token being computed included), as the reference mocker measures it: a
prefix shared by several requests counts once per request, partial blocks count by their tokens, and
the prompts of requests still in prefill do not count. (Measured against ai-dynamo-runtime 1.6.1: a
single 1,000-token request decodes its second token in exactly the time of 1,001 KV tokens; two
requests sharing a 512-token prefix decode as fast as two disjoint ones.)
"""

from __future__ import annotations

import math
from array import array
from itertools import accumulate
from collections.abc import Iterable

from kvemu.errors import InvalidArgument
from workers.config import EngineConfig, InterpolatedTimingSpec
from workers.timing_protocols import BatchAwareTimingModel, TimingModel  # runtime_checkable: kept apart

__all__ = ["TimingModel", "BatchAwareTimingModel", "AnyTimingModel", "PolynomialTiming", "PassTimer", "NS_PER_MS",
           "timing_model"]

NS_PER_MS = 1_000_000


AnyTimingModel = TimingModel | BatchAwareTimingModel
"""What an engine takes as its timing model; ``PassTimer`` tells the two apart by ``batch_aware``."""


def timing_model(config: EngineConfig) -> AnyTimingModel:
    """The timing model an engine configuration names (a profile file is read once per file version)."""
    spec = config.timing_model
    if isinstance(spec, InterpolatedTimingSpec):
        from workers.profile import cached_profile_timing

        return cached_profile_timing(spec.path)
    return PolynomialTiming()


class PolynomialTiming:
    """Reference polynomial: prefill quadratic in new tokens, decode quadratic in KV occupancy."""

    __slots__ = ()

    def prefill_ms(self, new_tokens: int) -> float:
        """``4.209989e-07*T^2 + 1.518344e-02*T + 16.50142`` ms for T > 0 new tokens, else 0."""
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int) -> float:
        """``-25.74*p^2 + 54.01*p + 5.74`` ms with ``p = min(1, active/total)``, floored at 1 ms.

        ``p`` is capped because a prefix shared by several decoding requests counts once per request, so
        the sum can exceed the pool (the reference caps it the same way)."""
        p = active_kv_tokens / total_kv_tokens
        if p > 1.0:
            p = 1.0
        return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)

    def decode_ns_series(self, first: int, step: int, count: int, total_kv_tokens: int, scale: float) -> list[int]:
        """``[round(decode_ms(first + i * step, total_kv_tokens) * scale) for i in range(count)]``, equal bit
        for bit (always finite and >= 1 ms, so nothing to check), read from a shared table of durations."""
        if count <= 0:
            return []
        if first < 0 or step < 0:
            return _decode_ns(range(first, first + count * step, step) if step else [first] * count, total_kv_tokens, scale)
        return _tabulated(first, step, count, total_kv_tokens, scale)

    def __repr__(self) -> str:
        return "PolynomialTiming()"


def _decode_ns(actives: Iterable[int], total_kv_tokens: int, scale: float) -> list[int]:
    t = float(total_kv_tokens)
    exact = total_kv_tokens < 1 << 53  # then int / int divides the two floats, as _decode_one does
    return [_decode_one(a, total_kv_tokens, t, exact, scale) for a in actives]


def _decode_one(a: int, total_kv_tokens: int, t: float, exact: bool, scale: float) -> int:
    """One scaled decode duration: ``round(PolynomialTiming().decode_ms(a, total_kv_tokens) * scale)``."""
    p = 1.0
    if a < total_kv_tokens:
        p = float(a) / t if exact else a / total_kv_tokens
    ms = -25.74 * p * p + 54.01 * p + 5.74
    return _round_half_even((ms if ms > 1.0 else 1.0) * scale)


def _round_half_even(x: float) -> int:
    """``round(x)``, ties to even, worked out in floats (compiled, it makes no call into Python's ``round``)."""
    f = math.floor(x)
    diff = x - f  # exact: the fraction of x (and 0 once x is too large to have one)
    if diff > 0.5 or (diff == 0.5 and f & 1):
        return f + 1
    return f


_CHUNK = 4096
"""KV sizes per tabulated chunk of decode durations."""
_CHUNKS_KEPT = 512
"""Chunks kept per configuration (2M KV sizes, 16 MB); past it the configuration's memo starts afresh."""
_TABLES_KEPT = 4
"""Configurations (capacity, scale) with a memo; a further one starts the whole memo afresh."""
_DECODE_TABLES: dict[tuple[int, float], dict[int, array]] = {}


def _tabulated(first: int, step: int, count: int, total_kv_tokens: int, scale: float) -> list[int]:
    """``_decode_ns`` of ``first, first + step, ...`` read from chunks of durations tabulated on first use and
    shared by every engine of one configuration (the duration is a pure function of the KV size)."""
    key = (total_kv_tokens, scale)
    chunks = _DECODE_TABLES.get(key)
    if chunks is None:
        if len(_DECODE_TABLES) >= _TABLES_KEPT:
            _DECODE_TABLES.clear()
        chunks = _DECODE_TABLES[key] = {}
    out: list[int] = []
    a = first
    last = first + (count - 1) * step
    while a <= last:
        ci, off = divmod(a, _CHUNK)
        chunk = chunks.get(ci)
        if chunk is None:
            if len(chunks) >= _CHUNKS_KEPT:
                chunks.clear()
            base = ci * _CHUNK
            chunk = chunks[ci] = array("q", _decode_ns(range(base, base + _CHUNK), total_kv_tokens, scale))
        if not step:
            return [chunk[off]] * count
        stop = min(last - ci * _CHUNK, _CHUNK - 1)  # the last offset of this chunk the series reaches
        if not out and stop == last - ci * _CHUNK:  # the whole series lies in one chunk
            return chunk[off : stop + 1 : step].tolist()
        out += chunk[off : stop + 1 : step]
        a += ((stop - off) // step + 1) * step
    return out


_DECODE_MEMO = 1 << 16
_RUN_MAX = 1 << 14
"""Longest decode run kept for reuse (passes)."""


def _to_ns(ms: float, scale: float, what: str) -> int:
    if not (ms >= 0 and ms != float("inf")):
        raise InvalidArgument(f"timing model {what} must return a finite number >= 0, got {ms!r}")
    return round(ms * scale)


class PassTimer:
    """Turns a pass's composition into an integer-nanosecond duration for one engine configuration.

    Prefill time / ``speedup_ratio``, decode time / (``speedup_ratio * decode_speedup_ratio``); ratio 0: 0 ns.
    A speculative model's draft cost multiplies them: prefill by 1 + ``draft_cost``, decode by 1 + k x ``draft_cost``.
    """
    # Decode durations depend only on the decode KV tokens, so they are memoised (the memo is bounded).

    __slots__ = ("model", "block_size", "total_kv_tokens", "_prefill_scale", "_decode_scale", "_decode_cache",
                 "_run", "slowdown", "_batch_aware")

    def __init__(self, config: EngineConfig, model: AnyTimingModel | None = None) -> None:
        self.model: AnyTimingModel = model if model is not None else timing_model(config)
        self._batch_aware = bool(getattr(self.model, "batch_aware", False))
        self.block_size = config.resolved_block_size
        self.total_kv_tokens = config.capacity_tokens
        prefill_ratio = config.speedup_ratio
        decode_ratio = config.speedup_ratio * config.decode_speedup_ratio
        # nanoseconds per unscaled millisecond; 0 means the part takes no time at all
        self._prefill_scale = NS_PER_MS / prefill_ratio if prefill_ratio > 0 else 0.0
        self._decode_scale = NS_PER_MS / decode_ratio if decode_ratio > 0 else 0.0
        spec = config.speculative
        if spec is not None and spec.draft_cost:  # the draft model runs once per prompt chunk, k times per decode
            self._prefill_scale *= 1.0 + spec.draft_cost
            self._decode_scale *= 1.0 + spec.num_speculative_tokens * spec.draft_cost
        self._decode_cache: dict[int | tuple[int, int], int] = {}  # by KV tokens (batch-aware: and batch size)
        self._run: tuple[int, int, list[int], list[int]] | None = None  # (first KV tokens, step, durations, sums)
        self.slowdown = 1.0

    def set_slowdown(self, factor: float) -> None:
        """Multiply every later pass duration by ``factor`` (chaos: a slow or throttled GPU)."""
        if not factor > 0:
            raise ValueError(f"slowdown factor must be > 0, got {factor!r}")
        self._prefill_scale *= factor / self.slowdown
        self._decode_scale *= factor / self.slowdown
        self.slowdown = factor
        self._decode_cache.clear()
        self._run = None

    def prefill_ns(self, new_tokens: int) -> int:
        """Scaled duration of the prefill part of a pass computing ``new_tokens`` uncached tokens."""
        if new_tokens <= 0 or not self._prefill_scale:
            return 0
        return _to_ns(self.model.prefill_ms(new_tokens), self._prefill_scale, "prefill_ms")

    def decode_ns(self, decode_kv_tokens: int, batch_size: int = 1) -> int:
        """Scaled duration of the decode part of a pass whose ``batch_size`` decoding requests hold
        ``decode_kv_tokens``."""
        cache = self._decode_cache
        key = (decode_kv_tokens, batch_size) if self._batch_aware else decode_kv_tokens
        cached = cache.get(key)
        if cached is None:
            if not self._decode_scale:
                cached = 0
            else:
                # (_batch_aware says which of the two forms self.model is; mypy cannot see it)
                if self._batch_aware:
                    ms = self.model.decode_ms(decode_kv_tokens, self.total_kv_tokens, batch_size)  # type: ignore[call-arg]
                else:
                    ms = self.model.decode_ms(decode_kv_tokens, self.total_kv_tokens)  # type: ignore[call-arg]
                cached = _to_ns(ms, self._decode_scale, "decode_ms")
            if len(cache) >= _DECODE_MEMO:
                cache.clear()
            cache[key] = cached
        return cached

    def decode_series_ns(self, first_kv_tokens: int, step: int, count: int) -> list[int]:
        """Decode durations of ``count`` consecutive passes with ``first_kv_tokens``, ``+ step``, ... KV tokens.

        Element ``i`` equals ``decode_ns(first_kv_tokens + i * step, step)`` (a decode run of ``step``
        requests: the batch grows by one token per request and pass).
        """
        values, _, i = self._cover(first_kv_tokens, step, count)
        return values[i : i + count]

    def decode_prefix_ns(self, first_kv_tokens: int, step: int, count: int) -> tuple[list[int], int]:
        """Prefix sums of ``decode_series_ns(first_kv_tokens, step, count)``: ``(sums, i)`` with ``sums[i + k] -
        sums[i]`` the time of its first ``k`` passes, ``k`` in ``0..count`` (do not mutate ``sums``).

        The time to any pass of a decode run in O(1), and the pass a time falls in by bisection, whatever
        the run's length: an engine finds its next visible event without a list per pass.
        """
        _, sums, i = self._cover(first_kv_tokens, step, count)
        return sums, i

    def _cover(self, first_kv_tokens: int, step: int, count: int) -> tuple[list[int], list[int], int]:
        """The kept run (durations, prefix sums) extended to hold the asked passes, and the first one's index.

        The last run is kept (up to ``_RUN_MAX`` passes) and extended: an engine asks for the same passes twice,
        once to find its next visible event and once to commit them, and each decode run continues the last.
        """
        run = self._run
        if run is not None and step == run[1] and step:
            i, r = divmod(first_kv_tokens - run[0], step)
            values = run[2]
            n = len(values)
            if not r and 0 <= i <= n:
                if i + count <= n:
                    return values, run[3], i
                if i + count <= _RUN_MAX:  # it continues the kept run
                    more = self._series(run[0] + n * step, step, i + count - n)
                    sums = run[3]
                    values += more
                    sums += accumulate(more, initial=sums[-1])
                    del sums[n + 1]  # (accumulate's first value repeats the last sum)
                    return values, sums, i
        out = self._series(first_kv_tokens, step, count)
        sums = list(accumulate(out, initial=0))
        self._run = (first_kv_tokens, step, out, sums) if step and count <= _RUN_MAX else None
        return out, sums, 0

    def _series(self, first_kv_tokens: int, step: int, count: int) -> list[int]:
        scale = self._decode_scale
        if not scale or count <= 0:
            return [0] * count
        total = self.total_kv_tokens
        fused = getattr(self.model, "decode_ns_series", None)
        if fused is not None:  # the model's own series, already scaled and rounded: nothing to check
            return fused(first_kv_tokens, step, count, total, scale)
        decode_ms = self.model.decode_ms  # (either form: _batch_aware says which; mypy cannot see it)
        if self._batch_aware:
            batch = step if step > 0 else 1
            out = [decode_ms(first_kv_tokens + i * step, total, batch) for i in range(count)]  # type: ignore[call-arg]
        else:
            out = [decode_ms(first_kv_tokens + i * step, total) for i in range(count)]  # type: ignore[call-arg]
        total_ms = sum(out)
        if not (total_ms >= 0 and total_ms != float("inf")) or min(out) < 0:  # a NaN, an inf or a negative
            for ms in out:
                _to_ns(ms, scale, "decode_ms")  # raises, naming the model's bad value
        return [round(ms * scale) for ms in out]

    def pass_ns(self, prefill_tokens: int, decodes: int, decode_kv_tokens: int) -> int:
        """Duration of a pass: prefill part (if any new tokens) + decode part (if any decodes)."""
        total = self.prefill_ns(prefill_tokens) if prefill_tokens else 0
        if decodes:
            total += self.decode_ns(decode_kv_tokens, decodes)
        return total

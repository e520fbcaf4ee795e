"""Clocks: integer nanoseconds, monotonic manual time, overflow rejection."""

import pytest

from kvemu.clock import MAX_TIME_NS, Clock, ManualClock, WallClock, check_deadline, ns_to_seconds, seconds_to_ns
from kvemu.errors import InvalidArgument


def test_manual_clock_moves_only_forward():
    c = ManualClock(start_ns=5)
    assert c.now_ns() == 5 and c.is_virtual
    assert c.advance(10) == 15
    assert c.advance_to(15) == 15
    with pytest.raises(InvalidArgument, match="before the current time 15"):
        c.advance_to(14)
    with pytest.raises(InvalidArgument, match="negative duration"):
        c.advance(-1)
    assert c.now_ns() == 15


def test_overflow_is_rejected_and_time_unchanged():
    c = ManualClock(start_ns=MAX_TIME_NS - 10)
    with pytest.raises(InvalidArgument, match="exceeds the clock maximum"):
        c.advance(11)
    with pytest.raises(InvalidArgument, match="exceeds the clock maximum"):
        c.advance_to(MAX_TIME_NS + 1)
    assert c.now_ns() == MAX_TIME_NS - 10
    assert c.advance(10) == MAX_TIME_NS
    with pytest.raises(InvalidArgument):
        check_deadline(MAX_TIME_NS, 1, "ttl")


def test_non_integer_time_is_rejected():
    with pytest.raises(InvalidArgument, match="start_ns"):
        ManualClock(start_ns=1.5)
    with pytest.raises(InvalidArgument, match="delta_ns must be an integer"):
        ManualClock().advance(0.5)


def test_conversions_round_to_nanoseconds():
    assert seconds_to_ns(1.5) == 1_500_000_000
    assert seconds_to_ns(120) == 120 * 10**9
    assert ns_to_seconds(2_500_000_000) == 2.5
    with pytest.raises(InvalidArgument):
        seconds_to_ns(float("nan"))
    with pytest.raises(InvalidArgument):
        seconds_to_ns(1e20)


def test_wall_clock_is_monotonic_and_both_satisfy_the_protocol():
    w = WallClock()
    a, b = w.now_ns(), w.now_ns()
    assert b >= a and not w.is_virtual
    assert isinstance(w, Clock) and isinstance(ManualClock(), Clock)


@pytest.mark.parametrize("seconds", [float("inf"), -float("inf"), 1.7976931348623157e308, 1e22])
def test_seconds_beyond_any_clock_are_invalid_not_an_overflow(seconds):
    """A float too large to round (or infinite) is the same typed refusal as one merely out of range."""
    with pytest.raises(InvalidArgument, match="outside the clock range") as e:
        seconds_to_ns(seconds)
    assert e.value.field == "seconds"

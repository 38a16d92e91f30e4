"""One clock, two readings: a test that moves the monotonic source moves wall time too."""

from __future__ import annotations

from impvm.api.times import DerivedClock, SystemClock, as_clock


def test_derived_clock_moves_wall_time_with_its_source() -> None:
    t = [100.0]
    clock = DerivedClock(lambda: t[0])
    start = clock.now()
    t[0] += 90.5
    assert clock.monotonic() == 190.5
    assert (clock.now() - start).total_seconds() == 90.5
    assert start.utcoffset() is not None


def test_as_clock_takes_a_clock_a_function_or_nothing() -> None:
    system = SystemClock()
    assert as_clock(system) is system
    assert isinstance(as_clock(None), SystemClock)
    assert isinstance(as_clock(lambda: 1.0), DerivedClock)

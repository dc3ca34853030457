"""Online rates and averages with a fake clock."""

from __future__ import annotations

import pytest

from gateway.rates import BusyClock, DecayingRate, Ewma


def test_rate_is_unknown_until_warm() -> None:
    rate = DecayingRate(10.0, min_events=3, warmup_s=1.0)
    assert rate.rate(0.0) is None
    rate.add(5, 0.0)
    rate.add(5, 0.1)
    rate.add(5, 0.2)
    assert rate.rate(0.5) is None  # enough events, not enough time
    assert rate.rate(1.0) is not None


@pytest.mark.parametrize("per_second", [1.0, 10.0, 250.0])
def test_steady_stream_converges_to_its_rate(per_second: float) -> None:
    rate = DecayingRate(5.0, min_events=1, warmup_s=0.0)
    # Events of 1 block each, evenly spaced, for 2 s (less than the horizon) and for 30 s.
    step = 1.0 / per_second
    t = 0.0
    while t < 2.0:
        rate.add(1.0, t)
        t += step
    assert rate.rate(t) == pytest.approx(per_second, rel=0.1)
    while t < 30.0:
        rate.add(1.0, t)
        t += step
    assert rate.rate(t) == pytest.approx(per_second, rel=0.1)


def test_rate_decays_when_nothing_happens() -> None:
    rate = DecayingRate(2.0, min_events=1, warmup_s=0.0)
    for i in range(20):
        rate.add(1.0, i * 0.1)
    busy = rate.rate(2.0)
    assert busy is not None
    quiet = rate.rate(12.0)
    assert quiet is not None
    assert quiet < busy / 50


def test_ewma() -> None:
    average = Ewma(0.5)
    assert average.value is None
    average.add(10.0)
    average.add(20.0)
    assert (average.value, average.count) == (15.0, 2)


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([(1.0, True), (2.0, True)], 2.0),
        ([(1.0, True), (5.0, False), (6.0, True)], 2.0),  # the idle 4 s do not count
        ([(1.0, False), (0.5, True)], 0.0),  # time never runs backwards
    ],
)
def test_busy_clock(steps: list[tuple[float, bool]], expected: float) -> None:
    clock = BusyClock(now=0.0)
    busy_s = 0.0
    for now, busy in steps:
        busy_s = clock.advance(now, busy)
    assert busy_s == expected

"""Online rates and averages with a fake clock."""

from __future__ import annotations

import pytest

from gateway.rates import BusyClock, DecayingRate, Ewma, WaitCalibration


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


def test_wait_calibration_learns_a_factor_per_size_class() -> None:
    calibration = WaitCalibration(min_samples=5)
    pool = 64
    # Unlearned: in-order predictions stand.
    assert calibration.factor(2, pool) == 1.0
    for _ in range(4):
        calibration.observe(2, pool, predicted_s=2.0, waited_s=0.4)  # small: a fifth
        calibration.observe(30, pool, predicted_s=3.0, waited_s=6.0)  # half the pool: double
    assert calibration.factor(2, pool) == 1.0  # four samples are not enough
    calibration.observe(2, pool, predicted_s=2.0, waited_s=0.4)
    calibration.observe(30, pool, predicted_s=3.0, waited_s=6.0)
    assert calibration.factor(2, pool) == pytest.approx(0.2)
    assert calibration.factor(4, pool) == pytest.approx(0.2)  # 1/16 of the pool: same class
    assert calibration.factor(30, pool) == pytest.approx(2.0)
    assert calibration.factor(6, pool) == 1.0  # a class nothing was learned for
    # The class follows the pool: 2 blocks of an 8-block pool is a quarter of it.
    assert calibration.factor(2, 8) == 1.0
    # A ratio of sums: a tiny prediction that waited long moves it only by its weight.
    calibration.observe(2, pool, predicted_s=0.001, waited_s=1.0)
    assert 0.2 < calibration.factor(2, pool) < 0.75
    assert [row["samples"] for row in calibration.factors()] == [6, 0, 0, 5]
    assert calibration.factors()[-1] == {"max_share_of_pool": None, "samples": 5, "factor": 2.0}


def test_wait_calibration_follows_change_and_stays_within_its_limits() -> None:
    calibration = WaitCalibration(min_samples=1, weight=0.2, limits=(0.5, 4.0))
    for _ in range(50):
        calibration.observe(1, 64, predicted_s=1.0, waited_s=10.0)
    assert calibration.factor(1, 64) == 4.0  # capped
    for _ in range(50):
        calibration.observe(1, 64, predicted_s=1.0, waited_s=1.0)
    assert calibration.factor(1, 64) == pytest.approx(1.0, rel=0.01)  # forgets the old waits
    for bounds in ((0.5, 0.25), (0.0, 0.5)):
        with pytest.raises(ValueError, match="bounds"):
            WaitCalibration(bounds)
    with pytest.raises(ValueError, match="weight"):
        WaitCalibration(weight=0.0)

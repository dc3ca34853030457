"""Online rates and averages with a fake clock."""

from __future__ import annotations

import pytest

from gateway.rates import BusyClock, DecayingRate, Ewma, VirtualBacklog, WaitCalibration


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


def test_a_backlog_within_the_deadline_is_a_burst_and_drains() -> None:
    backlog = VirtualBacklog()
    # 10 blocks/s; 50 blocks arrive at once: the last waits 5 s, inside a 10 s budget.
    assert not any(backlog.offer(10, 0.0, 10.0, 10.0) for _ in range(5))
    assert backlog.wait_s(0.0, 10.0) == pytest.approx(5.0)
    assert backlog.wait_s(2.0, 10.0) == pytest.approx(3.0)
    assert backlog.wait_s(9.0, 10.0) == 0.0


def test_sustained_overload_is_beyond_capacity_and_forgotten_after_a_deadline() -> None:
    backlog = VirtualBacklog(cap_factor=1.25)
    # Three times what drains (30 blocks/s offered, 10 freed): a plain queue passes a 4 s
    # deadline after 2 s, and stays past it while the load lasts.
    verdicts = [backlog.offer(3, i / 10, 10.0, 4.0) for i in range(100)]
    first_beyond = verdicts.index(True)
    assert 18 <= first_beyond <= 22
    assert all(verdicts[first_beyond:])
    # Capped at 1.25 deadlines' worth (plus the arrival): the memory of the overload is bounded...
    assert backlog.wait_s(9.9, 10.0) <= 1.25 * 4.0 + 0.3 + 1e-9
    # ... so once the load falls back to a burst's size, it is forgotten within seconds.
    assert backlog.offer(3, 20.0, 10.0, 4.0) is False


def test_a_share_of_the_deadline_turns_strict_sooner_and_keeps_the_memory() -> None:
    # The same 3x overload against a 4 s deadline: with share 0.5 the plain wait passes 2 s after
    # about 1 s instead of 2 s.
    half = VirtualBacklog(cap_factor=1.25, share=0.5)
    verdicts = [half.offer(3, i / 10, 10.0, 4.0) for i in range(100)]
    assert 8 <= verdicts.index(True) <= 12
    assert all(verdicts[verdicts.index(True) :])
    # The cap still follows the whole deadline, not the share.
    assert half.wait_s(9.9, 10.0) > 0.5 * 4.0 * 1.25
    # A burst worth 3 s of draining is beyond half of a 4 s budget, within the whole of it.
    whole, half = VirtualBacklog(), VirtualBacklog(share=0.5)
    assert [whole.offer(30, 0.0, 10.0, 4.0) for _ in range(1)] == [False]
    assert [half.offer(30, 0.0, 10.0, 4.0) for _ in range(1)] == [True]


def test_a_past_deadline_is_beyond_and_the_parameters_are_checked() -> None:
    assert VirtualBacklog().offer(1, 0.0, 10.0, 0.0) is True
    with pytest.raises(ValueError, match="at least 1"):
        VirtualBacklog(cap_factor=0.5)
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            VirtualBacklog(share=share)


def test_the_load_factor_projects_the_wait_and_turns_strict_sooner() -> None:
    # 10 blocks/s drain, a 10 s deadline. Three times that offered (30 blocks/s): a plain
    # queue passes the deadline after about 5 s. Looking ahead over 1 s, the load factor of
    # about 3 projects the same after under 2 s, once the load is measured.
    plain, ahead = VirtualBacklog(), VirtualBacklog(arrival_horizon_s=1.0)
    plain_verdicts = [plain.offer(3, i / 10, 10.0, 10.0) for i in range(100)]
    ahead_verdicts = [ahead.offer(3, i / 10, 10.0, 10.0) for i in range(100)]
    assert 48 <= plain_verdicts.index(True) <= 52
    assert 11 <= ahead_verdicts.index(True) <= 20
    assert all(ahead_verdicts[ahead_verdicts.index(True) :])
    assert ahead.load(10.0, 10.0) == pytest.approx(3.0, rel=0.1)


def test_a_load_the_backend_keeps_up_with_is_judged_by_the_plain_wait() -> None:
    # A 6 s backlog arrives at once, then a load at the drain rate (10 blocks/s each way): the
    # backlog neither grows nor shrinks, so its wait stays within the 10 s deadline. The burst
    # itself counts as a load of six for about a horizon (it may be the start of an overload);
    # after a few horizons only the steady load counts, and nothing is beyond.
    backlog = VirtualBacklog(arrival_horizon_s=1.0)
    backlog.offer(60, 0.0, 10.0, 10.0)
    verdicts = [backlog.offer(1, i / 10, 10.0, 10.0) for i in range(1, 100)]
    assert any(verdicts[:20])
    assert not any(verdicts[30:])
    assert backlog.load(9.9, 10.0) == pytest.approx(1.0, rel=0.15)
    # A falling load never makes it laxer than the plain wait: past the deadline is beyond.
    assert backlog.offer(100, 10.0, 10.0, 10.0) is True
    # Without look ahead the load is not measured at all.
    assert VirtualBacklog().load(0.0, 10.0) == 0.0
    with pytest.raises(ValueError, match="arrival_horizon_s"):
        VirtualBacklog(arrival_horizon_s=-1.0)


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

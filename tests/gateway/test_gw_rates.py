"""Online rates and averages with a fake clock."""

from __future__ import annotations

import pytest

from gateway.rates import BusyClock, DecayingRate, Ewma, VirtualBacklog


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

"""The event-loop lag probe (`gateway.loop_lag`): its accounting, table-driven, and the probe
on a real loop that the test holds with CPU work of its own, through to `/metrics` and
`/admin/state`. No timing is asserted beyond what holding the loop guarantees on any machine:
a hold of H seconds of the loop thread's CPU makes a tick at least H - interval late."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
from conftest import gateway_over_sim, wait_until

from gateway.loop_lag import LagRecorder, LoopLagProbe, Stall

HOLD_CPU_S = 0.3
INTERVAL_S = 0.05


def stall(
    at_s: float = 0.0,
    lag_s: float = 0.1,
    loop_cpu_s: float = 0.0,
    other_cpu_s: float = 0.0,
    runqueue_s: float | None = None,
    gc_s: float = 0.0,
) -> Stall:
    return Stall(
        at_s=at_s,
        lag_s=lag_s,
        span_s=0.05 + lag_s,
        loop_cpu_s=loop_cpu_s,
        other_cpu_s=other_cpu_s,
        runqueue_s=runqueue_s,
        gc_s=gc_s,
    )


@pytest.mark.parametrize(
    ("loop_cpu_s", "runqueue_s", "other_cpu_s", "cause"),
    [
        (0.1, 0.0, 0.0, "loop"),  # the loop's thread ran through the lag
        (0.05, 0.05, 0.0, "loop"),  # half of it is enough, and the loop's own work comes first
        (0.01, 0.09, 0.0, "scheduling"),  # runnable, waiting for a CPU
        (0.01, 0.09, 0.09, "scheduling"),  # ... even while another thread ran
        (0.01, 0.0, 0.09, "threads"),  # a tokenizer thread ran (and held the interpreter)
        (0.01, 0.01, 0.01, "blocked"),  # asleep, not runnable: a lock, a page
        (0.01, None, 0.01, "scheduling"),  # no run-queue reading: off a CPU, nobody ran
        (0.0, None, 0.09, "threads"),
    ],
)
def test_the_cause_is_where_the_time_of_the_lag_went(
    loop_cpu_s: float, runqueue_s: float | None, other_cpu_s: float, cause: str
) -> None:
    lag = stall(lag_s=0.1, loop_cpu_s=loop_cpu_s, other_cpu_s=other_cpu_s, runqueue_s=runqueue_s)
    assert lag.cause() == cause


def test_a_lag_mostly_spent_collecting_garbage_is_the_collector_s() -> None:
    assert stall(lag_s=0.1, loop_cpu_s=0.1, gc_s=0.06).cause() == "gc"
    assert stall(lag_s=0.1, loop_cpu_s=0.1, gc_s=0.01).cause() == "loop"


def test_the_recorder_counts_every_tick_and_keeps_only_stalls() -> None:
    recorder = LagRecorder(warn_s=0.05, log_every_s=10.0, keep=2)
    for lag in (0.001, 0.2, 0.01, 0.07, 0.049, 0.05):
        recorder.record(stall(lag_s=lag))
    summary = recorder.summary()
    assert summary.ticks == 6
    assert summary.worst_lag_s == 0.2
    assert summary.stalls == 3
    assert [s.lag_s for s in summary.recent_stalls] == [0.07, 0.05]  # the latest `keep`
    assert summary.to_json()["recent_stalls"][0]["cause"] == "scheduling"


def test_the_recorder_logs_the_first_stall_then_one_per_period_with_the_count_between() -> None:
    recorder = LagRecorder(warn_s=0.05, log_every_s=10.0)
    assert recorder.record(stall(at_s=100.0, lag_s=0.01)) is None  # not a stall
    first = recorder.record(stall(at_s=100.0))
    assert first is not None
    assert first[1] == 0
    assert recorder.record(stall(at_s=101.0)) is None
    assert recorder.record(stall(at_s=109.9)) is None
    later = recorder.record(stall(at_s=110.0, lag_s=0.3))
    assert later is not None
    assert later[0].lag_s == 0.3
    assert later[1] == 2  # the two in between, unlogged
    assert recorder.record(stall(at_s=111.0)) is None


def test_the_probe_refuses_an_interval_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagProbe(lambda lag: None, interval_s=0.0)


def hold_the_loop(cpu_s: float) -> None:
    """Run on the loop's thread for `cpu_s` seconds of its CPU time, as a long parse would."""
    started = time.thread_time()
    while time.thread_time() - started < cpu_s:
        pass


async def test_a_held_loop_is_measured_as_its_own_work_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    lags: list[float] = []
    probe = LoopLagProbe(lags.append, interval_s=INTERVAL_S)
    task = asyncio.create_task(probe.run())
    try:
        await wait_until(lambda: probe.recorder.summary().ticks >= 1, what="a first tick")
        ticks = probe.recorder.summary().ticks
        with caplog.at_level(logging.WARNING, logger="gateway.loop_lag"):
            hold_the_loop(HOLD_CPU_S)
            gc.collect()  # timed by the probe's collector callback
            await wait_until(lambda: probe.recorder.summary().ticks > ticks, what="the tick after the hold")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    summary = probe.recorder.summary()
    held = max(summary.recent_stalls, key=lambda s: s.lag_s)
    assert held.lag_s >= HOLD_CPU_S - INTERVAL_S
    assert held.loop_cpu_s >= HOLD_CPU_S  # the hold ran inside the tick that measured it
    assert held.runqueue_s is not None  # Linux says how long the thread waited for a CPU
    assert held.gc_s > 0.0
    assert summary.worst_lag_s == held.lag_s
    assert max(lags) == held.lag_s  # every tick is observed
    assert any("the event loop ran" in record.getMessage() for record in caplog.records)


async def test_the_app_exposes_the_lag_in_metrics_and_admin_state() -> None:
    async with gateway_over_sim() as harness:
        probe: LoopLagProbe = harness.app.state.loop_lag
        await wait_until(lambda: probe.recorder.summary().ticks >= 1, what="a first tick")
        hold_the_loop(HOLD_CPU_S)
        await wait_until(lambda: probe.recorder.summary().stalls >= 1, what="the hold to be seen")
        metrics = (await harness.client.get("/metrics")).text
        state = (await harness.client.get("/admin/state")).json()["event_loop"]
    count = next(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvgate_event_loop_lag_seconds_count ")
    )
    assert count >= 2
    over_100_ms = next(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('kvgate_event_loop_lag_seconds_bucket{le="0.1"}')
    )
    assert over_100_ms < count  # the hold is counted above 100 ms
    assert state["stalls"] >= 1
    assert state["worst_lag_s"] >= HOLD_CPU_S - INTERVAL_S
    fields = {"at_s", "lag_s", "span_s", "loop_cpu_s", "other_cpu_s", "runqueue_s", "gc_s", "cause"}
    assert fields <= set(state["recent_stalls"][0])

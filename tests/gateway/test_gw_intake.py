"""Large bodies read at a bounded pace (gateway.intake, gateway.body_pace): the pace itself with time injected, and
in a gateway, large bodies waiting their turn while small requests pass."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import gateway_over_sim, wait_until

from gateway.body_pace import IntakePace
from gateway.intake import BodyIntake

MIB = 1024 * 1024


def test_a_burst_passes_at_once_and_the_bytes_past_it_at_the_pace() -> None:
    pace = IntakePace(bytes_per_s=MIB, burst_bytes=2 * MIB)
    assert pace.book(2 * MIB, now=0.0) == 0.0
    assert pace.book(MIB // 2, now=0.0) == pytest.approx(0.5)
    assert pace.book(MIB // 2, now=0.0) == pytest.approx(1.0)  # behind the bookings before it


def test_a_quiet_moment_gives_the_burst_back_and_no_more() -> None:
    pace = IntakePace(bytes_per_s=MIB, burst_bytes=MIB)
    assert pace.book(3 * MIB, now=0.0) == pytest.approx(2.0)
    assert pace.book(MIB, now=3.0) == 0.0  # all read by then: a whole burst again
    assert pace.book(MIB, now=100.0) == 0.0
    assert pace.book(MIB, now=100.0) == pytest.approx(1.0)  # a long quiet moment saves no more


def test_the_pace_refuses_what_makes_no_sense() -> None:
    with pytest.raises(ValueError, match="positive"):
        IntakePace(bytes_per_s=0, burst_bytes=MIB)
    with pytest.raises(ValueError, match="negative"):
        IntakePace(bytes_per_s=MIB, burst_bytes=-1)


async def test_bytes_within_the_free_part_never_wait_and_unpaced_never_waits() -> None:
    now = [0.0]
    intake = BodyIntake(bytes_per_s=1024, burst_bytes=0, free_bytes=64 * 1024, clock=lambda: now[0])
    await asyncio.wait_for(intake.received(0, 64 * 1024), 1.0)
    assert intake.waited_s == 0.0
    unpaced = BodyIntake(bytes_per_s=0, burst_bytes=0, free_bytes=0)
    await asyncio.wait_for(unpaced.received(0, 100 * MIB), 1.0)
    assert unpaced.waited_s == 0.0


async def test_each_byte_is_booked_once_however_the_chunks_fall() -> None:
    now = [0.0]
    intake = BodyIntake(bytes_per_s=1e12, burst_bytes=0, free_bytes=1000, clock=lambda: now[0])
    pace = intake._pace
    assert pace is not None
    before = 0
    for total in (500, 1500, 1500, 4000):
        await intake.received(before, total)
        before = total
    # 3,000 bytes past the free ones booked in all: the next byte waits behind exactly those.
    assert pace.book(0, now=0.0) == pytest.approx(3000 / 1e12)


async def test_large_bodies_wait_for_their_pace_while_small_requests_pass() -> None:
    small = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4}
    large = json.dumps({**small, "user": "u" * 120_000}).encode()  # 53 KiB past the free part
    past_the_burst = 3 * (len(large) - 64 * 1024) - 128 * 1024
    async with gateway_over_sim(max_body_bytes=128 * 1024, large_body_bytes_per_s=16 * 1024) as harness:
        intake: BodyIntake = harness.app.state.body_intake

        async def send_large() -> int:
            answer = await harness.client.post(
                "/v1/completions", content=large, headers={"content-type": "application/json"}
            )
            return answer.status_code

        # The burst (128 KiB, max_body_bytes) takes two bodies' bytes past the free part; the
        # third waits for the rest, at 16 KiB/s (2 s).
        larges = [asyncio.create_task(send_large()) for _ in range(3)]
        await wait_until(lambda: intake.waiting >= 1, 10.0, "a large body to wait for its pace")
        answer = await harness.client.post("/v1/completions", json=small)
        assert answer.status_code == 200
        assert intake.waiting >= 1, "the small request should not have waited behind the large bodies"
        assert await asyncio.gather(*larges) == [200, 200, 200]
        state = (await harness.client.get("/admin/state")).json()
        assert state["body_intake"]["waiting"] == 0
        assert state["body_intake"]["waited_s"] == round(intake.waited_s, 3)
    # Less only by the time between the three bookings.
    assert intake.waited_s >= past_the_burst / (16 * 1024) - 0.5

"""The shared reading's text form and a follower's choice (gateway.shared_reading, pure)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.budget import parse_metrics_text
from gateway.shared_reading import (
    AskAgain,
    Follow,
    Published,
    ScrapeYourself,
    decode_reading,
    encode_reading,
    follower_step,
)
from gateway.vllm_metrics import MAX_BLOCK_SIZE_TOKENS, BackendReading, MetricsFormatError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
READING = BackendReading(
    total_blocks=63,
    block_size=16,
    used_blocks=12.5,
    running=3,
    waiting=1,
    preemptions_total=2.0,
    engines=1,
    prefix_caching=True,
    engine_steps_total=1234.0,
    digest=987654.0,
    output_length_buckets=((16.0, 3.0), (64.0, 7.0), (math.inf, 9.0)),
    waiting_for_capacity=0,
)

counts = st.integers(min_value=0, max_value=1 << 40)
maybe_number = st.none() | st.floats(min_value=0, max_value=1e15, allow_nan=False)


@st.composite
def readings(draw: st.DrawFn) -> BackendReading:
    total = draw(st.integers(min_value=1, max_value=1 << 40))
    bounds = sorted(set(draw(st.lists(st.floats(min_value=0, max_value=1e9), max_size=8))))
    cumulative = sorted(
        draw(
            st.lists(
                st.floats(min_value=0, max_value=1e12), min_size=len(bounds) + 1, max_size=len(bounds) + 1
            )
        )
    )
    buckets = tuple(zip([*bounds, math.inf], cumulative, strict=True)) if draw(st.booleans()) else ()
    return BackendReading(
        total_blocks=total,
        block_size=draw(st.integers(min_value=1, max_value=MAX_BLOCK_SIZE_TOKENS)),
        used_blocks=draw(st.floats(min_value=0, max_value=float(total))),
        running=draw(counts),
        waiting=draw(counts),
        preemptions_total=draw(maybe_number),
        engines=draw(st.integers(min_value=1, max_value=64)),
        prefix_caching=draw(st.none() | st.booleans()),
        engine_steps_total=draw(maybe_number),
        digest=draw(maybe_number),
        output_length_buckets=buckets,
        waiting_for_capacity=draw(st.none() | counts),
    )


@given(readings())
def test_every_reading_comes_back_as_it_was_published(reading: BackendReading) -> None:
    assert decode_reading(encode_reading(reading)) == reading


@pytest.mark.parametrize("name", ["metrics_0.32.0.txt", "metrics_0.32.0_busy.txt"])
def test_a_reading_of_vllms_own_metrics_comes_back_whole(name: str) -> None:
    reading = parse_metrics_text((FIXTURES / name).read_text())
    assert reading.output_length_buckets  # the histogram's +Inf bucket goes through the text too
    assert decode_reading(encode_reading(reading)) == reading


def _damaged(**changes: object) -> str:
    data = json.loads(encode_reading(READING))
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nonsense",
        "[]",
        "{}",
        _damaged(v=2),
        _damaged(total_blocks=0),
        _damaged(total_blocks=-3),
        _damaged(total_blocks=1.5),
        _damaged(total_blocks=True),
        _damaged(total_blocks="63"),
        _damaged(used_blocks=64),  # more than the pool
        _damaged(used_blocks=None),
        _damaged(used_blocks=-1),
        _damaged(block_size=0),
        _damaged(block_size=MAX_BLOCK_SIZE_TOKENS + 1),
        _damaged(engines=0),
        _damaged(running=-1),
        _damaged(prefix_caching="yes"),
        _damaged(preemptions_total=1e300),
        _damaged(output_length_buckets="none"),
        _damaged(output_length_buckets=[[16, 3], [8, 4], ["+Inf", 5]]),  # bounds not increasing
        _damaged(output_length_buckets=[[16, 3], [64, 2], ["+Inf", 5]]),  # counts not cumulative
        _damaged(output_length_buckets=[[16, 3], [64, 7]]),  # no +Inf bucket
        _damaged(output_length_buckets=[["+Inf", 3], [64, 7]]),
        _damaged(output_length_buckets=[[16, 3, 1], ["+Inf", 7]]),
        encode_reading(READING).replace("12.5", "NaN"),
        encode_reading(READING).replace("12.5", "Infinity"),
        "[" * 100_000,
        " " * 70_000 + encode_reading(READING),
    ],
)
def test_a_damaged_or_foreign_reading_is_refused(text: str) -> None:
    with pytest.raises(MetricsFormatError):
        decode_reading(text)


def published(
    age_s: float = 0.05, stamp: str = "1000-7", took_s: float = 0.01, text: str | None = None
) -> Published:
    return Published(
        stamp=stamp, age_s=age_s, took_s=took_s, text=encode_reading(READING) if text is None else text
    )


def step(p: Published | None, last_stamp: str | None = None, asked_at: float = 100.0) -> object:
    return follower_step(p, last_stamp=last_stamp, asked_at=asked_at, interval_s=0.2, max_age_s=0.5)


def test_a_new_reading_is_followed_and_placed_at_its_age_before_the_question() -> None:
    got = step(published(age_s=0.08, took_s=0.03), asked_at=100.0)
    assert isinstance(got, Follow)
    assert got.reading == READING
    assert got.finished_at == pytest.approx(99.92)
    assert got.started_at == pytest.approx(99.89)


def test_a_clock_that_disagrees_by_a_little_never_places_a_reading_after_the_question() -> None:
    got = step(published(age_s=-0.004), asked_at=100.0)  # the server's TIME went back a little
    assert isinstance(got, Follow)
    assert got.finished_at <= 100.0


def test_the_reading_already_followed_means_ask_again_when_the_next_is_due() -> None:
    got = step(published(age_s=0.05), last_stamp="1000-7")
    assert isinstance(got, AskAgain)
    assert got.pause_s == pytest.approx(0.17)  # 0.2 - 0.05 + a tenth of the interval
    for age in (0.0, 0.19, 0.3, 0.49):
        again = step(published(age_s=age), last_stamp="1000-7")
        assert isinstance(again, AskAgain)
        assert 0.02 - 1e-9 <= again.pause_s <= 0.2


@pytest.mark.parametrize(
    "shared",
    [
        None,
        published(age_s=0.51),  # the holder is slow, stuck or gone
        published(age_s=math.inf),
        published(took_s=math.nan),
        published(took_s=-1.0),
        published(text="not a reading"),
        published(text=_damaged(v=0)),
    ],
)
def test_without_a_usable_reading_the_follower_reads_the_backend_itself(shared: Published | None) -> None:
    assert isinstance(step(shared), ScrapeYourself)


def test_an_old_reading_is_not_followed_even_if_new() -> None:
    assert isinstance(step(replace(published(), age_s=0.6), last_stamp="other"), ScrapeYourself)

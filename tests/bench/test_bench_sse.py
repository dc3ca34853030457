"""The event-stream splitter: whole events' data, however the bytes are cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.sse import EventDataDecoder

STREAM = (
    b": a comment\n"
    b'data: {"a": 1}\n\n'
    b"event: ping\nid: 7\nretry: 10\n\n"  # no data: nothing to dispatch
    b"data:no space\r\n\r\n"
    b"data: line one\rdata: line two\r\r"
    b"data\n\n"  # a bare field name is an empty value; an event with empty data still counts
    b"data: [DONE]\n\n"
)
EVENTS = ['{"a": 1}', "no space", "line one\nline two", "", "[DONE]"]


def test_whole_stream() -> None:
    assert EventDataDecoder().feed(STREAM) == EVENTS


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_cut_gives_the_same_events(cuts: list[int]) -> None:
    decoder = EventDataDecoder()
    bounds = [0, *sorted(cuts), len(STREAM)]
    events = [e for lo, hi in itertools.pairwise(bounds) for e in decoder.feed(STREAM[lo:hi])]
    assert events == EVENTS


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        # an event is complete only at its blank line
        ([b"data: x\n"], []),
        ([b"data: x\n", b"\n"], ["x"]),
        # CR then LF in the next chunk is one line end, not an empty line
        ([b"data: x\r", b"\ndata: y\r\n\r\n"], ["x\ny"]),
        ([b"data: caf\xc3", b"\xa9\n\n"], ["caf\u00e9"]),
    ],
)
def test_events_across_chunks(chunks: list[bytes], expected: list[str]) -> None:
    decoder = EventDataDecoder()
    assert [e for chunk in chunks for e in decoder.feed(chunk)] == expected

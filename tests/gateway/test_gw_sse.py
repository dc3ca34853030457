"""Token counting on relayed bytes: however the stream is chunked, the counts are the same."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sse import StreamTally, Usage, body_usage


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


CHAT_STREAM = b"".join(
    [
        event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        event({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        event({"choices": [{"index": 0, "delta": {"content": "lo"}}]}),
        event({"choices": [{"index": 1, "delta": {"content": "Hi"}}]}),
        event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}),
        event("[DONE]"),
    ]
)


def test_counts_chat_deltas_per_choice_and_reads_usage() -> None:
    tally = StreamTally()
    growth = tally.feed(CHAT_STREAM)
    assert growth == [(0, 1), (0, 1), (1, 1)]
    assert tally.tokens_by_choice == {0: 2, 1: 1}
    assert tally.usage == Usage(9, 3)
    assert tally.done
    assert not tally.error


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        ({"choices": [{"index": 0, "text": " the"}]}, 1),  # completions stream
        ({"choices": [{"index": 0, "text": ""}]}, 0),
        ({"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}, 2),
        ({"choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": {"content": [{}, {}, {}]}}]}, 3),
        ({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}, 1),
        ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}, 1),
        ({"choices": ["junk", {"index": "x", "text": "a"}]}, 1),
    ],
)
def test_tokens_per_event(chunk: dict[str, Any], expected: int) -> None:
    tally = StreamTally()
    tally.feed(event(chunk))
    assert tally.counted_tokens == expected


def test_crlf_separators_comments_and_garbage_are_tolerated() -> None:
    tally = StreamTally()
    tally.feed(b": keep-alive\r\n\r\ndata: not json\r\n\r\ndata: [1, 2]\n\n")
    tally.feed(b'data: {"choices":[{"index":0,"text":"x"}]}\r\n\r\n')
    assert tally.counted_tokens == 1


def test_error_events_are_noticed() -> None:
    tally = StreamTally()
    tally.feed(event({"error": {"message": "boom"}}))
    assert tally.error


@given(st.lists(st.integers(1, len(CHAT_STREAM)), max_size=30))
def test_any_chunking_gives_the_same_counts(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [CHAT_STREAM[a:b] for a, b in zip([0, *points], [*points, len(CHAT_STREAM)], strict=True)]
    tally = StreamTally()
    for piece in pieces:
        tally.feed(piece)
    assert tally.tokens_by_choice == {0: 2, 1: 1}
    assert tally.usage == Usage(9, 3)


def test_body_usage() -> None:
    body = json.dumps({"choices": [{}, {}], "usage": {"prompt_tokens": 4, "completion_tokens": 10}}).encode()
    assert body_usage(body) == (Usage(4, 10), 2)
    assert body_usage(b"{oops") == (None, 0)
    assert body_usage(b"[]") == (None, 0)

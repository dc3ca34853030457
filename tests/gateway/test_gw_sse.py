"""Token counting on relayed bytes: however the stream is chunked, the counts are the same."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sse import MAX_CHOICE_INDEX, MAX_USAGE_TOKENS, USAGE_CAPTURE_BYTES, BodyUsage, StreamTally, Usage


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


CHAT_STREAM = b"".join(
    [
        event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        event({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        event({"choices": [{"index": 0, "delta": {"content": "lo"}}]}),
        event({"choices": [{"index": 1, "delta": {"content": "Hi"}}]}),
        # As vLLM ends a choice with its end-of-sequence token: no text, finish_reason "stop".
        event({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]}),
        event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}),
        event("[DONE]"),
    ]
)


def test_counts_chat_deltas_per_choice_and_reads_usage() -> None:
    tally = StreamTally()
    growth = tally.feed(CHAT_STREAM)
    assert growth == [(0, 1), (0, 1), (1, 1), (0, 1)]
    assert tally.tokens_by_choice == {0: 3, 1: 1}
    assert tally.usage == Usage(9, 4)
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
    assert tally.tokens_by_choice == {0: 3, 1: 1}
    assert tally.usage == Usage(9, 4)


def body_usage(body: bytes, cuts: list[int] | None = None) -> Usage | None:
    """BodyUsage over `body` cut at `cuts` (sorted byte offsets)."""
    scanner = BodyUsage()
    points = [0, *sorted(set(cuts or [])), len(body)]
    for start, end in itertools.pairwise(points):
        scanner.feed(body[start:end])
    return scanner.result()


COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": 'say "usage": {"completion_tokens": 99} and "usage"'}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 10, "prompt_tokens_details": None},
    }
).encode()


def test_body_usage_is_the_usage_object_of_the_answer() -> None:
    assert body_usage(COMPLETION) == Usage(4, 10)
    # Compact JSON, as vLLM writes it; and chat's prompt_logprobs after the usage, with a token
    # that reads "usage".
    chat = {
        "choices": [{"index": 0, "message": {"content": "usage"}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
        "prompt_logprobs": [None, {"1": {"logprob": -1.0, "decoded_token": "usage"}}] * 1000,
    }
    assert body_usage(json.dumps(chat, separators=(",", ":")).encode()) == Usage(7, 3)
    assert body_usage(b'{"choices": []}') is None
    assert body_usage(b"{oops") is None


@given(st.lists(st.integers(1, len(COMPLETION) - 1), max_size=20))
def test_body_usage_under_any_chunking(cuts: list[int]) -> None:
    assert body_usage(COMPLETION, cuts) == Usage(4, 10)


def test_body_usage_keeps_a_bounded_capture() -> None:
    scanner = BodyUsage()
    scanner.feed(b'{"choices": [], "usage": {"prompt_tokens": 1, "padding": "')
    for _ in range(100):
        scanner.feed(b"x" * 65536)
    assert len(scanner._capture or b"") <= USAGE_CAPTURE_BYTES
    result = scanner.result()
    assert result is not None
    assert result.invalid == "usage does not parse as JSON"


@pytest.mark.parametrize(
    ("usage", "problem"),
    [
        ({"prompt_tokens": 3, "completion_tokens": -1}, "completion_tokens is -1"),
        ({"prompt_tokens": True, "completion_tokens": 2}, "prompt_tokens is true"),
        ({"prompt_tokens": 3, "completion_tokens": 2.0}, "completion_tokens is 2.0"),
        ({"prompt_tokens": 3, "completion_tokens": "2"}, 'completion_tokens is "2"'),
        (
            {"prompt_tokens": 3, "completion_tokens": MAX_USAGE_TOKENS},
            f"completion_tokens is {MAX_USAGE_TOKENS}",
        ),
        ({"prompt_tokens": 10**400, "completion_tokens": 1}, "prompt_tokens is 1000000000000000000"),
    ],
)
def test_usage_that_is_no_count_is_invalid(usage: Any, problem: str) -> None:
    for found in (
        body_usage(json.dumps({"choices": [], "usage": usage}).encode()),
        _streamed_usage(usage),
    ):
        assert found is not None
        assert (found.prompt_tokens, found.completion_tokens) == (None, None)
        assert found.invalid is not None
        assert found.invalid.startswith(problem)


def test_usage_that_is_no_object() -> None:
    found = _streamed_usage([1, 2])
    assert found == Usage(None, None, "usage is list, not an object")
    assert body_usage(b'{"usage": [1, 2]}') == found
    assert body_usage(b'{"usage": null}') is None


def _streamed_usage(usage: Any) -> Usage | None:
    tally = StreamTally()
    tally.feed(event({"choices": [], "usage": usage}))
    return tally.usage


def test_absent_counts_are_not_invalid() -> None:
    assert body_usage(b'{"usage": {"prompt_tokens": 3}}') == Usage(3, None)
    assert body_usage(b'{"usage": {"completion_tokens": null}}') == Usage(None, None)


def test_invented_choice_indices_do_not_grow_the_tally() -> None:
    tally = StreamTally()
    for index in (10**9, -5, True, 2**70):
        tally.feed(event({"choices": [{"index": index, "text": "a"}]}))
    assert tally.tokens_by_choice == {MAX_CHOICE_INDEX: 2, 0: 2}


def test_a_deeply_nested_event_is_skipped_not_raised() -> None:
    # A hostile backend: one event nested far past the parser's recursion limit, within the
    # event size bound. It is no count (skipped); the events around it still count.
    nested = b"data: " + b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}\n\n"
    tally = StreamTally()
    text = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
    growth = tally.feed(text + nested + text)
    assert sum(tokens for _, tokens in growth) == 2

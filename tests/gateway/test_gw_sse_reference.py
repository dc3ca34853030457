"""StreamTally counts exactly as its plain first version did, whatever the stream and its chunking.

The relay's tally was made cheaper per event (no copy of the pending buffer for whole events,
json's scanner without json.loads's layers, type checks for JSON's own types); the plain
version it replaced is kept here as the reference, and both read the same streams: well-formed
events of every shape the counter looks at, CRLF and LF separators, comments, several data
lines, garbage, JSON that is no object, invalid UTF-8, events past the size bound.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import sse
from gateway.sse import MAX_CHOICE_INDEX, StreamTally, Usage, usage_of


class ReferenceTally:
    """gateway.sse.StreamTally as first written (reading MAX_EVENT_BYTES from gateway.sse)."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._skipping = False
        self.tokens_by_choice: dict[int, int] = {}
        self.usage: Usage | None = None
        self.done = False
        self.error = False

    def feed(self, chunk: bytes) -> list[tuple[int, int]]:
        growth: list[tuple[int, int]] = []
        self._pending += chunk
        while True:
            end, separator = _event_end(self._pending)
            if end < 0:
                if len(self._pending) > sse.MAX_EVENT_BYTES:
                    self._pending.clear()
                    self._skipping = True
                return growth
            event = bytes(self._pending[:end])
            del self._pending[: end + separator]
            if self._skipping:
                self._skipping = False
                continue
            self._event(event, growth)

    def _event(self, event: bytes, growth: list[tuple[int, int]]) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                payload = json.loads(data)
            except ValueError:
                continue
            if not isinstance(payload, Mapping):
                continue
            if "error" in payload:
                self.error = True
            usage = usage_of(payload.get("usage"))
            if usage is not None:
                self.usage = usage
            choices = payload.get("choices")
            if not isinstance(choices, list):
                continue
            for choice in choices:
                if not isinstance(choice, Mapping):
                    continue
                tokens = _choice_tokens(choice)
                if tokens:
                    index = choice.get("index", 0)
                    index = min(max(index, 0), MAX_CHOICE_INDEX) if type(index) is int else 0
                    self.tokens_by_choice[index] = self.tokens_by_choice.get(index, 0) + tokens
                    growth.append((index, tokens))


def _choice_tokens(choice: Mapping[str, Any]) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, Mapping):
        content = logprobs.get("content")
        if isinstance(content, list):
            return len(content)
        tokens = logprobs.get("tokens")
        if isinstance(tokens, list):
            return len(tokens)
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                return 1
        if delta.get("tool_calls"):
            return 1
    elif choice.get("text"):
        return 1
    finish = choice.get("finish_reason")
    return 1 if isinstance(finish, str) and finish else 0


def _event_end(buffer: bytearray) -> tuple[int, int]:
    lf = buffer.find(b"\n\n")
    crlf = buffer.find(b"\r\n\r\n")
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return crlf, 4
    return (lf, 2) if lf >= 0 else (-1, 0)


# -- streams ------------------------------------------------------------------------------------

_texts = st.sampled_from(["", " the", "é", '"', "\\n", "\n", "a\r\nb", "\ud800"])
_values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**70, 1.5, "x", "", [], {}]), _texts
)
_logprobs = st.one_of(
    _values,
    st.fixed_dictionaries({}, optional={"content": st.one_of(_values, st.lists(st.just({}), max_size=3))}),
    st.fixed_dictionaries({}, optional={"tokens": st.one_of(_values, st.lists(st.just("t"), max_size=3))}),
)
_delta = st.fixed_dictionaries(
    {},
    optional={
        "role": st.just("assistant"),
        "content": _values,
        "reasoning_content": _values,
        "reasoning": _values,
        "tool_calls": st.one_of(_values, st.just([{"index": 0}])),
    },
)
_choice = st.one_of(
    _values,
    st.fixed_dictionaries(
        {},
        optional={
            "index": st.one_of(_values, st.integers(-2, MAX_CHOICE_INDEX + 2)),
            "text": _values,
            "delta": st.one_of(_delta, _values),
            "logprobs": _logprobs,
            "finish_reason": st.one_of(_values, st.sampled_from(["stop", "length"])),
        },
    ),
)
_usage = st.one_of(
    _values,
    st.fixed_dictionaries(
        {}, optional={"prompt_tokens": _values, "completion_tokens": _values, "total_tokens": _values}
    ),
)
_payload = st.fixed_dictionaries(
    {},
    optional={
        "id": st.just("cmpl-1"),
        "choices": st.one_of(st.lists(_choice, max_size=3), _values),
        "usage": _usage,
        "error": st.just({"message": "boom"}),
    },
)


def _encoded(payload: Any, style: str) -> bytes:
    if style == "compact":
        return json.dumps(payload, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if style == "spaced":
        return b" " + json.dumps(payload, indent=None).encode("utf-8", "surrogatepass") + b" \t"
    if style == "ascii":
        return json.dumps(payload, ensure_ascii=True).encode()
    if style == "duplicate":  # a later key wins in JSON as json.loads reads it
        text = json.dumps(payload, separators=(",", ":"))
        return (text[:-1] + ',"choices":[{"text":"dup"}]}' if len(text) > 2 else text).encode()
    return re.sub(rb"\}$", b"} x", json.dumps(payload).encode())  # extra data after the object


_STYLES = st.sampled_from(["compact", "spaced", "ascii", "duplicate", "extra"])
_line = st.one_of(
    st.builds(lambda p, s: b"data: " + _encoded(p, s), _payload, _STYLES),
    st.sampled_from(
        [
            b"data: [DONE]",
            b"data:[DONE]",
            b": keep-alive",
            b"event: message",
            b"data: not json",
            b"data: [1, 2]",
            b'data: "text"',
            b"data: {",
            b'data: {"choices": [{"text": "\xff"}]}',
            b'data: \xef\xbb\xbf{"choices": [{"text": "bom"}]}',
            b'data: {"choices": [{"text": "a"}]} {"choices": []}',
            b"data:",
            b"",
            # Each thing a token is counted from, alone.
            b'data: {"choices":[{"index":1,"delta":{"content":"c"}}]}',
            b'data: {"choices":[{"index":1,"delta":{"reasoning_content":"r"}}]}',
            b'data: {"choices":[{"index":1,"delta":{"reasoning":"r"}}]}',
            b'data: {"choices":[{"index":1,"delta":{"tool_calls":[{"index":0}]}}]}',
            b'data: {"choices":[{"index":1,"text":"t","logprobs":{"tokens":["a","b"]}}]}',
            b'data: {"choices":[{"index":1,"delta":{},"logprobs":{"content":[{},{},{}]}}]}',
            b'data: {"choices":[{"index":1,"delta":{"content":""},"finish_reason":"stop"}]}',
        ]
    ),
)
_event = st.builds(
    lambda lines, newline, blank: newline.join(lines) + blank,
    st.lists(_line, min_size=1, max_size=3),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\r\n\n"]),
)


@st.composite
def _chunked_stream(draw: st.DrawFn) -> list[bytes]:
    stream = b"".join(draw(st.lists(_event, max_size=12)))
    stream += draw(st.sampled_from([b"", b"data: {", b"\r\n", b"\n"]))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(stream)), max_size=12))))
    points = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(points) if b > a]


def _same(chunks: list[bytes]) -> None:
    new, old = StreamTally(), ReferenceTally()
    for chunk in chunks:
        assert new.feed(chunk) == old.feed(chunk)
    assert new.tokens_by_choice == old.tokens_by_choice
    assert new.usage == old.usage
    assert (new.done, new.error) == (old.done, old.error)


@given(_chunked_stream())
def test_the_tally_counts_as_the_reference_under_any_stream_and_chunking(chunks: list[bytes]) -> None:
    _same(chunks)


@given(_chunked_stream(), st.integers(8, 200))
def test_oversized_events_are_dropped_as_the_reference_drops_them(chunks: list[bytes], bound: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sse, "MAX_EVENT_BYTES", bound)
        _same(chunks)


def test_a_vllm_stream_is_counted_as_the_reference_counts_it() -> None:
    head = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
    events = [
        head + b'[{"index":0,"text":" w%d","logprobs":null,"finish_reason":null}]}\n\n' % i for i in range(50)
    ]
    events.append(head + b'[],"usage":{"prompt_tokens":3,"completion_tokens":50}}\n\ndata: [DONE]\n\n')
    stream = b"".join(events)
    for size in (1, 7, 64, 1000, len(stream)):
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        _same(chunks)
    tally = StreamTally()
    tally.feed(stream)
    assert tally.tokens_by_choice == {0: 50}
    assert tally.usage == Usage(3, 50)

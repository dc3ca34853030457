"""Count output tokens in OpenAI responses as their bytes pass through (pure).

The proxy forwards bytes untouched and feeds a copy here. For a stream (`text/event-stream`)
`StreamTally.feed` splits server-sent events however the bytes were chunked and reports, per
choice index, how many tokens each event carried: the number of logprob entries when the
client asked for logprobs, else one per event with non-empty text (vLLM emits one event per
engine step and request, i.e. one token, unless speculative decoding or a stream interval
batches several; the closed loop absorbs that difference). A `usage` object, when the client
asked for one, is the exact final count and wins. For a plain JSON answer `body_usage` reads
the usage at the end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Bound on a single event we are willing to buffer while looking for its end; a backend that
# sends longer lines still has its bytes forwarded, we just stop counting that event.
MAX_EVENT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None


def _usage(payload: Mapping[str, Any]) -> Usage | None:
    usage = payload.get("usage")
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return Usage(
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
    )


def _choice_tokens(choice: Mapping[str, Any]) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, Mapping):
        content = logprobs.get("content")  # chat
        if isinstance(content, list):
            return len(content)
        tokens = logprobs.get("tokens")  # completions
        if isinstance(tokens, list):
            return len(tokens)
    delta = choice.get("delta")
    if isinstance(delta, Mapping):  # chat stream
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                return 1
        return 1 if delta.get("tool_calls") else 0
    return 1 if choice.get("text") else 0  # completions stream


class StreamTally:
    """Incremental token counter over one SSE stream. Not thread-safe (one stream, one task)."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._skipping = False
        self.tokens_by_choice: dict[int, int] = {}
        self.usage: Usage | None = None
        self.done = False
        self.error = False

    @property
    def counted_tokens(self) -> int:
        return sum(self.tokens_by_choice.values())

    def feed(self, chunk: bytes) -> list[tuple[int, int]]:
        """Take the next bytes; returns (choice index, new tokens) for each complete event."""
        growth: list[tuple[int, int]] = []
        self._pending += chunk
        while True:
            end, separator = _event_end(self._pending)
            if end < 0:
                if len(self._pending) > MAX_EVENT_BYTES:
                    self._pending.clear()
                    self._skipping = True  # drop the rest of this oversized event
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
            usage = _usage(payload)
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
                    index = index if isinstance(index, int) else 0
                    self.tokens_by_choice[index] = self.tokens_by_choice.get(index, 0) + tokens
                    growth.append((index, tokens))


def _event_end(buffer: bytearray) -> tuple[int, int]:
    """Position and length of the first blank-line separator, or (-1, 0)."""
    lf = buffer.find(b"\n\n")
    crlf = buffer.find(b"\r\n\r\n")
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return crlf, 4
    return (lf, 2) if lf >= 0 else (-1, 0)


def body_usage(body: bytes) -> tuple[Usage | None, int]:
    """Usage and number of choices of a complete JSON answer ((None, 0) if unparseable)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None, 0
    if not isinstance(payload, Mapping):
        return None, 0
    choices = payload.get("choices")
    return _usage(payload), len(choices) if isinstance(choices, list) else 0

"""Count output tokens in OpenAI responses as their bytes pass through (pure).

The proxy forwards bytes untouched and feeds a copy here. For a stream (`text/event-stream`)
`StreamTally.feed` splits server-sent events however the bytes were chunked and reports, per
choice index, how many tokens each event carried: the number of logprob entries when the
client asked for logprobs, else one per event with non-empty text (vLLM emits one event per
engine step and request, i.e. one token, unless speculative decoding or a stream interval
batches several; the closed loop absorbs that difference). A `usage` object, when the client
asked for one, is the exact final count and wins. For a plain JSON answer, which may run to
hundreds of MB (echo, logprobs, many prompts), `BodyUsage` finds the usage object as the bytes
pass, keeping a few KiB at most, and parses only that object.

What a backend reports is checked for type and range only (a non-negative integer below
`MAX_USAGE_TOKENS`); anything else makes the usage `invalid`, and it is not used. Whether a
count is plausible for its request is the service's to judge.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Bound on a single event we are willing to buffer while looking for its end; a backend that
# sends longer lines still has its bytes forwarded, we just stop counting that event.
MAX_EVENT_BYTES = 1 << 20
# No request has this many tokens (vLLM's counts are int32 in places): a larger count is garbage.
MAX_USAGE_TOKENS = 1 << 31
# Choice indices beyond this are folded into it, as the ledger folds indices beyond the
# request's sequences into its last: a backend inventing indices must not grow the tally.
MAX_CHOICE_INDEX = 4095


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts a backend reported. `invalid` names what was wrong with them (a count that
    is not a non-negative integer below MAX_USAGE_TOKENS); None when they are usable."""

    prompt_tokens: int | None
    completion_tokens: int | None
    invalid: str | None = None


def _count(usage: Mapping[str, Any], key: str) -> tuple[int | None, str | None]:
    """A usage count and what is wrong with it: absent is fine (None, None)."""
    if key not in usage or usage[key] is None:
        return None, None
    value = usage[key]
    # type() rather than isinstance: JSON's true is a bool, and bool is an int in Python.
    if type(value) is not int or not 0 <= value < MAX_USAGE_TOKENS:
        return None, f"{key} is {json.dumps(value)[:40]}"
    return value, None


def usage_of(usage: Any) -> Usage | None:
    """The `usage` member of an answer or event as the backend sent it; None when it has none."""
    if usage is None:
        return None
    if not isinstance(usage, Mapping):
        return Usage(None, None, f"usage is {type(usage).__name__}, not an object")
    prompt, prompt_problem = _count(usage, "prompt_tokens")
    completion, completion_problem = _count(usage, "completion_tokens")
    problem = prompt_problem or completion_problem
    if problem is not None:
        return Usage(None, None, problem)
    return Usage(prompt, completion)


def _usage(payload: Mapping[str, Any]) -> Usage | None:
    return usage_of(payload.get("usage"))


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
        if delta.get("tool_calls"):
            return 1
    elif choice.get("text"):  # completions stream
        return 1
    # The event that ends a choice carries its last token even when that token has no text: an
    # end-of-sequence token arrives as "" with finish_reason "stop" (vLLM counts it in usage).
    finish = choice.get("finish_reason")
    return 1 if isinstance(finish, str) and finish else 0


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
                    index = min(max(index, 0), MAX_CHOICE_INDEX) if type(index) is int else 0
                    self.tokens_by_choice[index] = self.tokens_by_choice.get(index, 0) + tokens
                    growth.append((index, tokens))


def _event_end(buffer: bytearray) -> tuple[int, int]:
    """Position and length of the first blank-line separator, or (-1, 0)."""
    lf = buffer.find(b"\n\n")
    crlf = buffer.find(b"\r\n\r\n")
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return crlf, 4
    return (lf, 2) if lf >= 0 else (-1, 0)


# `"usage":` as a key, in compact or spaced JSON. Inside a JSON string the quotes would be
# escaped (\"usage\"), and a string value "usage" is not followed by a colon.
_USAGE_KEY = re.compile(rb'"usage"\s{0,8}:')
# Bytes kept from the previous chunk, so that a key cut in two by the chunking is still found.
_USAGE_KEY_OVERLAP = 32
# Bytes kept from the start of the last usage object: vLLM's, with its details, is a few
# hundred bytes; a longer one is not a usage object.
USAGE_CAPTURE_BYTES = 4096


def _last_usage_key(data: bytes) -> int:
    """Where the last `"usage":` key in `data` begins, or -1."""
    position = data.rfind(b'"usage"')
    while position >= 0:
        if _USAGE_KEY.match(data, position):
            return position
        position = data.rfind(b'"usage"', 0, position)
    return -1


class BodyUsage:
    """Finds the usage of a plain JSON answer as its bytes pass, in bounded memory and time.

    vLLM writes `usage` after the choices, and in a chat answer before `prompt_logprobs` and
    `prompt_token_ids`, which can be far longer: so not from a tail but from the last
    `"usage":` key seen anywhere, capturing at most USAGE_CAPTURE_BYTES from it and parsing
    only that object (`result`). Memory: the capture plus a few dozen bytes of overlap.
    Not thread-safe (one answer, one task).
    """

    def __init__(self) -> None:
        self._overlap = b""
        self._capture: bytearray | None = None

    def feed(self, chunk: bytes) -> None:
        if self._capture is not None and len(self._capture) < USAGE_CAPTURE_BYTES:
            self._capture += chunk[: USAGE_CAPTURE_BYTES - len(self._capture)]
        window = (self._overlap + chunk[: _USAGE_KEY_OVERLAP * 2]) if self._overlap else b""
        start: int | None = None
        # A key that begins in the overlap and ends in this chunk (one that lies wholly in the
        # overlap was seen with the previous chunk).
        for match in _USAGE_KEY.finditer(window):
            if match.end() > len(self._overlap):
                start = match.start() - len(self._overlap)  # negative: begins in the overlap
        # The last key wholly in this chunk, found from the right.
        found = _last_usage_key(chunk)
        if found >= 0:
            start = found
        if start is not None:
            if start < 0:
                head = self._overlap[start:]
                self._capture = bytearray(head + chunk[: USAGE_CAPTURE_BYTES - len(head)])
            else:
                self._capture = bytearray(chunk[start : start + USAGE_CAPTURE_BYTES])
        if len(chunk) >= _USAGE_KEY_OVERLAP:
            self._overlap = chunk[-_USAGE_KEY_OVERLAP:]
        else:
            self._overlap = (self._overlap + chunk)[-_USAGE_KEY_OVERLAP:]

    def result(self) -> Usage | None:
        """The usage object last seen, or None when there was none (or it does not parse)."""
        if self._capture is None:
            return None
        captured = bytes(self._capture)
        text = captured[captured.index(b":") + 1 :].decode("utf-8", "replace").lstrip()
        try:
            value, _ = json.JSONDecoder().raw_decode(text)
        except (ValueError, RecursionError):
            return Usage(None, None, "usage does not parse as JSON")
        return usage_of(value)

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
from collections.abc import Callable, Mapping
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


def _choice_tokens(choice: dict[str, Any]) -> int:
    # JSON decodes objects to dicts and arrays to lists, nothing else: type() checks say the
    # same as isinstance(Mapping) / isinstance(list) here, for less.
    logprobs = choice.get("logprobs")
    if type(logprobs) is dict:
        content = logprobs.get("content")  # chat
        if type(content) is list:
            return len(content)
        tokens = logprobs.get("tokens")  # completions
        if type(tokens) is list:
            return len(tokens)
    delta = choice.get("delta")
    if type(delta) is dict:  # chat stream
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return 1
        if delta.get("tool_calls"):
            return 1
    elif choice.get("text"):  # completions stream
        return 1
    # The event that ends a choice carries its last token even when that token has no text: an
    # end-of-sequence token arrives as "" with finish_reason "stop" (vLLM counts it in usage).
    finish = choice.get("finish_reason")
    return 1 if type(finish) is str and finish else 0


# json.loads without its per-call layers (encoding detection, the whitespace regexes), for data
# that starts with '{"': UTF-8 by json.loads's own detection, and stripped, so no whitespace
# around it. The scanner is the one json.loads uses (JSONDecoder's defaults).
_scan_object: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(data: bytes | bytearray) -> Any:
    """json.loads(data) for `data` already stripped: the same value or ValueError."""
    if not data.startswith(b'{"'):
        return json.loads(data)
    text = data.decode("utf-8", "surrogatepass")  # UnicodeDecodeError is a ValueError
    try:
        value, end = _scan_object(text, 0)
    except StopIteration as exc:
        raise ValueError("not JSON") from exc
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return value


class StreamTally:
    """Incremental token counter over one SSE stream. Not thread-safe (one stream, one task)."""

    def __init__(self) -> None:
        self._pending = bytearray()  # the start of an event whose end has not arrived yet
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
        pending = self._pending
        if not pending and not self._skipping:
            # The usual chunk, one engine step of one request: exactly one event, LF-separated.
            end = chunk.find(b"\n\n")
            if end >= 0 and end == len(chunk) - 2 and b"\r" not in chunk:
                self._event(chunk[:end], growth)
                return growth
        # Usually a chunk holds whole events and is read in place; bytes left of an event
        # whose end has not come yet wait in `pending`, where the next chunk joins them.
        data: bytes | bytearray = chunk
        if pending:
            pending += chunk
            data = pending
        # Events end at the first blank line, "\n\n" or "\r\n\r\n"; most streams use no CR.
        crlf_possible = b"\r" in data
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            separator = 2
            if crlf_possible:
                crlf = data.find(b"\r\n\r\n", start)
                if crlf >= 0 and (end < 0 or crlf < end):
                    end, separator = crlf, 4
            if end < 0:
                break
            if self._skipping:
                self._skipping = False
            else:
                self._event(data[start:end], growth)
            start = end + separator
        if data is pending:
            del pending[:start]
        elif start < len(chunk):
            pending += chunk[start:]
        if len(pending) > MAX_EVENT_BYTES:
            pending.clear()
            self._skipping = True  # drop the rest of this oversized event
        return growth

    def _event(self, event: bytes | bytearray, growth: list[tuple[int, int]]) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                payload = _loads(data)
            except (ValueError, RecursionError):  # a hostile backend's deeply nested event too
                continue
            if type(payload) is not dict:
                continue
            if "error" in payload:
                self.error = True
            usage = payload.get("usage")
            if usage is not None:
                self.usage = usage_of(usage)
            choices = payload.get("choices")
            if type(choices) is not list:
                continue
            for choice in choices:
                if type(choice) is not dict:
                    continue
                tokens = _choice_tokens(choice)
                if tokens:
                    index = choice.get("index", 0)
                    index = min(max(index, 0), MAX_CHOICE_INDEX) if type(index) is int else 0
                    self.tokens_by_choice[index] = self.tokens_by_choice.get(index, 0) + tokens
                    growth.append((index, tokens))


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

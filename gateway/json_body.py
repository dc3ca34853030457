"""Request bodies parsed as JSON without holding the event loop for long.

`json.loads` runs in one C call: an 8 MiB body of small values (token ids, empty lists, short
keys) holds the interpreter for a fifth of a second to most of a second, and no other thread
helps (the call keeps the interpreter lock throughout). `parse_body` gives the same value as
`json.loads` (or raises a ValueError where it does), in steps that each hold the loop for the
C work of at most about `window` characters, and lets the loop run between steps.

How: a body up to `inline_max_bytes` is one `json.loads`. A larger one is decoded in slices,
then walked by `iter_value`, a generator that yields between steps:
- a run of an array's or object's members that fits a window is one C call: the text up to
  the window's last comma, closed with a bracket and parsed by `json.loads`. That succeeds only
  when the run is whole members (a comma inside a string or a nested value leaves it unclosed),
  so a success is exactly those members. Where members hold commas of their own, the members
  within a window are read one by one by json's scanner instead;
- a member too large for a window is walked in turn (a nested array or object), or, for a
  string, decoded in windows by json's own `scanstring`, cut between escapes and never inside a
  surrogate pair (`\\ud83d\\ude00` is one character);
- scalars are json's own scanner's.
Nesting the walk follows is bounded (MAX_WALK_DEPTH): vLLM's own JSON parser refuses bodies
nested far less deep.

A large body may also hold at most one array or object per BYTES_PER_CONTAINER bytes of it
(TooManyContainersError beyond): an empty list is 3 bytes of JSON and about 80 bytes of
memory, so 8 MiB of `[[],[],...]` became 210 MiB of objects, which then took a fifth of a
second to free on the loop. Real requests hold far fewer (a chat message is 28 bytes at the
least, a content part 25, a prompt of two token ids in a batch 6). Numbers and strings are not bounded apart: at most about 10 bytes of
memory per byte of JSON (`[256,256,...]`).
"""

from __future__ import annotations

import asyncio
import codecs
import gc
import json
import json.decoder
import re
import time
from collections.abc import Callable, Generator
from json import JSONDecodeError
from typing import Any, cast

# Up to this size a body is one json.loads: at worst (8 MiB of `[[],[],...]` took 0.74 s) a
# few milliseconds of the loop.
DEFAULT_INLINE_MAX_BYTES = 64 * 1024
# Characters of C parsing per step: at the worst rate above, about 5 ms.
DEFAULT_WINDOW_CHARS = 64 * 1024
# Runs tried in one container before the rest is read member by member: a failed run costs a
# window's parse for nothing.
MAX_FAILED_RUNS = 4
# A window is never smaller (every string token and surrogate pair fits many times over).
MIN_WINDOW_CHARS = 64
# A large body may hold one array or object per this many bytes: 8 MiB of empty lists is then
# at most 1.4 M of them (110 MiB), and a batch of prompts of two token ids each still passes.
BYTES_PER_CONTAINER = 6
# Members freed per step when a refused body's values are let go.
RELEASE_PER_STEP = 32 * 1024
# Large bodies parsed at the same time (BodyParser): each may take up to ~13 x its size.
DEFAULT_MAX_PARALLEL_PARSES = 2
# The longest the garbage collector stays paused in one go (see BodyParser). Under an unbroken
# stream of large bodies, each resumption costs full passes over what the parses in progress
# hold (80-95 ms each for a million lists): at 2 s they were the loop's worst stalls, at 30 s
# none was over 100 ms. Cyclic garbage of 30 s of traffic waits for collection meanwhile.
MAX_GC_PAUSE_S = 30.0
# Bytes decoded to text per step.
DECODE_SLICE_BYTES = 1024 * 1024
# Characters of the longest escape in a JSON string (`\uXXXX`).
MAX_ESCAPE_CHARS = 6
# Backslashes a string's cut steps back over, from a window's end, before that window is read
# token by token by a regular expression instead (several times slower than json's scanner).
MAX_CUT_RETRIES = 8
# Levels the walk itself descends (members larger than a window). pydantic-core, which parses
# vLLM's request bodies, refuses nesting deeper than a few hundred levels anyway.
MAX_WALK_DEPTH = 200

_WS = re.compile(r"[ \t\n\r]*")
# String content up to the closing quote, a control character, a bad escape or the window's
# end, in whole tokens (a plain run or one escape): every end of a match is a place to cut.
_STRING_TOKENS = re.compile(r'(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+')
_HIGH_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_SURROGATE_ESCAPE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
# json's own scanners (C where the interpreter has them), which typeshed does not declare.
_scan_once = cast(Callable[[str, int], tuple[Any, int]], getattr(json.JSONDecoder(), "scan_once"))  # noqa: B009
scanstring = cast(Callable[[str, int, bool], tuple[str, int]], getattr(json.decoder, "scanstring"))  # noqa: B009

Steps = Generator[None, None, Any]


class TooManyContainersError(ValueError):
    """The body holds more arrays and objects than its size allows (valid JSON all the same)."""


def _skip(text: str, index: int) -> int:
    """The index of the first character at or after `index` that is not JSON whitespace."""
    match = _WS.match(text, index)
    return match.end() if match is not None else index


def decoded_text(raw: bytes) -> Generator[None, None, str]:
    """`raw` as json.loads decodes bytes (UTF-8, -16 or -32 by its first bytes, surrogates
    passed), a slice per step."""
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8" and raw.isascii():
        # One C call at memory speed (a few milliseconds for 8 MiB), and no pieces to join.
        return raw.decode("ascii")
        yield  # a generator all the same
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    parts: list[str] = []
    view = memoryview(raw)
    for start in range(0, len(raw), DECODE_SLICE_BYTES):
        parts.append(decoder.decode(view[start : start + DECODE_SLICE_BYTES]))
        yield
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def iter_document(text: str, window: int = DEFAULT_WINDOW_CHARS, max_containers: int | None = None) -> Steps:
    """json.loads(text) for a str, in steps; TooManyContainersError past `max_containers`
    arrays and objects (None: no bound)."""
    if text.startswith("\ufeff"):
        raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    walker = _Walker(text, max(window, MIN_WINDOW_CHARS), max_containers)
    try:
        value, end = yield from walker.value(_skip(text, 0), 0)
    except IndexError:
        # A broken document the walk did not foresee: json.loads says what is wrong with it
        # (one call, on the loop, for a body that is refused anyway), never a 500.
        return json.loads(text)
    end = _skip(text, end)
    if end != len(text):
        raise JSONDecodeError("Extra data", text, end)
    return value


def iter_body(raw: bytes, window: int = DEFAULT_WINDOW_CHARS, max_containers: int | None = None) -> Steps:
    """json.loads(raw) for bytes, in steps (see iter_document)."""
    text = yield from decoded_text(raw)
    return (yield from iter_document(text, window, max_containers))


class BodyParser:
    """Parses request bodies for one app: json.loads for small ones, the walk above for large
    ones, letting the event loop run between its steps. At most `max_parallel` large bodies
    are parsed at a time, the others wait their turn: a parsed body can take up to about 13
    times its size in memory (token ids, tiny messages, containers up to the bound below),
    so this bounds what parsing holds, whatever the number of connections sending bodies.

    While large bodies are being parsed, the cyclic garbage collector is paused: otherwise its
    full passes walk every container the parse has made so far, in whichever step or request
    triggers them (8 MiB of `[[],[],...]` took 0.73 s of CPU with it and 0.27 s without; its
    longest step 88 ms against 8 ms). A parse makes no cycles. The pause ends when the last
    parse does, and never lasts longer than `max_gc_pause_s` in one go (parses that overlap
    for ever would otherwise leave other requests' cyclic garbage uncollected): past that, the
    collector runs again until no parse is left. Only this object pauses and resumes the
    collector, and only when it found it enabled."""

    def __init__(
        self,
        *,
        inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
        window: int = DEFAULT_WINDOW_CHARS,
        max_gc_pause_s: float = MAX_GC_PAUSE_S,
        max_parallel: int = DEFAULT_MAX_PARALLEL_PARSES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_parallel < 1:
            raise ValueError("max_parallel must be at least 1")
        self._slots = asyncio.Semaphore(max_parallel)
        self.inline_max_bytes = inline_max_bytes
        self.window = window
        self.max_gc_pause_s = max_gc_pause_s
        self._monotonic = monotonic
        self._parsing = 0
        self._paused_at: float | None = None  # when this object disabled the collector

    @property
    def gc_paused(self) -> bool:
        return self._paused_at is not None

    @property
    def parsing(self) -> int:
        """Large bodies being parsed now (at most `max_parallel`)."""
        return self._parsing

    async def parse(self, raw: bytes) -> Any:
        """json.loads(raw): the same value, or a ValueError (or RecursionError) where it raises;
        for a large body, TooManyContainersError past one array or object per
        BYTES_PER_CONTAINER bytes."""
        if len(raw) <= self.inline_max_bytes:
            return json.loads(raw)
        async with self._slots:
            steps = iter_body(raw, self.window, len(raw) // BYTES_PER_CONTAINER)
            self._enter()
            try:
                while True:
                    try:
                        next(steps)
                    except StopIteration as done:
                        return done.value
                    self._check_pause()
                    await asyncio.sleep(0)
            finally:
                self._leave()

    def _enter(self) -> None:
        self._parsing += 1
        if self._parsing == 1 and gc.isenabled():
            gc.disable()
            self._paused_at = self._monotonic()

    def _check_pause(self) -> None:
        if self._paused_at is not None and self._monotonic() - self._paused_at > self.max_gc_pause_s:
            self._resume()

    def _leave(self) -> None:
        self._parsing -= 1
        if self._parsing == 0:
            self._resume()

    def _resume(self) -> None:
        if self._paused_at is not None:
            self._paused_at = None
            gc.enable()


class _Walker:
    """The walk over one document. Each method takes the index where its value starts and
    returns (value, index after it)."""

    def __init__(self, text: str, window: int, max_containers: int | None) -> None:
        self.text = text
        self.window = window
        self.max_containers = max_containers
        self.containers = 0

    def _tally(self, values: list[Any]) -> None:
        """Count the arrays and objects within `values` (new members), nested ones included;
        TooManyContainersError past the bound. The element types are collected in C, so a run
        of scalars costs little."""
        stack = [values]
        while stack:
            members = stack.pop()
            kinds = set(map(type, members))
            if list in kinds or dict in kinds:
                inner = [m for m in members if type(m) is list or type(m) is dict]
                self._add(len(inner))
                for member in inner:
                    if member:
                        stack.append(list(member.values()) if isinstance(member, dict) else member)

    def _add(self, containers: int) -> None:
        self.containers += containers
        if self.max_containers is not None and self.containers > self.max_containers:
            raise TooManyContainersError(
                f"the body holds more than {self.max_containers} arrays and objects "
                f"(one per {BYTES_PER_CONTAINER} bytes of it)"
            )

    def value(self, index: int, depth: int) -> Generator[None, None, tuple[Any, int]]:
        text = self.text
        char = text[index : index + 1]
        if char == '"':
            return (yield from self.string(index))
        if char in ("[", "{"):
            if depth >= MAX_WALK_DEPTH:
                raise JSONDecodeError("the document is nested too deeply", text, index)
            return (yield from self.container(index, depth + 1))
        try:
            value, end = _scan_once(text, index)  # a number, true, false, null, NaN, Infinity
        except StopIteration as exc:
            raise JSONDecodeError("Expecting value", text, exc.value) from None
        return value, end

    def container(self, index: int, depth: int) -> Generator[None, None, tuple[Any, int]]:
        self._add(1)
        items: list[Any] = []
        pairs: dict[str, Any] = {}
        try:
            return (yield from self._members(index, depth, items, pairs))
        except TooManyContainersError:
            # What was parsed is freed a part at a time: freeing a million containers at
            # once holds the loop for tens of milliseconds.
            while items:
                del items[-RELEASE_PER_STEP:]
                yield
            while pairs:
                for _ in range(min(len(pairs), RELEASE_PER_STEP)):
                    pairs.popitem()
                yield
            raise

    def _members(
        self, index: int, depth: int, items: list[Any], pairs: dict[str, Any]
    ) -> Generator[None, None, tuple[Any, int]]:
        """The members of the array or object at `index`, into `items` or `pairs`."""
        text = self.text
        is_array = text[index] == "["
        opening, close = text[index], "]" if is_array else "}"
        index = _skip(text, index + 1)
        if text[index : index + 1] == close:
            return (items if is_array else pairs), index + 1
        failed_runs = 0
        while True:  # `index` is where a member starts
            limit = min(len(text), index + self.window)
            # 1. Whole members up to the window's last comma, in one C call. Once that failed
            # a few times (commas inside the members), the windows are read member by member.
            comma = self._last_boundary(index, limit) if failed_runs < MAX_FAILED_RUNS else -1
            if comma > index:
                try:
                    run = json.loads(opening + text[index:comma] + close)
                except (ValueError, RecursionError):
                    failed_runs += 1
                else:
                    self._tally(run if is_array else list(run.values()))
                    if is_array:
                        items.extend(run)
                    else:
                        pairs.update(run)
                    index = _skip(text, comma + 1)
                    yield
                    continue
            # 2. The members that fit in the window, each by json's scanner, on a copy of the
            # window (a member that the window's end cuts is read again from the next one).
            piece, base, progressed = text[index:limit], index, False
            cut = limit < len(text)
            while True:
                try:
                    if is_array:
                        item, end = _scan_once(piece, index - base)
                    else:
                        key, end = self._pair_key(piece, index - base)
                        item, end = _scan_once(piece, end)
                except (StopIteration, ValueError, RecursionError):
                    break
                after = _skip(piece, end)
                if cut and piece[after : after + 1] not in (",", close):
                    # Not followed by its delimiter in the window: a number the window cut
                    # short ("1." read as 1), or a delimiter past the window.
                    break
                if type(item) is list or type(item) is dict:
                    self._tally([item])
                if is_array:
                    items.append(item)
                else:
                    pairs[key] = item
                progressed = True
                index = _skip(text, base + end)
                following = self._next_member(index, close)
                if following is None:
                    return (items if is_array else pairs), index + 1
                index = following
            if progressed:
                yield
                continue
            # 3. One member larger than the window (or not valid), walked on its own.
            if is_array:
                item, index = yield from self.value(index, depth)
                items.append(item)
            else:
                if text[index : index + 1] != '"':
                    raise JSONDecodeError("Expecting property name enclosed in double quotes", text, index)
                key, index = yield from self.string(index)
                index = _skip(text, index)
                if text[index : index + 1] != ":":
                    raise JSONDecodeError("Expecting ':' delimiter", text, index)
                item, index = yield from self.value(_skip(text, index + 1), depth)
                pairs[key] = item
            index = _skip(text, index)
            following = self._next_member(index, close)
            if following is None:
                return (items if is_array else pairs), index + 1
            index = following
            yield

    def _next_member(self, index: int, close: str) -> int | None:
        """After a member, at `index` past its whitespace: None at the container's `close`,
        else where the next member starts, past the comma."""
        char = self.text[index : index + 1]
        if char == close:
            return None
        if char != ",":
            raise JSONDecodeError(f"Expecting ',' delimiter or '{close}'", self.text, index)
        return _skip(self.text, index + 1)

    def _last_boundary(self, index: int, limit: int) -> int:
        """The last comma in text[index:limit] likeliest to end a member: one followed by the
        character the member at `index` starts with (a quote, a bracket: such a pair is rare
        inside a member, and never inside a string when the character is a quote), else the
        last comma."""
        text = self.text
        if index >= min(limit, len(text)):
            return -1
        first = text[index]
        if first in '"[{':
            boundary = max(text.rfind("," + first, index, limit), text.rfind(", " + first, index, limit))
            if boundary > index:
                return boundary
        return text.rfind(",", index, limit)

    @staticmethod
    def _pair_key(piece: str, index: int) -> tuple[str, int]:
        """An object member's key at `index` of `piece` and the index of its value."""
        if piece[index : index + 1] != '"':
            raise ValueError("not a key")
        key, end = scanstring(piece, index + 1, True)
        end = _skip(piece, end)
        if piece[end : end + 1] != ":":
            raise ValueError("no ':' after the key")
        return key, _skip(piece, end + 1)

    def string(self, index: int) -> Generator[None, None, tuple[str, int]]:
        """The string whose opening quote is at `index`, decoded a window at a time."""
        text = self.text
        position = index + 1
        quote = text.find('"', position)
        if quote >= 0 and text.find("\\", position, quote) < 0:
            return (yield from self._plain_string(position, quote))
        pieces: list[str] = []
        while True:
            limit = min(len(text), position + self.window)
            clear = self._clear_cut(position, limit)
            if clear is not None:
                # json's scanner decodes the window up to the string's end or to the quote
                # put after the window (the cut is between tokens, so that quote is no escape's).
                part, end = scanstring(text[position:clear] + '"', 0, True)
                pieces.append(part)
                if end <= clear - position:
                    return "".join(pieces), position + end
                if clear == len(text):
                    raise JSONDecodeError("Unterminated string starting at", text, index)
                position = clear
                yield
                continue
            # Backslashes everywhere near the window's end: the window is read token by token.
            tokens = _STRING_TOKENS.match(text, position, limit)
            cut = tokens.end() if tokens is not None else position
            if text[cut : cut + 1] == '"':
                pieces.append(scanstring(text[position : cut + 1], 0, True)[0])
                return "".join(pieces), cut + 1
            if cut == position:
                # Neither a closing quote nor a token here: json names the fault.
                if cut < len(text):
                    scanstring(text, cut, True)  # raises at once: the fault is at `cut`
                raise JSONDecodeError("Unterminated string starting at", text, index)
            if _LOW_SURROGATE_ESCAPE.match(text, cut) and self._ends_with_high_escape(position, cut):
                # json joins a high and a low surrogate escape into one character: keep them
                # in one piece (before the high one, or with the low one when alone).
                cut = cut - 6 if cut - 6 > position else cut + 6
            pieces.append(scanstring(text[position:cut] + '"', 0, True)[0])
            position = cut
            yield

    def _plain_string(self, start: int, quote: int) -> Generator[None, None, tuple[str, int]]:
        """The string from `start` to its closing `quote`, with no escape in it: the text
        itself, once json's scanner has found no control character in it (a window at a time).
        One copy of it in memory, where pieces and their join made three."""
        text = self.text
        for window_start in range(start, quote, self.window):
            window_end = min(quote, window_start + self.window)
            scanstring(text[window_start:window_end] + '"', 0, True)
            if window_end < quote:
                yield
        return text[start:quote], quote + 1

    def _clear_cut(self, start: int, limit: int) -> int | None:
        """A place at or before `limit`, after `start` (a place between two tokens of a string),
        that is between two tokens as well: the text's end, or a place with no backslash in
        the MAX_ESCAPE_CHARS characters before it (an escape is never longer, so none spans
        it, and a surrogate pair's escapes stay on one side). Searched in C from `limit` back
        over a few backslashes; None when that finds none (the caller reads token by token)."""
        text = self.text
        if limit >= len(text):
            return len(text)
        cut = limit
        for _ in range(MAX_CUT_RETRIES):
            backslash = text.rfind("\\", max(start, cut - MAX_ESCAPE_CHARS), cut)
            if backslash < 0:
                return cut if cut > start else None
            cut = backslash
        return None

    def _ends_with_high_escape(self, start: int, end: int) -> bool:
        """Whether text[start:end], whole tokens, ends with an escape of a high surrogate:
        its last six characters look like one, after an even run of backslashes."""
        text = self.text
        if end - start < 6 or not _HIGH_SURROGATE_ESCAPE.match(text, end - 6):
            return False
        before = text[start : end - 6]
        return (len(before) - len(before.rstrip("\\"))) % 2 == 0

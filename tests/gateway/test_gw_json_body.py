"""Large request bodies parsed in steps (`gateway.json_body`): the same value as json.loads, or
an error where json.loads raises one, for any document and any window (small windows cut
through every kind of token); the loop runs between steps; the garbage collector's pause."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import gateway_over_sim
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.json_body import (
    MAX_WALK_DEPTH,
    MIN_WINDOW_CHARS,
    BodyParser,
    TooManyContainersError,
    iter_body,
    iter_document,
)

COMPLETION = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4}


def run(steps: Iterator[None]) -> Any:
    """Drive a step generator to its value, without a loop."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def same(a: Any, b: Any) -> bool:
    """Equal as JSON documents (NaN equal to itself, 1 and 1.0 told apart)."""
    return json.dumps(a, allow_nan=True) == json.dumps(b, allow_nan=True)


# Text with what cuts can break: escapes, quotes, backslash runs, astral characters (a
# surrogate pair once escaped), lone surrogates, control characters (escaped by dumps).
TEXT = st.text(
    alphabet=st.sampled_from(
        ["a", " ", ",", '"', "\\", "{", "[", "\n", "\x01", "中", "😀", "\ud83d", "\ude00", "é"]
    ),
    max_size=40,
)
SCALARS = st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=True) | TEXT
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=12) | st.dictionaries(TEXT, children, max_size=8),
    max_leaves=200,
)
DUMPS = st.sampled_from(
    [
        {},
        {"ensure_ascii": False},
        {"separators": (",", ":")},
        {"separators": (",", ":"), "ensure_ascii": False},
        {"indent": 1},
    ]
)


@settings(max_examples=400, deadline=None)
@given(value=VALUES, options=DUMPS, window=st.integers(MIN_WINDOW_CHARS, 300))
def test_any_document_parses_as_json_loads_parses_it(
    value: Any, options: dict[str, Any], window: int
) -> None:
    text = json.dumps(value, **options)
    assert same(run(iter_document(text, window)), json.loads(text))
    raw = text.encode("utf-8", "surrogatepass")
    assert same(run(iter_body(raw, window)), json.loads(raw))


# Edits that break documents in every way: a character dropped, doubled or replaced.
@settings(max_examples=400, deadline=None)
@given(
    value=VALUES,
    window=st.integers(MIN_WINDOW_CHARS, 200),
    at=st.floats(0, 1),
    edit=st.sampled_from(["drop", "double", *'",:[]{}\\ 0x-.eu']),
)
def test_a_broken_document_fails_where_json_loads_fails(
    value: Any, window: int, at: float, edit: str
) -> None:
    text = json.dumps(value)
    index = int(at * (len(text) - 1))
    if edit == "drop":
        text = text[:index] + text[index + 1 :]
    elif edit == "double":
        text = text[:index] + text[index] + text[index:]
    else:
        text = text[:index] + edit + text[index + 1 :]
    try:
        expected = json.loads(text)
    except (ValueError, RecursionError):
        with pytest.raises((ValueError, RecursionError)):
            run(iter_document(text, window))
        return
    assert same(run(iter_document(text, window)), expected)


# Long strings, mostly plain, escapes sparse or in runs: each window's cut lands next to escapes
# of every kind, where it is found in C or, among too many backslashes, token by token.
LONG_TEXT = st.lists(
    st.sampled_from(["a" * 7, "b", " ", '"', "\\", "\n", "\x01", "😀", "\ud83d", "\ude00", "é", "\\" * 9]),
    min_size=50,
    max_size=400,
).map(lambda parts: "a" * 7 + "".join(parts))


@settings(max_examples=300, deadline=None)
@given(value=LONG_TEXT, ensure_ascii=st.booleans(), window=st.integers(MIN_WINDOW_CHARS, 200))
def test_a_long_string_parses_as_json_loads_parses_it_wherever_the_windows_cut(
    value: str, ensure_ascii: bool, window: int
) -> None:
    text = json.dumps({"prompt": value, "n": [value, 1]}, ensure_ascii=ensure_ascii)
    assert same(run(iter_document(text, window)), json.loads(text))
    for broken in (text[: len(text) * 2 // 3], text.replace("a" * 7, "a\\q", 1)):
        with pytest.raises(ValueError):  # noqa: PT011 (json's messages differ by case)
            json.loads(broken)
        with pytest.raises(ValueError):  # noqa: PT011
            run(iter_document(broken, window))


@pytest.mark.parametrize("offset", range(0, 20))
def test_a_surrogate_pair_is_one_character_wherever_the_window_ends(offset: int) -> None:
    # A long string, so that it is decoded in windows; the pair sits at every offset of a cut.
    text = (
        '"' + "a" * offset + "\\ud83d\\ude00" * 30 + "\\\\ud83d\\ude00" + "\\ud83d\\ud83d\\ude00" * 10 + '"'
    )
    assert run(iter_document(text, MIN_WINDOW_CHARS)) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        '"' + "\\\\" * 200 + '"',  # backslash runs: parity decides what is an escape
        '"' + "\\\\" * 100 + "\\ud83d" + "\\ude00" + '"',
        '"' + "\\ud83d" * 50 + '"',  # lone high surrogates
        '"' + "\\ude00" * 50 + '"',
        "[" + ",".join(["1000"] * 500) + "]",  # a number cut by a window goes on past it
        "[" + ",".join(['"a,b"', '{"x": [1, 2]}', "[[], {}]", "1e5", "-0.5", "true"] * 40) + "]",
        "{" + ",".join(f'"k{n}": {n}' for n in range(300)) + ', "k0": "last wins"}',
        '{"a": ' + "[" * 100 + "]" * 100 + "}",
        "[NaN, Infinity, -Infinity]",
        "  [1, 2]  \n",
    ],
)
def test_hard_documents(text: str) -> None:
    assert same(run(iter_document(text, MIN_WINDOW_CHARS)), json.loads(text))


@pytest.mark.parametrize(
    "text",
    [
        '"' + "a" * 500,  # unterminated
        '"' + "a" * 500 + '\x01"',  # a raw control character
        '"' + "a" * 500 + '\\x"',  # a bad escape
        '"' + "a" * 500 + "\\u12",  # an escape cut by the end
        "[" + ",".join(["1"] * 500) + ",]",  # a trailing comma
        "[" + ",".join(["1"] * 500) + "] x",  # extra data
        '{"a" 1}',
        "[1 2]",
        "\ufeff[1]",  # json.loads refuses a BOM in a str
        "[" + "1" * 5000 + "]",  # more digits than int() takes
    ],
)
def test_what_json_loads_refuses_is_refused(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 (json's messages differ by case)
        json.loads(text)
    with pytest.raises(ValueError):  # noqa: PT011
        run(iter_document(text, MIN_WINDOW_CHARS))


def test_nesting_deeper_than_the_walk_descends_is_refused() -> None:
    deep = "[" * (MAX_WALK_DEPTH + 1) + "1" * 200 + "]" * (MAX_WALK_DEPTH + 1)
    with pytest.raises(ValueError, match="nested too deeply"):
        run(iter_document(deep, MIN_WINDOW_CHARS))


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
@pytest.mark.parametrize("prompt", ["中文 😀 " * 300, "plain ascii " * 300])
def test_bytes_are_decoded_as_json_loads_decodes_them(encoding: str, prompt: str) -> None:
    # An ASCII document in UTF-16 or -32 is ASCII bytes too (with NULs): decoded by its encoding.
    text = json.dumps({"prompt": prompt}, ensure_ascii=False)
    raw = text.encode(encoding)
    assert run(iter_body(raw, MIN_WINDOW_CHARS)) == json.loads(raw)


def test_raw_surrogates_pass_as_json_loads_passes_them() -> None:
    raw = b'["' + "\ud83d".encode("utf-8", "surrogatepass") * 300 + b'"]'
    assert run(iter_body(raw, MIN_WINDOW_CHARS)) == json.loads(raw)


async def test_the_loop_runs_between_the_steps_of_a_large_body() -> None:
    raw = json.dumps({"prompt": list(range(20_000))}).encode()
    parser = BodyParser(inline_max_bytes=1024, window=1024)
    turns = 0
    done = False

    async def other_work() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    value = await parser.parse(raw)
    done = True
    await task
    assert value == json.loads(raw)
    assert turns > 10  # the parse took many steps and let the other task run between them


@pytest.mark.parametrize(
    "members",
    [
        "[]",  # the memory attack: 3 bytes of JSON, about 80 bytes of memory each
        "{}",
        "[[[]]]",
        '{"a":[{}]}',
    ],
)
async def test_a_large_body_of_tiny_containers_is_refused(members: str) -> None:
    raw = ('{"prompt": [' + ",".join([members] * 20_000) + "]}").encode()
    parser = BodyParser(inline_max_bytes=1024, window=4096)
    turns = 0
    done = False

    async def other_work() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    with pytest.raises(TooManyContainersError, match="arrays and objects"):
        await parser.parse(raw)
    done = True
    await task
    assert not parser.gc_paused
    assert turns > 1  # refused in steps, and what it had parsed let go in steps too


async def test_real_requests_hold_far_fewer_containers_than_the_bound() -> None:
    # Chat messages with content parts, tools, a batch of token-id prompts: all accepted.
    message = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    bodies = [
        {"messages": [message] * 5000, "tools": [tool] * 500},
        {"prompt": [[1, 2]] * 20_000},
    ]
    parser = BodyParser(inline_max_bytes=1024)
    for body in bodies:
        raw = json.dumps(body, separators=(",", ":")).encode()
        assert await parser.parse(raw) == body


def test_the_bound_counts_every_array_and_object_once() -> None:
    text = json.dumps({"a": [[1], {"b": [2, [3]]}] * 50, "c": {"d": {}}})
    containers = 1 + 1 + 50 * 4 + 2  # the body, "a", each repeat's four, "c" and "d"
    assert run(iter_document(text, MIN_WINDOW_CHARS, containers)) == json.loads(text)
    with pytest.raises(TooManyContainersError):
        run(iter_document(text, MIN_WINDOW_CHARS, containers - 1))


async def test_large_bodies_beyond_the_parallel_bound_wait_their_turn() -> None:
    raw = json.dumps({"prompt": list(range(20_000))}).encode()
    parser = BodyParser(inline_max_bytes=1024, window=1024, max_parallel=2)
    seen: list[int] = []
    done = False

    async def watch() -> None:
        while not done:
            seen.append(parser.parsing)
            await asyncio.sleep(0)

    task = asyncio.create_task(watch())
    values = await asyncio.gather(*(parser.parse(raw) for _ in range(5)))
    done = True
    await task
    assert all(value == json.loads(raw) for value in values)
    assert max(seen) == 2  # two at a time, never more
    with pytest.raises(ValueError, match="max_parallel"):
        BodyParser(max_parallel=0)


async def test_a_small_body_is_one_json_loads() -> None:
    parser = BodyParser(inline_max_bytes=1024)
    assert await parser.parse(b'{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ValueError):  # noqa: PT011
        await parser.parse(b'{"a": [1, 2}')


async def test_the_garbage_collector_is_paused_while_large_bodies_are_parsed() -> None:
    raw = json.dumps([[n] for n in range(5_000)]).encode()
    parser = BodyParser(inline_max_bytes=1024, window=1024)
    seen: list[bool] = []
    done = False

    async def watch() -> None:
        while not done:
            seen.append(gc.isenabled())
            await asyncio.sleep(0)

    assert gc.isenabled()
    task = asyncio.create_task(watch())
    await asyncio.sleep(0)
    both = await asyncio.gather(parser.parse(raw), parser.parse(raw))  # overlapping parses
    done = True
    await task
    assert both[0] == both[1] == json.loads(raw)
    assert False in seen[1:]
    assert gc.isenabled()  # resumed once the last parse ended
    assert not parser.gc_paused


async def test_the_pause_ends_after_its_bound_and_never_enables_a_collector_someone_disabled() -> None:
    clock = iter(float(n) for n in range(10**6))
    parser = BodyParser(inline_max_bytes=1024, window=1024, max_gc_pause_s=5.0, monotonic=lambda: next(clock))
    raw = json.dumps(list(range(20_000))).encode()
    enabled_during: list[bool] = []

    async def watch() -> None:
        for _ in range(40):
            enabled_during.append(gc.isenabled())
            await asyncio.sleep(0)

    task = asyncio.create_task(watch())
    await parser.parse(raw)
    await task
    assert False in enabled_during
    assert True in enabled_during[enabled_during.index(False) :]  # resumed past the bound
    assert gc.isenabled()

    gc.disable()
    try:
        await parser.parse(raw)
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_a_large_body_through_the_gateway_is_answered_as_a_small_one() -> None:
    large = {**COMPLETION, "user": "u" * 200_000}  # past the inline size: parsed in steps
    async with gateway_over_sim() as harness:
        small_answer = await harness.client.post("/v1/completions", json=COMPLETION)
        large_answer = await harness.client.post("/v1/completions", json=large)
        broken = await harness.client.post(
            "/v1/completions",
            content=json.dumps(large).encode()[:-1],
            headers={"content-type": "application/json"},
        )
    assert small_answer.status_code == large_answer.status_code == 200
    assert small_answer.json()["usage"]["prompt_tokens"] == large_answer.json()["usage"]["prompt_tokens"]
    assert broken.status_code == 400
    assert broken.json()["error"]["code"] == "invalid_json"

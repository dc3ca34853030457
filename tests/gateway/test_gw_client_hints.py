"""Client hints: priority, deadline and expected-output headers, the SDK's read timeout, queue
deadlines."""

from __future__ import annotations

import math

import pytest

from gateway.admission import Priority
from gateway.client_hints import (
    EXPECTED_OUTPUT_HEADER,
    MAX_EXPECTED_OUTPUT_TOKENS,
    NO_SERVICE_ESTIMATE,
    PRIORITY_TOKEN_HEADER,
    ClientHints,
    HintError,
    ServiceEstimate,
    parse_hints,
    queue_deadline,
)
from gateway.errors import PermissionDeniedError


@pytest.mark.parametrize(
    ("headers", "streaming", "expected"),
    [
        ({}, False, ClientHints(Priority.NORMAL, None, None)),
        # Raising priority takes the operator's token (see test_raising_priority_takes_the_token).
        ({"x-kvgate-priority": "HIGH "}, False, ClientHints(Priority.NORMAL, None, None)),
        ({"x-kvgate-priority": "low"}, False, ClientHints(Priority.LOW, None, None)),
        ({"x-kvgate-deadline-ms": "10000"}, True, ClientHints(Priority.NORMAL, 10.0, None)),
        ({"x-kvgate-ttft-ms": "2000.5"}, False, ClientHints(Priority.NORMAL, None, 2.0005)),
        # The SDK's read timeout bounds the whole answer, or the first chunk of a stream.
        ({"x-stainless-read-timeout": "600"}, False, ClientHints(Priority.NORMAL, 600.0, None)),
        ({"x-stainless-read-timeout": "30"}, True, ClientHints(Priority.NORMAL, None, 30.0)),
        # kvgate's own headers win over the SDK's.
        (
            {"x-stainless-read-timeout": "30", "x-kvgate-deadline-ms": "5000"},
            True,
            ClientHints(Priority.NORMAL, 5.0, None),
        ),
        ({"x-stainless-read-timeout": "soon"}, False, ClientHints(Priority.NORMAL, None, None)),
        ({"x-stainless-read-timeout": "-1"}, False, ClientHints(Priority.NORMAL, None, None)),
    ],
)
def test_parse(headers: dict[str, str], streaming: bool, expected: ClientHints) -> None:
    assert parse_hints(headers, streaming=streaming) == expected


@pytest.mark.parametrize(
    ("headers", "header"),
    [
        ({"x-kvgate-priority": "urgent"}, "x-kvgate-priority"),
        ({"x-kvgate-deadline-ms": "ten"}, "x-kvgate-deadline-ms"),
        ({"x-kvgate-deadline-ms": "0"}, "x-kvgate-deadline-ms"),
        ({"x-kvgate-ttft-ms": "-5"}, "x-kvgate-ttft-ms"),
        ({"x-kvgate-ttft-ms": "inf"}, "x-kvgate-ttft-ms"),
        ({"x-kvgate-ttft-ms": "1e12"}, "x-kvgate-ttft-ms"),
    ],
)
def test_malformed_headers_name_themselves(headers: dict[str, str], header: str) -> None:
    with pytest.raises(HintError) as error:
        parse_hints(headers, streaming=False)
    assert error.value.header == header


@pytest.mark.parametrize(
    ("raw", "tokens"),
    [
        ("1", 1),
        ("256", 256),
        (" 40 ", 40),  # whitespace around a value is not part of it
        ("007", 7),
        ("0" * 200 + "12", 12),
        (str(MAX_EXPECTED_OUTPUT_TOKENS), MAX_EXPECTED_OUTPUT_TOKENS),
    ],
)
def test_the_expected_output_length(raw: str, tokens: int) -> None:
    hints = parse_hints({EXPECTED_OUTPUT_HEADER: raw, "x-kvgate-deadline-ms": "5000"}, streaming=True)
    assert hints == ClientHints(Priority.NORMAL, 5.0, None, tokens)


def test_no_expected_output_length_leaves_it_to_the_model() -> None:
    assert parse_hints({}, streaming=False).expected_output_tokens is None


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "0",
        "000",
        "-3",
        "+5",
        "12.5",
        "12.0",
        "1e3",
        "5_000",
        "0x10",
        "ten",
        "4 2",
        "\u0664\u0662",  # another script's digits: int() takes them, the header takes ASCII
        str(MAX_EXPECTED_OUTPUT_TOKENS + 1),
        "9" * 5000,  # past int()'s digit limit: still a 400, not a 500
    ],
)
def test_a_malformed_expected_output_length_names_its_header(raw: str) -> None:
    with pytest.raises(HintError) as error:
        parse_hints({EXPECTED_OUTPUT_HEADER: raw}, streaming=False)
    assert error.value.header == EXPECTED_OUTPUT_HEADER == "x-kvgate-expected-output-tokens"
    assert EXPECTED_OUTPUT_HEADER in error.value.message


TOKEN = "prio-token-5521"


@pytest.mark.parametrize(
    ("configured", "offered", "header", "expected"),
    [
        # Off (no token configured): nobody raises; a token sent to it is no token at all.
        (None, None, "high", Priority.NORMAL),
        (None, TOKEN, "high", Priority.NORMAL),
        (None, None, "low", Priority.LOW),
        # A token configured: only its holders raise; anyone lowers.
        (TOKEN, None, "high", Priority.NORMAL),
        (TOKEN, TOKEN, "high", Priority.HIGH),
        (TOKEN, f" {TOKEN} ", "high", Priority.HIGH),
        (TOKEN, None, "low", Priority.LOW),
        (TOKEN, TOKEN, "normal", Priority.NORMAL),
    ],
)
def test_raising_priority_takes_the_token(
    configured: str | None, offered: str | None, header: str, expected: Priority
) -> None:
    headers = {"x-kvgate-priority": header}
    if offered is not None:
        headers[PRIORITY_TOKEN_HEADER] = offered
    assert parse_hints(headers, streaming=False, priority_token=configured).priority is expected


@pytest.mark.parametrize("offered", ["", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()])
def test_a_wrong_priority_token_is_refused(offered: str) -> None:
    with pytest.raises(PermissionDeniedError) as error:
        parse_hints({PRIORITY_TOKEN_HEADER: offered}, streaming=False, priority_token=TOKEN)
    assert (error.value.status, error.value.code) == (403, "invalid_priority_token")
    assert TOKEN not in error.value.message


# vLLM reads `priority` as a lax int: numbers, integral floats and numeric strings.
RAISED = [-1, -1.0, -(2**63), -math.inf, "-1", " -5", "-0x1"]
NOT_RAISED = [0, 1, 10**6, 0.0, 2.5, True, False, "3", "", "high", [], {}, None, math.nan]


@pytest.mark.parametrize("value", RAISED, ids=repr)
def test_a_raised_vllm_priority_takes_the_token(value: object) -> None:
    with pytest.raises(PermissionDeniedError) as error:
        parse_hints({}, streaming=False, body_priority=value)
    assert (error.value.param, error.value.code) == ("priority", "priority_not_allowed")
    with pytest.raises(PermissionDeniedError):
        parse_hints({}, streaming=False, priority_token=TOKEN, body_priority=value)
    held = parse_hints(
        {PRIORITY_TOKEN_HEADER: TOKEN}, streaming=False, priority_token=TOKEN, body_priority=value
    )
    assert held.priority is Priority.NORMAL


@pytest.mark.parametrize("value", NOT_RAISED, ids=repr)
def test_other_vllm_priorities_pass_for_anyone(value: object) -> None:
    assert parse_hints({}, streaming=False, body_priority=value).priority is Priority.NORMAL


INF = math.inf


@pytest.mark.parametrize(
    ("hints", "service", "expected"),
    [
        (ClientHints(Priority.NORMAL, None, None), NO_SERVICE_ESTIMATE, 130.0),
        (ClientHints(Priority.NORMAL, 10.0, None), NO_SERVICE_ESTIMATE, 110.0),
        (ClientHints(Priority.NORMAL, 10.0, None), ServiceEstimate(0.5, 4.0), 106.0),
        # Both headers: the client waits for its whole answer; the first-token time says
        # nothing about when it gives up.
        (ClientHints(Priority.NORMAL, 10.0, 2.0), ServiceEstimate(0.5, 4.0), 106.0),
        # A first-token time alone is where the client gives up: the deadline.
        (ClientHints(Priority.NORMAL, None, 2.0), ServiceEstimate(0.5, 4.0), 101.5),
        # Never past the class's queue timeout.
        (ClientHints(Priority.NORMAL, 100.0, None), NO_SERVICE_ESTIMATE, 130.0),
        (ClientHints(Priority.NORMAL, None, 100.0), NO_SERVICE_ESTIMATE, 130.0),
    ],
)
def test_queue_deadline(hints: ClientHints, service: ServiceEstimate, expected: float) -> None:
    assert queue_deadline(100.0, hints, 30.0, service) == pytest.approx(expected)

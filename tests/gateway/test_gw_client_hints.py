"""Client hints: priority and deadline headers, the SDK's read timeout, queue deadlines."""

from __future__ import annotations

import math

import pytest

from gateway.admission import Priority
from gateway.client_hints import (
    NO_SERVICE_ESTIMATE,
    ClientHints,
    HintError,
    ServiceEstimate,
    parse_hints,
    queue_deadline,
)


@pytest.mark.parametrize(
    ("headers", "streaming", "expected"),
    [
        ({}, False, ClientHints(Priority.NORMAL, None, None)),
        ({"x-kvgate-priority": "HIGH "}, False, ClientHints(Priority.HIGH, None, None)),
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
    ("hints", "service", "expected"),
    [
        (ClientHints(Priority.NORMAL, None, None), NO_SERVICE_ESTIMATE, 130.0),
        (ClientHints(Priority.NORMAL, 10.0, None), NO_SERVICE_ESTIMATE, 110.0),
        (ClientHints(Priority.NORMAL, 10.0, None), ServiceEstimate(0.5, 4.0), 106.0),
        (ClientHints(Priority.NORMAL, 10.0, 2.0), ServiceEstimate(0.5, 4.0), 101.5),
        (ClientHints(Priority.NORMAL, 100.0, None), NO_SERVICE_ESTIMATE, 130.0),  # queue timeout caps it
    ],
)
def test_queue_deadline(hints: ClientHints, service: ServiceEstimate, expected: float) -> None:
    assert queue_deadline(100.0, hints, 30.0, service) == pytest.approx(expected)


def test_margin_scales_the_service_time() -> None:
    hints = ClientHints(Priority.NORMAL, 10.0, None)
    assert queue_deadline(0.0, hints, math.inf, ServiceEstimate(1.0, 4.0), margin=0.5) == pytest.approx(8.0)
    assert queue_deadline(0.0, hints, math.inf, ServiceEstimate(1.0, 4.0), margin=0.0) == pytest.approx(10.0)

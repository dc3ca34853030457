"""Client hints: priority and deadline headers, the SDK's read timeout, queue deadlines."""

from __future__ import annotations

import math

import pytest

from gateway.admission import Priority
from gateway.client_hints import (
    NO_SERVICE_ESTIMATE,
    ClientHints,
    HintError,
    QueueDeadlines,
    ServiceEstimate,
    parse_hints,
    queue_deadlines,
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


INF = math.inf


@pytest.mark.parametrize(
    ("hints", "service", "expected"),
    [
        (ClientHints(Priority.NORMAL, None, None), NO_SERVICE_ESTIMATE, QueueDeadlines(130.0, 130.0)),
        (ClientHints(Priority.NORMAL, 10.0, None), NO_SERVICE_ESTIMATE, QueueDeadlines(110.0, 110.0)),
        (ClientHints(Priority.NORMAL, 10.0, None), ServiceEstimate(0.5, 4.0), QueueDeadlines(106.0, 106.0)),
        # Both headers: the first-token time is an objective, the whole-answer time the deadline.
        (ClientHints(Priority.NORMAL, 10.0, 2.0), ServiceEstimate(0.5, 4.0), QueueDeadlines(106.0, 101.5)),
        # A first-token time alone is where the client gives up: the deadline too.
        (ClientHints(Priority.NORMAL, None, 2.0), ServiceEstimate(0.5, 4.0), QueueDeadlines(101.5, 101.5)),
        # The objective never lies past the deadline.
        (ClientHints(Priority.NORMAL, 3.0, 2.0), ServiceEstimate(0.5, 2.0), QueueDeadlines(101.0, 101.0)),
        (ClientHints(Priority.NORMAL, 100.0, None), NO_SERVICE_ESTIMATE, QueueDeadlines(130.0, 130.0)),
    ],
)
def test_queue_deadlines(hints: ClientHints, service: ServiceEstimate, expected: QueueDeadlines) -> None:
    got = queue_deadlines(100.0, hints, 30.0, service)
    assert got.hard_at == pytest.approx(expected.hard_at)
    assert got.objective_at == pytest.approx(expected.objective_at)


def test_margin_scales_the_service_time() -> None:
    hints = ClientHints(Priority.NORMAL, 10.0, None)
    assert queue_deadlines(0.0, hints, INF, ServiceEstimate(1.0, 4.0), margin=0.5).hard_at == pytest.approx(
        8.0
    )
    assert queue_deadlines(0.0, hints, INF, ServiceEstimate(1.0, 4.0), margin=0.0).hard_at == pytest.approx(
        10.0
    )

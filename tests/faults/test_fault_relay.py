"""The relay against clients and backends that misbehave on the wire.

- A client that disconnects in the middle of its request body: a clean outcome (client gone,
  499 in the request log line), no traceback, nothing reserved.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator

from faultkit import Served, gateway_idle, poll_until, recording_backend, served_gateway


class Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def requests(self) -> list[dict[str, object]]:
        """The fields of the request log lines."""
        return [dict(r.kvgate_fields) for r in self.records if r.name == "kvgate.requests"]

    def errors(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= logging.ERROR]


@contextlib.contextmanager
def captured_logs() -> Iterator[Records]:
    """Every record of kvgate's loggers and of uvicorn's (which do not propagate to the root)."""
    handler = Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    root = loggers[0]
    level = root.level
    root.setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        root.setLevel(level)


def open_request(url: str, head: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head)
    return sock


def test_a_client_that_leaves_mid_body_is_a_clean_client_gone() -> None:
    with recording_backend() as (backend, url), served_gateway(url) as kvgate, captured_logs() as logs:
        declared = 1 << 20
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n"
            f"content-length: {declared}\r\n\r\n"
        ).encode()
        sock = open_request(kvgate.url, head)
        with sock:
            sock.sendall(b'{"model": "tiny-llama", "prompt": "' + b"a" * (declared // 2))
        poll_until(lambda: bool(logs.requests()), what="the request line")
        [line] = logs.requests()
        assert (line["outcome"], line["status"], line["code"]) == ("client_gone", 499, "client_left_mid_body")
        assert logs.errors() == [], [r.getMessage() for r in logs.errors()]
        kvgate.wait_until(gateway_idle, what="nothing reserved")
        assert backend.generation() == []
        assert outcomes(kvgate)["client_gone"] == 1
        assert kvgate.call(lambda: kvgate.gateway.queue.stats.admitted) == 0


def outcomes(kvgate: Served) -> dict[str, int]:
    counts: dict[str, int] = kvgate.call(
        lambda: {o.value: n for o, n in kvgate.gateway.recent.counts().items()}
    )
    return counts

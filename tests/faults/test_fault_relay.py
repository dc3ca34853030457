"""The relay against clients and backends that misbehave on the wire.

- A client that stops reading its stream: the client write timeout ends the request, the
  backend is told to stop (the emulator aborts it), the reservation is released and the request
  line says why; the connection ends with a reset (kvgate's socket and its buffers gone at
  once) and no ERROR line. A client that only pauses keeps its stream, and its pause is not learned as
  the backend's pace.
- A backend that sends a plain answer of 200+ MB slowly: relayed as it comes with kvgate's
  memory bounded by a small multiple of its read buffer, every byte delivered, usage learned;
  broken off after bytes went out, the client sees a reset, never a clean end (under
  `kvgate serve` too). And the real testbed's
  answers of megabytes (echo with logprobs, chat with prompt_logprobs after its usage): whole,
  and their usage learned as vLLM counted it.
- A backend that reports negative, mistyped, huge or absurd usage: the answer is relayed as it
  is, the request completes with a request line that says so, nothing learns from the counts.
- A client that disconnects in the middle of its request body: a clean outcome (client gone,
  499 in the request log line), no traceback, nothing reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import (
    RECORDER_METRICS,
    Served,
    gateway_idle,
    kvgate_process,
    ledger_balanced,
    poll_until,
    recording_backend,
    served_gateway,
    sim_state,
)

from estimator.tokens import TokenCounter
from gateway.proxy import PLAIN_HOLD_BYTES
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import SimServer, running_sim_server, serving

# Room for a few long streams; 4 ms a step: 1,000 tokens take about 4 s to generate.
LONG_STEPS = EngineConfig(
    num_blocks=4096,
    block_size=16,
    max_model_len=2048,
    max_num_seqs=64,
    step_cost=StepCost(base_s=0.004, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
)
# 8 sequences x 1,000 tokens: about 1.3 MB of events, several times what the buffers between
# the engine and a client that does not read can hold.
WIDE_STREAM: dict[str, Any] = {
    "model": "tiny-llama",
    "prompt": "go",
    "max_tokens": 1000,
    "n": 8,
    "ignore_eos": True,
    "stream": True,
}
SMALL_BUFFER_BYTES = 16 * 1024
# The thread that serves a hostile backend (its server's log records are its own).
HOSTILE_THREAD = "hostile-backend"


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

    def request_ids(self) -> list[str | None]:
        """The request ids of the request log lines."""
        return [getattr(r, "request_id", None) for r in self.records if r.name == "kvgate.requests"]

    def resets(self) -> list[tuple[int, str | None]]:
        """The level and request id of each record of a connection reset."""
        return [
            (r.levelno, getattr(r, "request_id", None))
            for r in self.records
            if r.getMessage().startswith("connection reset:")
        ]

    def errors(self) -> list[logging.LogRecord]:
        """kvgate's ERROR records (not those of the stand-in backend's server)."""
        return [r for r in self.records if r.levelno >= logging.ERROR and r.threadName != HOSTILE_THREAD]


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


def open_request(url: str, head: bytes, *, receive_buffer_bytes: int | None = None) -> socket.socket:
    """A raw client connection that has sent `head`; a small receive buffer (set before
    connecting) keeps what the kernel holds for a client that does not read small."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    sock.sendall(head)
    return sock


def post_head(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        "POST /v1/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode() + payload


def read_into(sock: socket.socket, received: bytearray) -> None:
    while chunk := sock.recv(65536):
        received += chunk


def read_to_end(sock: socket.socket) -> bytes:
    received = bytearray()
    while chunk := sock.recv(65536):
        received += chunk
    return bytes(received)


# -- clients that stop reading --------------------------------------------------------------


@pytest.fixture
def long_sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=LONG_STEPS)) as server:
        yield server


def test_a_client_that_stops_reading_is_timed_out_and_its_request_aborted(long_sim: SimServer) -> None:
    with (
        served_gateway(
            long_sim.url, client_write_timeout_s=0.5, send_buffer_bytes=SMALL_BUFFER_BYTES
        ) as kvgate,
        captured_logs() as logs,
    ):
        sock = open_request(kvgate.url, post_head(WIDE_STREAM), receive_buffer_bytes=SMALL_BUFFER_BYTES)
        with sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            # The client reads no more. Once the buffers between it and the engine are full,
            # kvgate's write blocks, and half a second later the request ends.
            kvgate.wait_until(gateway_idle, timeout_s=30, what="the reservation to be released")
            state = sim_state(long_sim.url)
            assert (state["num_running"], state["open_responses"]) == (0, 0)
            # Aborted, not finished: the engine stopped well short of 8 x 1,000 tokens.
            assert state["generation_tokens_total"] < 8 * 1000
            [line] = logs.requests()
            assert (line["outcome"], line["code"]) == ("client_gone", "client_write_timeout")
            # kvgate's end of the connection is gone, descriptor and kernel buffers alike (a
            # graceful close would keep them while the client stays), though the client has
            # not closed its own.
            poll_until(lambda: not server_ends(kvgate, sock), what="kvgate's end of the connection to go")
            # What the client gets if it ever reads again: what its own buffer held, then a
            # reset (no [DONE], no terminating chunk, no clean end).
            with pytest.raises(ConnectionResetError):
                read_to_end(sock)
        assert outcomes(kvgate)["client_gone"] == 1
    assert_resets_logged_below_error(logs)


def server_ends(kvgate: Served, client: socket.socket) -> list[str]:
    """The TCP states (hex, as the kernel lists them) of kvgate's ends of connections to
    `client`: while kvgate holds the socket, or the kernel still holds its unsent bytes
    after a graceful close, it is listed."""
    kvgate_port = int(kvgate.url.rsplit(":", 1)[1])
    client_port = client.getsockname()[1]
    states = []
    with open("/proc/net/tcp") as table:
        next(table)
        for row in table:
            local, remote, state = row.split()[1:4]
            if int(local.split(":")[1], 16) == kvgate_port and int(remote.split(":")[1], 16) == client_port:
                states.append(state)
    return states


def assert_resets_logged_below_error(logs: Records) -> None:
    """No ERROR record (uvicorn's "returned without completing response" included), and an
    INFO record of a reset for each request, tagged with its id."""
    assert [r.getMessage() for r in logs.errors()] == []
    assert logs.resets() == [(logging.INFO, request_id) for request_id in logs.request_ids()]


def test_a_client_that_pauses_keeps_its_stream_and_the_pace_ignores_the_pause(long_sim: SimServer) -> None:
    with served_gateway(long_sim.url, send_buffer_bytes=SMALL_BUFFER_BYTES) as kvgate:
        pace = kvgate.gateway.pace
        # A reader that keeps up (one sequence, slow enough for a client thread on a loaded
        # machine) teaches the time per token.
        steady = {**WIDE_STREAM, "max_tokens": 50, "n": 1}
        plain = httpx.post(f"{kvgate.url}/v1/completions", json=steady, timeout=30)
        assert plain.status_code == 200
        kvgate.wait_until(gateway_idle, what="the first stream to end")
        learned = kvgate.call(lambda: pace.seconds_per_output_token.count)
        assert learned == 1
        sock = open_request(kvgate.url, post_head(WIDE_STREAM), receive_buffer_bytes=SMALL_BUFFER_BYTES)
        with sock:
            received = sock.recv(4096)
            # The client pauses until the engine has finished: kvgate's writes to it were
            # blocked for most of the stream (the default write timeout is far off).
            poll_until(lambda: sim_state(long_sim.url)["num_running"] == 0, 30, "the engine to finish")
            received += read_to_end(sock)
        kvgate.wait_until(gateway_idle, what="the stream to end")
        assert received.count(b"[DONE]") == 1
        assert outcomes(kvgate)["completed"] == 2
        # The paused stream's time per token was the client's: not learned.
        assert kvgate.call(lambda: pace.seconds_per_output_token.count) == learned


# -- a backend that answers at length, or with garbage ----------------------------------------


Answer = Callable[[dict[str, Any], Any], Any]


@dataclass
class HostileBackend:
    """An ASGI stand-in for vLLM: /v1/models and /metrics as vLLM answers them, generation
    requests by `answer(body, send)`; records whether kvgate hung up on it."""

    answer: Answer
    hung_up: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = bytearray()
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            models = {"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 4096}]}
            await _whole(send, json.dumps(models).encode(), b"application/json")
        elif scope["path"] == "/metrics":
            await _whole(send, RECORDER_METRICS.encode(), b"text/plain")
        else:
            try:
                await self.answer(json.loads(raw), send)
            except OSError:
                self.hung_up.set()


async def _whole(send: Any, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def hostile_backend(answer: Answer) -> Iterator[tuple[HostileBackend, str]]:
    backend = HostileBackend(answer)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        with serving(backend, sock, name=HOSTILE_THREAD):
            yield backend, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


# The huge answer: a completion whose text runs to HUGE_TEXT_BYTES, sent in CHUNK_BYTES writes
# with a pause every few (a slow backend), usage last as vLLM writes it.
HUGE_TEXT_BYTES = 200 * 1024 * 1024
CHUNK_BYTES = 64 * 1024
HUGE_HEAD = (
    b'{"id":"cmpl-huge","object":"text_completion","model":"tiny-llama","choices":[{"index":0,"text":"'
)
HUGE_TAIL = (
    b'","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10,"prompt_tokens_details":null}}'
)


def huge_pieces(cut_after_bytes: int | None = None) -> Iterator[bytes]:
    """The huge answer's bytes, piece by piece (the same every time); stops after about
    `cut_after_bytes` when given."""
    yield HUGE_HEAD
    sent = len(HUGE_HEAD)
    filler = b"abcdefghijklmnop" * (CHUNK_BYTES // 16)
    for _ in range(HUGE_TEXT_BYTES // CHUNK_BYTES):
        if cut_after_bytes is not None and sent >= cut_after_bytes:
            return
        yield filler
        sent += len(filler)
    yield HUGE_TAIL


HUGE_LENGTH = sum(len(piece) for piece in huge_pieces())


def huge_answer(cut_after_bytes: int | None = None) -> Answer:
    async def answer(body: dict[str, Any], send: Any) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(HUGE_LENGTH).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for number, piece in enumerate(huge_pieces(cut_after_bytes)):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if number % 16 == 0:
                await asyncio.sleep(0.001)
        if cut_after_bytes is not None:
            raise OSError("the backend dies mid-answer")  # uvicorn drops the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return answer


def peak_rss_reset() -> int:
    """Reset this process's peak resident size (VmHWM) to its current size; returns it (KiB)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return rss_kib("VmRSS")


def rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field_name} in /proc/self/status")


def test_a_huge_plain_answer_is_relayed_as_it_comes_in_bounded_memory() -> None:
    expected = hashlib.sha256()
    for piece in huge_pieces():
        expected.update(piece)
    body = {"model": "tiny-llama", "prompt": "echo me", "max_tokens": 7, "echo": True, "logprobs": 5}
    with hostile_backend(huge_answer()) as (_, url), served_gateway(url) as kvgate, captured_logs() as logs:
        received = hashlib.sha256()
        length = 0
        baseline_kib = peak_rss_reset()
        with httpx.stream("POST", f"{kvgate.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            assert response.headers["content-length"] == str(HUGE_LENGTH)
            for chunk in response.iter_raw(CHUNK_BYTES):
                received.update(chunk)
                length += len(chunk)
        growth_kib = rss_kib("VmHWM") - baseline_kib
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
        [line] = logs.requests()
        learned = kvgate.call(lambda: kvgate.gateway.output_model.describe())
    assert (length, received.hexdigest()) == (HUGE_LENGTH, expected.hexdigest())
    # The process (backend, kvgate and client alike) grew by a small multiple of what kvgate
    # holds for one answer, not by the answer's 200 MB.
    bound_kib = 32 * PLAIN_HOLD_BYTES // 1024
    print(
        f"{HUGE_LENGTH / 2**20:.0f} MB answer relayed; peak RSS growth {growth_kib} KiB (bound {bound_kib} KiB)"
    )
    assert growth_kib < bound_kib
    assert (line["outcome"], line["completion_tokens"], line["code"]) == ("completed", 7, None)
    assert learned["tiny-llama/completions"] == {"samples": 1, "quantile_tokens": 7}


def test_a_huge_answer_broken_off_is_truncated_for_the_client() -> None:
    with (
        hostile_backend(huge_answer(cut_after_bytes=4 * PLAIN_HOLD_BYTES)) as (_, url),
        served_gateway(url) as kvgate,
        captured_logs() as logs,
    ):
        sock = open_request(kvgate.url, post_head({"prompt": "x"}))
        received = bytearray()
        with sock, pytest.raises(ConnectionResetError):  # not a clean end, length or no length
            read_into(sock, received)
        # The answer had begun; the reset drops what was still on its way (the answer is
        # broken anyway), so the client may get less than kvgate sent.
        assert received.startswith(b"HTTP/1.1 200")
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
        [line] = logs.requests()
        assert (line["outcome"], line["code"]) == ("upstream_error", "upstream_truncated")
        with httpx.stream(
            "POST", f"{kvgate.url}/v1/completions", json={"prompt": "x"}, timeout=30
        ) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.ReadError):  # httpx's name for a reset
                for _ in response.iter_raw():
                    pass
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
    assert len(logs.requests()) == 2
    assert_resets_logged_below_error(logs)


def test_kvgate_serve_resets_a_huge_answer_broken_off(tmp_path: Path) -> None:
    """The same under `kvgate serve` itself (its event loop is uvloop where installed)."""
    with (
        hostile_backend(huge_answer(cut_after_bytes=4 * PLAIN_HOLD_BYTES)) as (_, url),
        kvgate_process(url, tmp_path / "kvgate.log", settings={"log_level": "info"}) as kvgate,
    ):
        sock = open_request(kvgate.url, post_head({"prompt": "x"}))
        received = bytearray()
        with sock, pytest.raises(ConnectionResetError):
            read_into(sock, received)
        assert received.startswith(b"HTTP/1.1 200")
        poll_until(lambda: ledger_balanced(kvgate.state()), what="the ledger to balance")
        poll_until(lambda: "connection reset:" in kvgate.output(), what="the reset's log line")
        output = kvgate.output()
    assert "upstream_truncated" in output
    assert " ERROR " not in output
    assert "without completing response" not in output


def test_a_plain_answer_broken_off_early_is_still_a_clean_502() -> None:
    with (
        hostile_backend(huge_answer(cut_after_bytes=PLAIN_HOLD_BYTES // 4)) as (_, url),
        served_gateway(url) as kvgate,
    ):
        response = httpx.post(f"{kvgate.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_failed"
        kvgate.wait_until(gateway_idle, what="the ledger to balance")


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("path", "body"),
    [
        # Four prompts echoed with 20 logprobs per token: about 2.6 MB.
        ("/v1/completions", {"prompt": ["word " * 300] * 4, "max_tokens": 8, "echo": True, "logprobs": 20}),
        # vLLM writes a chat answer's usage before its prompt_logprobs: about 1 MB after it.
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "word " * 600}],
                "max_tokens": 8,
                "prompt_logprobs": 20,
            },
        ),
    ],
    ids=["echo-logprobs", "chat-prompt-logprobs"],
)
def test_vllm_answers_of_megabytes_are_relayed_whole_and_their_usage_learned(
    vllm_url: str, tiny_model_dir: Path, path: str, body: dict[str, Any]
) -> None:
    counter = TokenCounter.from_pretrained(str(tiny_model_dir), max_model_len=1024)
    with served_gateway(vllm_url, counter=counter) as kvgate, captured_logs() as logs:
        response = httpx.post(f"{kvgate.url}{path}", json={"model": "tiny-llama", **body}, timeout=120)
        assert response.status_code == 200, response.text[:300]
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
        [line] = logs.requests()
    assert len(response.content) > 2 * PLAIN_HOLD_BYTES  # relayed as it came, not held whole
    usage = response.json()["usage"]  # the answer is whole: it parses
    assert (line["outcome"], line["code"]) == ("completed", None)
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["prompt_tokens"] == usage["prompt_tokens"]  # kvgate's own count, exact


GARBAGE_USAGE: list[Any] = [
    {"prompt_tokens": 3, "completion_tokens": -5},
    {"prompt_tokens": 3, "completion_tokens": True},
    {"prompt_tokens": 3, "completion_tokens": 2.5},
    {"prompt_tokens": 3, "completion_tokens": "7"},
    {"prompt_tokens": 3, "completion_tokens": 10**30},
    {"prompt_tokens": 10**9, "completion_tokens": 7},  # more than any prompt of the model
    {"prompt_tokens": 3, "completion_tokens": 9000},  # more than the context for one sequence
    {"prompt_tokens": -1, "completion_tokens": 7},
    "seven",
]


def usage_answer(usage: Any, *, omit: bool = False) -> Answer:
    async def answer(body: dict[str, Any], send: Any) -> None:
        extra = {} if omit else {"usage": usage}
        if not body.get("stream"):
            payload = {
                "id": "cmpl-1",
                "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                **extra,
            }
            await _whole(send, json.dumps(payload).encode(), b"application/json")
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = [{"choices": [{"index": 0, "text": t}]} for t in "abc"]
        events.append({"choices": [], **extra})
        for event in events:
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("usage", GARBAGE_USAGE, ids=lambda usage: json.dumps(usage)[:40])
def test_garbage_usage_is_relayed_but_never_learned(usage: Any, stream: bool) -> None:
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 8, "stream": stream}
    with (
        hostile_backend(usage_answer(usage)) as (_, url),
        served_gateway(url) as kvgate,
        captured_logs() as logs,
    ):
        response = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200
        assert json.dumps(usage) in response.text  # relayed as the backend sent it
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
        [line] = logs.requests()
        assert (line["outcome"], line["status"], line["code"]) == ("completed", 200, "backend_usage_invalid")
        assert line["completion_tokens"] is None
        assert [
            r.getMessage()
            for r in logs.records
            if r.levelno == logging.WARNING and "unusable" in r.getMessage()
        ]
        assert logs.errors() == []
        gateway = kvgate.gateway
        assert kvgate.call(lambda: gateway.output_model.describe()) == kvgate.call(
            lambda: type(gateway.output_model)(quantile=0.9, min_samples=20, window=1000).describe()
        )
        assert kvgate.call(lambda: gateway.pace.seconds_per_output_token.count) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_missing_usage_is_a_clean_completion(stream: bool) -> None:
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 8, "stream": stream}
    with (
        hostile_backend(usage_answer(None, omit=True)) as (_, url),
        served_gateway(url) as kvgate,
        captured_logs() as logs,
    ):
        response = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
        [line] = logs.requests()
        assert (line["outcome"], line["code"]) == ("completed", None)
        # A stream is counted as it passes; a plain answer without usage teaches nothing.
        assert line["completion_tokens"] == (3 if stream else None)
        assert logs.errors() == []


# -- clients that leave mid-body --------------------------------------------------------------


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

"""The backend hangs: it does not accept the connection, accepts and never answers, answers too
late, or stalls in the middle of a stream. And clients hang: they trickle their request's head
or body (slowloris), or hold connections open without a word.

What must happen: the configured connect, first-byte and between-chunk timeouts end each case
with 504 (as an OpenAI error, or as an SSE error event once a stream has begun), nothing waits
forever, the backend is told that nobody waits any more (its request is released), and every
reservation is completed.

For clients: a head not complete within `header_timeout_s` closes the connection (408 when
part of a request came), a body not received within `body_timeout_s` gets 408, an idle
keep-alive connection is closed, and past `max_client_connections` a new connection gets 503
at once, while ordinary requests go on being served.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import (
    LONG_STREAM,
    SLOW_STEPS,
    KvgateProcess,
    Served,
    SimProcess,
    clear_faults,
    gateway_idle,
    kvgate_process,
    poll_until,
    served_gateway,
    set_faults,
    sim_process,
    sim_state,
    sse_events,
)

from gateway.lifecycle import CLIENT_KEEPALIVE_TIMEOUT_S
from sim.config import SimConfig
from sim.testing import SimServer, running_sim_server

TIMEOUT_S = 0.5
# Generous: the machine is shared; what matters is that the wait is bounded by the timeout.
SLACK_S = 1.5
PLAIN = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 20}


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=SLOW_STEPS)) as server:
        yield server


@pytest.fixture
def kvgate(sim: SimServer) -> Iterator[Served]:
    with served_gateway(
        sim.url,
        connect_timeout_s=TIMEOUT_S,
        first_byte_timeout_s=TIMEOUT_S,
        between_chunk_timeout_s=TIMEOUT_S,
    ) as served:
        yield served


def released(kvgate: Served, sim: SimServer) -> None:
    kvgate.wait_until(gateway_idle, timeout_s=3, what="the reservation released")
    poll_until(lambda: sim_state(sim.url)["open_responses"] == 0, 3, "the backend to see the client leave")


def timed_post(url: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    return response, time.monotonic() - started


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    "faults",
    [
        pytest.param({"hang": True}, id="never-answers"),
        pytest.param({"first_byte_delay_s": 3.0}, id="answers-late"),
    ],
)
def test_no_answer_in_time_is_a_504(
    kvgate: Served, sim: SimServer, faults: dict[str, Any], stream: bool
) -> None:
    set_faults(sim.url, **faults)
    response, took = timed_post(kvgate.url, {**PLAIN, "stream": stream})
    assert response.status_code == 504
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_timeout")
    assert TIMEOUT_S <= took < TIMEOUT_S + SLACK_S
    if faults.get("hang"):
        released(kvgate, sim)
    else:
        kvgate.wait_until(gateway_idle, timeout_s=3, what="the reservation released")
    clear_faults(sim.url)
    # The budget was not touched: a timeout is not a sign that the backend is gone.
    assert kvgate.call(lambda: kvgate.gateway.snapshot().state.value) == "fresh"


def test_a_stream_that_stalls_ends_with_an_error_event(kvgate: Served, sim: SimServer) -> None:
    set_faults(sim.url, stall_after_tokens=3)
    started = time.monotonic()
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{kvgate.url}/v1/completions", json=LONG_STREAM) as response,
    ):
        assert response.status_code == 200
        events = sse_events("".join(response.iter_text()))
    took = time.monotonic() - started
    assert len(events) == 4  # three tokens, then the error
    assert all(json.loads(event)["choices"] for event in events[:3])
    error = json.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("upstream_error", 504)
    assert took < TIMEOUT_S + SLACK_S
    released(kvgate, sim)
    # Without a stream the same stall is a wait for the first byte that never comes.
    response, took = timed_post(kvgate.url, {**LONG_STREAM, "stream": False})
    assert response.status_code == 504
    released(kvgate, sim)


class Gatekeeper:
    """A TCP forwarder in front of the emulator that can stop accepting connections: with its
    accept queue full, new connections hang in the handshake, as on an overloaded host. The
    connections it accepted before keep working (kvgate's metrics scrapes go on)."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=1)
        self.port: int = self._listener.getsockname()[1]
        self._accepting = threading.Event()
        self._accepting.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            self._accepting.wait()
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def stop_accepting(self) -> list[socket.socket]:
        """Stop accepting and fill the accept queue; returns the fillers (close them after)."""
        self._accepting.clear()
        # Unblock the pending accept() with one connection it will forward, then fill the queue
        # until a connection attempt goes unanswered: from then on the kernel drops new SYNs
        # (a handshake begun before the queue was full could still complete from the client's
        # side, so each filler completes before the next one starts).
        accepted = len(self._sockets)
        fillers = [socket.create_connection(("127.0.0.1", self.port))]
        poll_until(lambda: len(self._sockets) > accepted, 5, "the last accept")
        for _ in range(16):
            filler = socket.socket()
            filler.settimeout(0.3)
            try:
                filler.connect(("127.0.0.1", self.port))
            except OSError:
                filler.close()
                return fillers
            fillers.append(filler)
        raise AssertionError("the accept queue never filled")

    def close(self) -> None:
        self._closed = True
        self._accepting.set()
        self._listener.close()
        for sock in self._sockets:
            sock.close()


def test_a_backend_that_does_not_accept_is_a_504_after_the_connect_timeout(sim: SimServer) -> None:
    gatekeeper = Gatekeeper(int(sim.url.rsplit(":", 1)[1]))
    try:
        with served_gateway(
            f"http://127.0.0.1:{gatekeeper.port}", connect_timeout_s=TIMEOUT_S, first_byte_timeout_s=5.0
        ) as kvgate:
            fillers = gatekeeper.stop_accepting()
            try:
                response, took = timed_post(kvgate.url, PLAIN)
                assert response.status_code == 504, response.text
                assert "connecting to the backend" in response.json()["error"]["message"]
                assert TIMEOUT_S <= took < TIMEOUT_S + SLACK_S
                kvgate.wait_until(gateway_idle, timeout_s=3, what="the reservation released")
                # The scrapes on the connection accepted before still work: the budget is fresh.
                assert kvgate.call(lambda: kvgate.gateway.snapshot().state.value) == "fresh"
            finally:
                for filler in fillers:
                    filler.close()
    finally:
        gatekeeper.close()


# -- clients that hang: slow or endless request heads and bodies (slowloris) ------------------

RECEIPT_TIMEOUT_S = 1.0
# A trickling client sends a byte this often: well within any timeout, so only a bound on the
# whole head or body can end it.
TRICKLE_S = 0.1
# It gives up trickling after this many bytes (ten times the timeout): kvgate must act first.
TRICKLE_MAX_BYTES = int(10 * RECEIPT_TIMEOUT_S / TRICKLE_S)
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n"


@pytest.fixture(scope="module")
def sim_proc() -> Iterator[SimProcess]:
    with sim_process(SimConfig()) as sim:
        yield sim


@pytest.fixture(scope="module")
def edge(sim_proc: SimProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateProcess]:
    """A real `kvgate serve` (its own HTTP protocol) with short receipt timeouts."""
    log = tmp_path_factory.mktemp("edge") / "kvgate.log"
    with kvgate_process(
        sim_proc.url,
        log,
        settings={"header_timeout_s": RECEIPT_TIMEOUT_S, "body_timeout_s": RECEIPT_TIMEOUT_S},
    ) as kvgate:
        yield kvgate


def connect(kvgate: KvgateProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", kvgate.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def trickle(sock: socket.socket, start: bytes, byte: bytes) -> tuple[bytes, int]:
    """Send `start`, then `byte` every TRICKLE_S until kvgate answers or closes; returns what
    it sent back (b"" for a bare close) and how many bytes were trickled."""
    sock.sendall(start)
    for sent in range(TRICKLE_MAX_BYTES):
        if select.select([sock], [], [], TRICKLE_S)[0]:
            return read_to_close(sock), sent
        try:
            sock.sendall(byte)
        except OSError:  # closed by kvgate between two bytes
            return b"", sent
    raise AssertionError(f"kvgate still read a trickle after {TRICKLE_MAX_BYTES} bytes")


def read_to_close(sock: socket.socket) -> bytes:
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def error_of(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower()
    return status, json.loads(body)["error"]


def test_a_trickled_head_is_cut_off_with_408(edge: KvgateProcess) -> None:
    with connect(edge) as sock:
        answer, _ = trickle(sock, HEAD, b"x")  # a header line that never ends
    status, error = error_of(answer)
    assert (status, error["code"]) == (408, "request_timeout")
    # A connection that sends nothing is closed without an answer (it may be a browser's
    # pre-connection); so is one that only ever sends blank lines.
    with connect(edge) as sock:
        assert trickle(sock, b"", b"")[0] == b""
    with connect(edge) as sock:
        assert trickle(sock, b"\r\n", b"\r\n")[0] == b""


def test_a_trickled_body_gets_408_and_the_connection_closes(edge: KvgateProcess) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
    start = HEAD + b"content-length: %d\r\n\r\n" % (len(body) + 1000) + body
    with connect(edge) as sock:
        answer, _ = trickle(sock, start, b" ")
    status, error = error_of(answer)
    assert (status, error["code"], error["type"]) == (408, "request_timeout", "invalid_request_error")
    assert "body" in error["message"]
    # A body the endpoint never reads cannot keep the connection either: the answer comes,
    # then the connection closes, however the rest of the body trickles.
    with connect(edge) as sock:
        answer, _ = trickle(sock, b"GET /healthz HTTP/1.1\r\nhost: k\r\ncontent-length: 100000\r\n\r\n", b".")
    assert answer.startswith(b"HTTP/1.1 200 ")


def test_an_idle_keep_alive_connection_is_closed(edge: KvgateProcess) -> None:
    with connect(edge) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: k\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the head and the body may come apart
            chunk = sock.recv(65536)
            assert chunk, "closed before the answer"
            first += chunk
        assert first.startswith(b"HTTP/1.1 200 ")
        # uvicorn's keep-alive timeout (5 s) closes it; the wait is bounded by the socket's.
        sock.settimeout(CLIENT_KEEPALIVE_TIMEOUT_S * 3)
        assert read_to_close(sock) == b""


def test_ordinary_requests_are_served_while_hundreds_of_slow_clients_hold_connections(
    sim_proc: SimProcess, tmp_path: Path
) -> None:
    """300 connections trickle heads and bodies (the timeouts are long here, so that they stay
    open); ordinary requests and /healthz are answered all along, and once past the bound on
    connections a new one is refused at once, which a freed one takes again."""
    slow = 300
    limit = slow + 20
    with kvgate_process(
        sim_proc.url,
        tmp_path / "kvgate.log",
        settings={"header_timeout_s": 120, "body_timeout_s": 120, "max_client_connections": limit},
    ) as kvgate:
        attackers = [connect(kvgate) for _ in range(slow)]
        try:
            for n, sock in enumerate(attackers):
                sock.sendall(HEAD if n % 2 else HEAD + b"content-length: 100000\r\n\r\n{")
            for _ in range(3):
                for sock in attackers:
                    sock.sendall(b"x" if attackers.index(sock) % 2 else b" ")
                plain = httpx.post(f"{kvgate.url}/v1/completions", json=PLAIN, timeout=30)
                assert plain.status_code == 200, plain.text
                assert httpx.get(f"{kvgate.url}/healthz", timeout=10).status_code == 200
            # Fill the remaining connections; the next one is refused with 503 at once.
            # (kvgate accepts them in its own time: one that it took before the last filler
            # counts as a filler, and the next is tried.)
            fillers = [connect(kvgate) for _ in range(limit - slow)]
            refusal = None
            for _ in range(limit - slow):
                sock = connect(kvgate)
                if not select.select([sock], [], [], 2.0)[0]:
                    fillers.append(sock)  # accepted as an ordinary connection
                    continue
                with sock:
                    refusal = error_of(read_to_close(sock))
                break
            assert refusal is not None, "no connection was refused past the bound"
            assert (refusal[0], refusal[1]["code"]) == (503, "too_many_connections")
            for sock in fillers:
                sock.close()
            poll_until(
                lambda: httpx.get(f"{kvgate.url}/healthz", timeout=10).status_code == 200,
                10,
                "a freed connection to serve again",
            )
            # All the while, the slow connections were held, not dropped.
            assert not any(select.select(attackers, [], [], 0)[0])
        finally:
            for sock in attackers:
                sock.close()

"""The backend hangs: it does not accept the connection, accepts and never answers, answers too
late, or stalls in the middle of a stream.

What must happen: the configured connect, first-byte and between-chunk timeouts end each case
with 504 (as an OpenAI error, or as an SSE error event once a stream has begun), nothing waits
forever, the backend is told that nobody waits any more (its request is released), and every
reservation is completed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from faultkit import (
    LONG_STREAM,
    SLOW_STEPS,
    Served,
    clear_faults,
    gateway_idle,
    poll_until,
    served_gateway,
    set_faults,
    sim_state,
    sse_events,
)

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

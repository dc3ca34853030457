"""Clients misbehave: they read their streams slowly, or leave all at once.

- Slow readers: a client that does not read must not make kvgate buffer its stream without
  bound. kvgate stops reading from the backend when a client stops reading (back-pressure):
  the bytes it holds for a stalled stream stay under a fixed bound (its upstream read buffer
  plus the server's write buffer), however long the stream, and the stream is whole once the
  client reads again.
- Disconnect storms: 500 clients abort at once, streaming and queued: the queue and the ledger
  are back to zero within a second, and the backend is told to stop every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from faultkit import (
    KvgateProcess,
    Served,
    SimProcess,
    gateway_idle,
    kvgate_process,
    ledger_balanced,
    poll_until,
    served_gateway,
    sim_state,
)

from gateway.upstream import READ_HIGH_WATER_BYTES
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import SimServer, running_sim_server

# Room for many long streams, at a fast step.
BIG_POOL = EngineConfig(
    num_blocks=4096,
    block_size=16,
    max_num_seqs=1024,
    max_num_batched_tokens=65536,
    step_cost=StepCost(base_s=0.001, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
)
# uvicorn stops a response's sender above this many bytes unwritten to the client
# (uvicorn.protocols.http.flow_control.HIGH_WATER_LIMIT); the rest waits in the kernel.
SERVER_WRITE_HIGH_WATER_BYTES = 64 * 1024


@pytest.fixture
def big_sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=BIG_POOL)) as server:
        yield server


def buffered_in_gateway(kvgate: Served) -> int:
    """Bytes kvgate holds in user space for its connections: what the upstream connections have
    read but not yet relayed, plus what the server's transports have not yet written."""

    def count() -> int:
        total = 0
        transports: dict[int, Any] = getattr(kvgate.loop, "_transports", {})
        for transport in list(transports.values()):
            if transport is None or transport.is_closing():
                continue
            total += transport.get_write_buffer_size()
            total += int(getattr(transport.get_protocol(), "_buffered", 0))
        return total

    result: int = kvgate.call(count)
    return result


def raw_request(url: str, body: dict[str, Any], *, receive_buffer_bytes: int) -> socket.socket:
    """Send a POST over a raw socket with a small receive buffer (set before connecting, so the
    kernel holds little on the client's side and kvgate's own buffering shows)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
        + payload
    )
    return sock


def test_a_stalled_reader_is_held_back_not_buffered(big_sim: SimServer) -> None:
    # One stream of 8 sequences x 1000 tokens: about 1.3 MB of events, several times the bound.
    body = {
        "model": "tiny-llama",
        "prompt": "go",
        "max_tokens": 1000,
        "n": 8,
        "ignore_eos": True,
        "stream": True,
    }
    bound = READ_HIGH_WATER_BYTES + SERVER_WRITE_HIGH_WATER_BYTES + 64 * 1024  # + one last chunk
    small = 16 * 1024
    with served_gateway(big_sim.url, send_buffer_bytes=small) as kvgate:
        sock = raw_request(kvgate.url, body, receive_buffer_bytes=small)
        with sock:
            received = [sock.recv(4096)]
            assert received[0].startswith(b"HTTP/1.1 200")
            # Now the client stops reading. The backend finishes generating meanwhile (an
            # engine does not wait for readers); what kvgate holds for this client then is the
            # most it ever will.
            poll_until(lambda: sim_state(big_sim.url)["num_running"] == 0, 30, "the backend to finish")
            peak = 0
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                peak = max(peak, buffered_in_gateway(kvgate))
                time.sleep(0.05)
            assert 0 < peak <= bound, f"kvgate holds {peak} bytes for a stalled reader (bound {bound})"
            print(f"stalled reader: kvgate holds at most {peak} bytes (bound {bound})")
            assert kvgate.call(lambda: kvgate.gateway.ledger.totals().entries) == 1  # still its client's
            # Reading again delivers the whole stream, every token of every sequence.
            while chunk := sock.recv(65536):
                received.append(chunk)
        kvgate.wait_until(gateway_idle, what="the ledger to balance")
    raw = b"".join(received)
    assert len(raw) > 3 * bound
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    events = [line[6:] for line in dechunk(chunked).decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert sum(len(json.loads(event)["choices"]) for event in events[:-1]) == 8000


def dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked transfer coding."""
    body = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        data = rest[size + 2 :]
    return bytes(body)


async def _open_streams(url: str, count: int, body: dict[str, Any]) -> list[asyncio.StreamWriter]:
    """Open `count` raw HTTP/1.1 streaming requests; returns their writers once sent."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()

    async def one() -> asyncio.StreamWriter:
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + payload)
        await writer.drain()
        return writer

    return list(await asyncio.gather(*(one() for _ in range(count))))


def _storm(kvgate: KvgateProcess, sim: SimProcess, streaming: int, queued: int) -> float:
    state = kvgate.state

    async def run() -> float:
        long_stream = {
            "model": "tiny-llama",
            "prompt": "x",
            "max_tokens": 150,
            "ignore_eos": True,
            "stream": True,
        }
        writers: list[asyncio.StreamWriter] = []
        try:
            writers += await _open_streams(kvgate.url, streaming, long_stream)
            await asyncio.to_thread(
                poll_until,
                lambda: state()["backends"][0]["ledger"]["entries"] == streaming,
                30,
                f"{streaming} streams admitted",
            )
            # The pool is now full: these wait in kvgate's queue.
            writers += await _open_streams(kvgate.url, queued, {**long_stream, "stream": False})
            await asyncio.to_thread(
                poll_until,
                lambda: sum(state()["backends"][0]["queue"]["depth"].values()) == queued,
                30,
                f"{queued} requests queued",
            )
            for writer in writers:  # everyone at once: a reset, not a polite close
                writer.transport.abort()
            aborted = time.monotonic()
            await asyncio.to_thread(
                poll_until, lambda: ledger_balanced(state()), 5, "queue and ledger at zero"
            )
            took = time.monotonic() - aborted
        finally:
            # Whatever happened, no socket outlives the test (a failure must not leak into the next).
            for writer in writers:
                writer.transport.abort()
            for writer in writers:
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        return took

    return asyncio.run(run())


def test_a_disconnect_storm_leaves_nothing_behind(tmp_path: Path) -> None:
    # 250 streams of 10 blocks (2 prompt + 150 output tokens) fill the 2,500 usable blocks;
    # 250 more must queue (no overcommit: the pool is what this storm fills).
    config = SimConfig(
        engine=EngineConfig(
            num_blocks=2501,
            block_size=16,
            max_num_seqs=512,
            step_cost=StepCost(base_s=0.05, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0),
        )
    )
    sim = SimProcess(config)
    sim.start()
    try:
        with kvgate_process(
            sim.url,
            tmp_path / "kvgate.log",
            settings={"metrics_poll_interval_s": 0.05, "budget_overcommit": 0.0},
        ) as kvgate:
            took = _storm(kvgate, sim, streaming=250, queued=250)
            print(f"500 clients gone: queue and ledger at zero after {took:.3f} s")
            assert took < 1.0, f"the queue and the ledger took {took:.2f} s to empty"
            poll_until(
                lambda: sim_state(sim.url)["open_responses"] == 0, 5, "the backend to drop every request"
            )
            # Still serving afterwards.
            body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3}
            assert httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=10).status_code == 200
            outcomes = httpx.get(f"{kvgate.url}/metrics", timeout=5).text
            gone = [line for line in outcomes.splitlines() if 'outcome="client_gone"' in line]
            assert gone
            assert float(gone[0].rsplit(" ", 1)[1]) == 500
    finally:
        sim.stop()

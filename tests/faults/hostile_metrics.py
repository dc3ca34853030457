"""A fake vLLM whose /metrics is hostile on demand: it trickles, is huge, is cut, is binary, is
an HTML page, or carries absurd values. /v1/models and /health answer like the testbed.

The emulator's faults cover a slow or malformed exporter; these are the ones a broken proxy,
a misrouted URL or a corrupted exporter produce, at the level of bytes on the socket, so it is
a small HTTP/1.1 server on raw asyncio streams in a thread of its own. Set `mode` from the test
thread (one of MODES, or "absurd" with `absurd` set to (pattern, replacement) applied to the
recorded /metrics text of the testbed).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics_0.32.0.txt"
MODELS = {
    "object": "list",
    "data": [{"id": "tiny-llama", "object": "model", "owned_by": "vllm", "max_model_len": 1024}],
}
TRICKLE_S = 0.1  # between two bytes: far below any per-read timeout
HUGE_BYTES = 100 << 20
MODES = (
    "good",
    "trickle",
    "huge",
    "huge-declared",
    "cut",
    "garbage",
    "html",
    "html-as-text",
    "gzip",
    "absurd",
)


class HostileMetrics:
    def __init__(self) -> None:
        self.mode = "good"
        self.absurd: tuple[str, str] = ("", "")
        self.extra = ""  # appended to the good text
        self.scrapes = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-metrics", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(timeout=10)

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            # Handlers still trickling or streaming end with their connections.
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                path = head.split(b" ", 2)[1].decode()
                if not await self._answer(path, writer):
                    return  # the answer ends the connection
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, path: str, writer: asyncio.StreamWriter) -> bool:
        """Write one answer; False when the connection must close after it."""
        if path == "/v1/models":
            return await _send(writer, json.dumps(MODELS).encode(), "application/json")
        if path == "/health":
            return await _send(writer, b"", "text/plain")
        if path != "/metrics":
            return await _send(writer, b"not found", "text/plain", status="404 Not Found")
        self.scrapes += 1
        # Every scrape differs, as a live vLLM's does (its process metrics move).
        good = FIXTURE.read_bytes() + f"# scrape {self.scrapes}\n{self.extra}".encode()
        mode = self.mode
        if mode == "good":
            return await _send(writer, good, PROMETHEUS)
        if mode == "absurd":
            pattern, replacement = self.absurd
            text, count = re.subn(pattern, replacement, good.decode())
            assert count, f"{pattern!r} is not in the recorded /metrics"
            return await _send(writer, text.encode(), PROMETHEUS)
        if mode == "trickle":
            writer.write(_head(PROMETHEUS, len(good)))
            for byte in good:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(TRICKLE_S)
            return True
        if mode in ("huge", "huge-declared"):
            # A real text first, then comments for ever: only the size gives it away.
            writer.write(_head(PROMETHEUS, HUGE_BYTES if mode == "huge-declared" else None))
            writer.write(good)
            block = (b"# " + b"x" * 1021 + b"\n") * 64
            for _ in range(HUGE_BYTES // len(block)):
                writer.write(block)
                await writer.drain()
            return False
        if mode == "cut":
            writer.write(_head(PROMETHEUS, len(good)) + good[: len(good) // 2])
            await writer.drain()
            return False
        if mode == "garbage":
            return await _send(writer, random.Random(17).randbytes(256 << 10), PROMETHEUS)
        page = b"<!DOCTYPE html><html><body><h1>Welcome to nginx!</h1></body></html>\n"
        if mode == "html":
            return await _send(writer, page, "text/html; charset=utf-8")
        if mode == "html-as-text":
            return await _send(writer, page, "text/plain")
        if mode == "gzip":
            return await _send(writer, gzip.compress(good), PROMETHEUS, encoding="gzip")
        raise AssertionError(f"unknown mode {mode!r}")


PROMETHEUS = "text/plain; version=1.0.0; charset=utf-8"


def _head(content_type: str, length: int | None, *, status: str = "200 OK", encoding: str = "") -> bytes:
    lines = [f"HTTP/1.1 {status}", f"content-type: {content_type}"]
    lines.append(f"content-length: {length}" if length is not None else "connection: close")
    if encoding:
        lines.append(f"content-encoding: {encoding}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _send(
    writer: asyncio.StreamWriter,
    body: bytes,
    content_type: str,
    *,
    status: str = "200 OK",
    encoding: str = "",
) -> bool:
    writer.write(_head(content_type, len(body), status=status, encoding=encoding) + body)
    await writer.drain()
    return True


@contextlib.contextmanager
def hostile_metrics() -> Iterator[HostileMetrics]:
    server = HostileMetrics()
    server.start()
    try:
        yield server
    finally:
        server.stop()

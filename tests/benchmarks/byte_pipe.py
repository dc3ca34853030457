"""A reference relay for tests/benchmarks/relay_cpu.py: bytes piped between two sockets (not a test).

    .venv/bin/python tests/benchmarks/byte_pipe.py --port P --upstream HOST:PORT

Each connection accepted on `--port` gets a connection of its own to `--upstream`, and every
byte read on one side is written to the other as it comes, with flow control both ways: no
HTTP parsing, no SSE counting, no admission, no pool. It runs on uvloop, as kvgate does, so
that what it costs a token is the floor of any relay written in Python on this event loop: one
read from the backend's socket, one write to the client's, and the callbacks between them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import cast

import uvloop


class _Side(asyncio.Protocol):
    """One socket of a pair; what it reads goes to its peer's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._early: list[bytes] = []  # read before the peer was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self._early.append(data)
            return
        peer.transport.write(data)

    def eof_received(self) -> bool | None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    # The peer's socket is full: stop reading this one until it drains.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def pair_with(self, peer: _Side) -> None:
        self.peer, peer.peer = peer, self
        early, self._early = self._early, []
        if peer.transport is not None:
            for data in early:
                peer.transport.write(data)


class _Downstream(_Side):
    """The client's socket: connects its upstream side when accepted."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self._upstream = (host, port)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        transport = self.transport
        transport.pause_reading()
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(_Side, *self._upstream)
        except OSError:
            transport.close()
            return
        upstream.pair_with(self)
        self.pair_with(upstream)
        transport.resume_reading()


async def serve(port: int, upstream_host: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Downstream(upstream_host, upstream_port), "127.0.0.1", port, backlog=4096
    )
    print(f"byte pipe on 127.0.0.1:{port} to {upstream_host}:{upstream_port}", flush=True)
    await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    args = parser.parse_args(argv)
    host, _, port_text = args.upstream.rpartition(":")
    uvloop.run(serve(args.port, host, int(port_text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Large request bodies read at a bounded pace, so that clients sending them back to back cannot
take the event loop's time from everyone else.

A body's first `free_bytes` are read at once: ordinary requests never wait here. Past those,
the bytes of all bodies together are read at `bytes_per_s`, after a burst of `burst_bytes` (one
body at the largest size arrives at full speed after a quiet moment): between two chunks a body
waits its turn, its next bytes left unread in the kernel's socket buffers. The wait counts
towards the body's time limit (`body_timeout_s`, 408).

Why: receiving, decoding and parsing a body of 8 MiB cost tens of milliseconds of the loop, so
two clients sending such bodies back to back took most of a core and doubled the latency of
every other request. Paced, large bodies cost at most what their pace costs, whatever the
number of clients sending them. Only bytes that arrive are counted: a client trickling its body
takes nothing from the pace (the body's time limit ends it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.body_pace import IntakePace


class BodyIntake:
    """The pace of large bodies for one process (see the module's text); `bytes_per_s` 0 reads
    them unpaced."""

    def __init__(
        self,
        *,
        bytes_per_s: float,
        burst_bytes: int,
        free_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free_bytes = free_bytes
        self._pace = IntakePace(bytes_per_s, burst_bytes) if bytes_per_s > 0 else None
        self._clock = clock
        self.waiting = 0  # bodies waiting for their pace now
        self.waited_s = 0.0  # time bodies have waited in all

    def to_json(self) -> dict[str, float | int]:
        """For /admin/state: bodies waiting for their pace now, and seconds waited in all."""
        return {"waiting": self.waiting, "waited_s": round(self.waited_s, 3)}

    async def received(self, before: int, after: int) -> None:
        """A body has grown from `before` to `after` bytes: those of them past its free ones
        wait for the pace before its next chunk is read."""
        await self.wait_for(max(0, after - self.free_bytes) - max(0, before - self.free_bytes))

    async def wait_for(self, nbytes: int) -> None:
        """Wait until `nbytes` more bytes of large bodies may be read."""
        if self._pace is None or nbytes <= 0:
            return
        delay = self._pace.book(nbytes, self._clock())
        if delay <= 0:
            return
        self.waiting += 1
        self.waited_s += delay
        try:
            await asyncio.sleep(delay)
        finally:
            self.waiting -= 1

"""Split a server-sent-event stream into its events' data, however the bytes arrive (pure).

Only the `data` field matters to the bench (OpenAI-style streams send nothing else that
counts), so `event`, `id`, `retry` and comment lines are read and dropped. Lines end with
CRLF, LF or CR as the event-stream format allows; an event ends at a blank line and is
dispatched only when it had data, its data lines joined with LF.
"""

from __future__ import annotations

_FIELD_DATA = b"data"


class EventDataDecoder:
    """Incremental decoder for one stream. Not thread-safe: one stream, one reader."""

    def __init__(self) -> None:
        self._pending = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Take the next bytes of the stream; returns the data of every event they complete."""
        buffer = self._pending + chunk if self._pending else chunk
        lines = buffer.splitlines(keepends=True)
        # A last line without its line break is incomplete, and so is one that ends in CR:
        # the LF of a CRLF may be in the next chunk, and must not count as a second line end.
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            self._pending = lines.pop()
        else:
            self._pending = b""
        events: list[str] = []
        for line in lines:
            line = line.rstrip(b"\r\n")
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode("utf-8", "replace"))
                    self._data = []
                continue
            name, _, value = line.partition(b":")
            if name == _FIELD_DATA:
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

"""When the next bytes of large request bodies may be read (gateway.intake is its shell)."""

from __future__ import annotations


class IntakePace:
    """When the next bytes of large bodies may be read: virtual scheduling (GCRA) of bytes.

    Each call books its bytes behind those booked before and says how long to wait before
    reading on; the bytes of a quiet moment up to `burst_bytes` need no wait. Pure: time is
    passed in."""

    def __init__(self, bytes_per_s: float, burst_bytes: int) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        if burst_bytes < 0:
            raise ValueError("burst_bytes must not be negative")
        self._seconds_per_byte = 1.0 / bytes_per_s
        self._burst_s = burst_bytes / bytes_per_s
        self._booked_until: float | None = None  # when the bytes booked so far are all read

    def book(self, nbytes: int, now: float) -> float:
        """Seconds from `now` to wait before reading past `nbytes` more (0: at once)."""
        start = now if self._booked_until is None else max(self._booked_until, now)
        self._booked_until = start + nbytes * self._seconds_per_byte
        return max(0.0, self._booked_until - self._burst_s - now)

"""What became of each request: its summary, the latest few, and counts by outcome (pure).

A `RequestSummary` is made once per request, when its outcome is final (see
`gateway.outcomes`), and feeds three readers: the `kvgate_requests_total` counter, the request
log line (`gateway.logs`) and `RecentRequests`, which `/admin/state` and `/dashboard` show.
A summary holds numbers and labels only: never a prompt, a completion, a key or any header
value except the request id, which kvgate has validated or generated (`gateway.request_id`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway.outcomes import Outcome


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """One finished request. Times are monotonic seconds; block and token counts are None when
    the request ended before they were known (e.g. an invalid body has no prompt count)."""

    request_id: str
    backend: str
    route: str
    outcome: Outcome
    status: int | None  # the HTTP status the client was sent (499: it left before any)
    arrived_at: float
    finished_at: float
    # The `code` of the error the client was sent: why it was shed or refused; or, for a request
    # that ended otherwise, what its line must say (client_write_timeout, backend_usage_invalid).
    code: str | None = None
    queue_s: float = 0.0
    # What the queue predicted it would wait, for a request that had to (None otherwise).
    predicted_queue_s: float | None = None
    priority: str | None = None
    model: str | None = None
    stream: bool | None = None
    estimated_blocks: int | None = None  # what kvgate reserved (prompt + expected output)
    actual_blocks: int | None = None  # what the request held at its end (prompt + output)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def queue_ms(self) -> int:
        return _ms(self.queue_s)

    @property
    def predicted_queue_ms(self) -> int | None:
        return None if self.predicted_queue_s is None else _ms(self.predicted_queue_s)

    @property
    def duration_ms(self) -> int:
        return _ms(self.finished_at - self.arrived_at)

    def fields(self) -> dict[str, Any]:
        """The summary as JSON-safe values, times as durations (for logs and /admin/state)."""
        return {
            "request_id": self.request_id,
            "backend": self.backend,
            "route": self.route,
            "model": self.model,
            "priority": self.priority,
            "stream": self.stream,
            "outcome": self.outcome.value,
            "status": self.status,
            "code": self.code,
            "queue_ms": self.queue_ms,
            "predicted_queue_ms": self.predicted_queue_ms,
            "duration_ms": self.duration_ms,
            "estimated_blocks": self.estimated_blocks,
            "actual_blocks": self.actual_blocks,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


def _ms(seconds: float) -> int:
    return round(max(0.0, seconds) * 1000)


class RecentRequests:
    """The last `capacity` summaries (oldest dropped first) and counts by outcome since start.

    Memory is bounded by `capacity`; `add` is O(1). Called from one event loop only.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._latest: deque[RequestSummary] = deque(maxlen=capacity)
        self._counts = dict.fromkeys(Outcome, 0)
        self.total = 0

    def add(self, summary: RequestSummary) -> None:
        self._latest.append(summary)
        self._counts[summary.outcome] += 1
        self.total += 1

    def latest(self) -> list[RequestSummary]:
        """The kept summaries, newest first."""
        return list(reversed(self._latest))

    def counts(self) -> dict[Outcome, int]:
        """Requests per outcome since start; every outcome is present, most with 0."""
        return dict(self._counts)

    def describe(self, now: float) -> dict[str, Any]:
        """JSON-safe view for /admin/state: counts, and the kept summaries newest first, each
        with its age at `now`."""
        return {
            "total": self.total,
            "capacity": self.capacity,
            "outcomes": {outcome.value: count for outcome, count in self._counts.items()},
            "requests": [
                {**summary.fields(), "age_s": round(max(0.0, now - summary.finished_at), 3)}
                for summary in reversed(self._latest)
            ],
        }

"""What one run observed, as plain values: per-request records and metric samples.

The runner fills these in; the report only reads them. Times are seconds; `*_s` fields that
are offsets count from the run's start (the instant the first request was scheduled for).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.promtext import Reading


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it.

    `status` is the HTTP status (None when no response arrived). `finished` means the stream
    ended properly (`[DONE]`, or a complete non-streaming body). `gave_up` means the client
    abandoned the request at its deadline. `output_tokens` is the client's own count: the
    final usage chunk's completion_tokens when it came, else the tokens streamed so far
    (token ids when the server sends them, else one per chunk). `usage_completion_tokens` and
    `usage_prompt_tokens` are what the server's usage said, if it said. `retry_after_s` is the
    delay a refusal asked for (`retry-after-ms` when given, else `Retry-After`); the raw
    header values are kept beside it.
    """

    index: int
    tenant: str | None
    priority: str | None
    scheduled_s: float
    start_lag_s: float
    prompt_tokens_wanted: int
    output_tokens_wanted: int
    status: int | None = None
    finished: bool = False
    gave_up: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    streamed_tokens: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    gaps_s: tuple[float, ...] = ()
    retry_after_s: float | None = None
    retry_after_header: str | None = None
    retry_after_ms_header: str | None = None
    finish_reason: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        values = dict(data)
        values["gaps_s"] = tuple(values.get("gaps_s", ()))
        return cls(**values)


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """One scrape of one /metrics URL, `t_s` seconds after the run's start (negative before)."""

    t_s: float
    source: str
    reading: Reading


@dataclass(frozen=True, slots=True)
class RunResult:
    """Everything one run against one target produced.

    `baseline` and `final` hold, per metrics URL, the scrape just before the first request and
    the one after the last request ended and the backend went idle: their difference is what
    this run cost the backend. `vllm_sources` names the URLs whose vLLM counters count.
    `max_in_flight` is the most requests the client had open at once.
    """

    target: str
    records: tuple[RequestRecord, ...]
    samples: tuple[MetricPoint, ...] = ()
    baseline: dict[str, Reading] = field(default_factory=dict)
    final: dict[str, Reading] = field(default_factory=dict)
    vllm_sources: tuple[str, ...] = ()
    duration_s: float = 0.0
    max_in_flight: int = 0

"""Faults the emulator can inject, as one immutable value switched at start or at run time.

A gateway in front of vLLM must survive a backend that dies mid-stream, answers 5xx, answers
late, or reports metrics that are slow, stale, missing or unparsable. Each knob here is one of
those failures; `Faults()` is a healthy server. The admin endpoint `POST /sim/faults` takes a
JSON object with any subset of the fields and returns the new value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from typing import Any


class MetricsMode(StrEnum):
    """What `/metrics` answers."""

    NORMAL = "normal"
    # The text of the first scrape after the switch, forever (a wedged exporter).
    STALE = "stale"
    # `metrics_status` (404 or 500) with no metrics.
    MISSING = "missing"
    # 200 with text no Prometheus parser accepts.
    MALFORMED = "malformed"


@dataclass(frozen=True, slots=True)
class Faults:
    # Close the connection abruptly (FIN, no terminating chunk) once a response has streamed
    # this many tokens; a non-streaming request loses its connection instead of an answer.
    crash_after_tokens: int | None = None
    # Same, but with a TCP reset (RST) instead of a close.
    reset_after_tokens: int | None = None
    # Stop sending once a response has streamed this many tokens, and keep the connection open
    # (a wedged engine): nothing more arrives until the client leaves or the server stops. A
    # non-streaming request is never answered.
    stall_after_tokens: int | None = None
    # Share of generation requests answered `error_status` at once, drawn from the seeded RNG.
    error_rate: float = 0.0
    error_status: int = 500
    # Delay before a generation request is looked at (time to first byte).
    first_byte_delay_s: float = 0.0
    # Accept generation requests and never answer them (until the client leaves).
    hang: bool = False
    metrics_delay_s: float = 0.0
    metrics_mode: MetricsMode = MetricsMode.NORMAL
    metrics_status: int = 404
    # Leave vllm:cache_config_info out of /metrics (pool size unknown to the gateway).
    omit_cache_config_info: bool = False

    def errors(self) -> list[str]:
        problems: list[str] = []
        for name in ("crash_after_tokens", "reset_after_tokens", "stall_after_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"{name} must be >= 0")
        if not 0.0 <= self.error_rate <= 1.0:
            problems.append("error_rate must be in [0, 1]")
        if not 500 <= self.error_status <= 599:
            problems.append("error_status must be a 5xx status")
        if not 400 <= self.metrics_status <= 599:
            problems.append("metrics_status must be a 4xx or 5xx status")
        if self.first_byte_delay_s < 0 or self.metrics_delay_s < 0:
            problems.append("delays must be >= 0")
        return problems

    def updated(self, changes: Mapping[str, Any]) -> Faults:
        """A copy with `changes` applied; ValueError naming every bad field at once."""
        known = {f.name: f for f in fields(self)}
        problems: list[str] = []
        values: dict[str, Any] = {}
        for name, raw in changes.items():
            if name not in known:
                problems.append(f"unknown fault {name!r}")
                continue
            try:
                values[name] = _coerce(name, raw)
            except ValueError as exc:
                problems.append(str(exc))
        if not problems:
            candidate = replace(self, **values)
            problems = candidate.errors()
            if not problems:
                return candidate
        raise ValueError("; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["metrics_mode"] = self.metrics_mode.value
        return data


_OPTIONAL_INTS = {"crash_after_tokens", "reset_after_tokens", "stall_after_tokens"}
_INTS = {"error_status", "metrics_status"}
_FLOATS = {"error_rate", "first_byte_delay_s", "metrics_delay_s"}
_BOOLS = {"hang", "omit_cache_config_info"}


def _coerce(name: str, raw: Any) -> Any:
    if name in _OPTIONAL_INTS:
        if raw is None:
            return None
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"{name} must be an integer or null")
        return raw
    if name in _INTS:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"{name} must be an integer")
        return raw
    if name in _FLOATS:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError(f"{name} must be a number")
        return float(raw)
    if name in _BOOLS:
        if not isinstance(raw, bool):
            raise ValueError(f"{name} must be a boolean")
        return raw
    try:
        return MetricsMode(raw)
    except ValueError:
        choices = ", ".join(m.value for m in MetricsMode)
        raise ValueError(f"metrics_mode must be one of {choices}") from None

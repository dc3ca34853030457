"""The one Settings object of `kvgate serve` (pydantic-settings, environment prefix KVGATE_).

Sources, strongest first: command-line flags, `KVGATE_*` environment variables, the `--config`
file (TOML or JSON, keys are the field names), then the defaults below. Everything is validated
at once at startup (`load_settings`); nothing is read at import time. Defaults are named
constants with their unit in the name, so code and docs can refer to them.
"""

from __future__ import annotations

import ipaddress
import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from gateway.admission import Priority
from gateway.credentials import REDACTED, redact_url

ENV_PREFIX = "KVGATE_"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_BACKEND_NAME = "default"

# Budget: how often and how patiently vLLM's /metrics is read.
DEFAULT_METRICS_POLL_INTERVAL_S = 0.2
DEFAULT_METRICS_TIMEOUT_S = 1.0
DEFAULT_METRICS_STALE_AFTER_S = 1.0
DEFAULT_BACKEND_DOWN_AFTER_FAILURES = 2
# Requests younger than this at a scrape may not be allocated inside vLLM yet (no credit), and
# requests that ended this recently may still be counted there (not someone else's usage).
DEFAULT_SETTLE_S = 0.5

# AIMD on the admissible share of the KV pool.
DEFAULT_BUDGET_MIN_FRACTION = 0.5
DEFAULT_BUDGET_MAX_FRACTION = 1.0
DEFAULT_BUDGET_INITIAL_FRACTION = 1.0
DEFAULT_AIMD_DECREASE_FACTOR = 0.8
DEFAULT_AIMD_INCREASE_PER_S = 0.02
DEFAULT_AIMD_QUIET_S = 5.0
DEFAULT_AIMD_DECREASE_COOLDOWN_S = 2.0
# How far past budget_max_fraction quiet periods may grow the share while requests wait and
# vLLM leaves a quarter of the pool unused (see gateway.capacity); 0: never. Measured on the
# CPU testbed (see docs/measurements.md): it engaged on long answers and not on long prompts.
DEFAULT_BUDGET_OVERCOMMIT = 0.5
DEFAULT_BUDGET_OVERCOMMIT_ROOM = 0.25

# Output-length model.
DEFAULT_OUTPUT_QUANTILE = 0.9
DEFAULT_OUTPUT_MIN_SAMPLES = 20
DEFAULT_OUTPUT_WINDOW_SAMPLES = 1000

# Queue.
DEFAULT_QUEUE_MAX_REQUESTS = 256
DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_HOL_MAX_BYPASS = 128
# A waiter that does not fit blocks the queue once its wait, were blocks held for it, reaches
# this share of the time left to its deadline (see gateway.admission).
DEFAULT_HOL_DEADLINE_SHARE = 0.5
DEFAULT_DRAIN_RATE_HORIZON_S = 10.0
# When an arrival finds the backend beyond capacity, requests that joined the queue this
# recently are judged by their first-token objectives too (see gateway.waitqueue); a 429 for
# them still comes within this long of their arrival.
DEFAULT_OBJECTIVE_LOOKBACK_S = 0.75
# The load counts as beyond capacity once a plain queue would keep an arrival waiting this share
# of its deadline budget (see gateway.rates.VirtualBacklog).
DEFAULT_OVERLOAD_WAIT_SHARE = 1.0
# Over this many seconds the offered load is measured, to project a plain queue's wait ahead
# (see gateway.rates.VirtualBacklog); 0: no projection.
DEFAULT_OVERLOAD_ARRIVAL_HORIZON_S = 0.0
# An arrival joins the queue only when predicted to leave it this share of its time to the
# deadline early (see gateway.admission.PolicyConfig.arrival_slack).
DEFAULT_ARRIVAL_SLACK = 0.1
DEFAULT_RETRY_AFTER_S = 1.0
DEFAULT_RETRY_AFTER_MIN_S = 0.25
# The OpenAI SDK ignores retry hints above 60 s and falls back on its own backoff.
DEFAULT_RETRY_AFTER_MAX_S = 60.0
DEFAULT_SERVICE_TIME_MARGIN = 1.0

# Forwarding.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_FIRST_BYTE_TIMEOUT_S = 300.0
DEFAULT_BETWEEN_CHUNK_TIMEOUT_S = 60.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
# A write to a client blocked this long (it stopped reading, its TCP window full) ends the
# request: the backend is told to stop and the reservation is released.
DEFAULT_CLIENT_WRITE_TIMEOUT_S = 30.0
DEFAULT_DISCOVERY_TIMEOUT_S = 5.0
DEFAULT_DISCOVERY_RETRY_S = 1.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# The request line and headers together; past it the connection gets 431 and is closed.
DEFAULT_MAX_HEADER_BYTES = 32 * 1024

# Receipt of a request (slow clients, slowloris): a connection whose request line and headers
# are not complete this long after it opened (or after the request's first byte, on a reused
# connection) is closed, with 408 when part of a request came; a body not received this long
# after its head gets 408. Beyond `max_client_connections` open client connections, a new one
# is answered 503 and closed at once, so that descriptors never run out (see gateway.lifecycle).
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CLIENT_CONNECTIONS = 4096

# Shutdown (SIGTERM): not ready at once; listen on for the delay (so that load balancers see
# /readyz fail), then stop listening and give streams in flight the grace period to finish.
DEFAULT_SHUTDOWN_DELAY_S = 0.0
DEFAULT_SHUTDOWN_GRACE_S = 30.0

# Tokenization, off the event loop.
DEFAULT_TOKENIZER_THREADS = 2
DEFAULT_TOKENIZER_MAX_PENDING = 512
# Bodies up to this size are counted on the event loop instead: handing one to a thread costs
# about as much as counting it (more under load, when the thread waits for the GIL). Counting
# runs at roughly 0.25 us per body byte plus ~0.1 ms to render a chat template (testbed
# tokenizer, tests/benchmarks/token_count.py), so 1 KiB holds the loop for about 0.3 ms at most.
DEFAULT_TOKENIZER_INLINE_MAX_BYTES = 1024

# Observability: summaries of the last requests kept for /admin/state and /dashboard.
DEFAULT_RECENT_REQUESTS = 100
MAX_RECENT_REQUESTS = 10_000


class Settings(BaseSettings):
    """Everything `kvgate serve` can be told. Build it with `load_settings` (or directly)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True
    )

    # Where and what to serve.
    backend_url: str = Field(description="Base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    backend_name: str = Field(DEFAULT_BACKEND_NAME, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str | None = Field(None, description="Served model name, or a model folder / id for the tokenizer")
    tokenizer: str | None = Field(None, description="Tokenizer folder or id in the local HF cache")
    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    admin_token: SecretStr | None = None
    # Who may raise a request's priority (X-Kvgate-Priority: high, or vLLM's body field
    # `priority` below 0): clients that send this token in X-Kvgate-Priority-Token. Unset:
    # nobody (high counts as normal; see gateway.client_hints). Lowering is always allowed.
    priority_token: SecretStr | None = None
    # The admin endpoints (/admin/*): "auto" serves them when an admin token is set (and then
    # requires it) or, without one, only on a loopback bind; "on" also serves them without a
    # token on a public bind; "off" never serves them.
    admin_api: Literal["auto", "on", "off"] = "auto"
    backend_api_key: SecretStr | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "json": one JSON object per log line (see gateway.logs); "text": human-readable lines.
    log_format: Literal["text", "json"] = "text"
    recent_requests: int = Field(DEFAULT_RECENT_REQUESTS, ge=0, le=MAX_RECENT_REQUESTS)

    # Budget (measure).
    metrics_poll_interval_s: float = Field(DEFAULT_METRICS_POLL_INTERVAL_S, gt=0, le=60)
    metrics_timeout_s: float = Field(DEFAULT_METRICS_TIMEOUT_S, gt=0, le=60)
    metrics_stale_after_s: float = Field(DEFAULT_METRICS_STALE_AFTER_S, gt=0)
    unknown_budget: Literal["saturated", "ledger"] = "saturated"
    backend_down_after_failures: int = Field(DEFAULT_BACKEND_DOWN_AFTER_FAILURES, ge=1)
    settle_s: float = Field(DEFAULT_SETTLE_S, ge=0)
    budget_min_fraction: float = Field(DEFAULT_BUDGET_MIN_FRACTION, gt=0, le=1)
    budget_max_fraction: float = Field(DEFAULT_BUDGET_MAX_FRACTION, gt=0, le=1)
    budget_initial_fraction: float = Field(DEFAULT_BUDGET_INITIAL_FRACTION, gt=0, le=1)
    aimd_decrease_factor: float = Field(DEFAULT_AIMD_DECREASE_FACTOR, gt=0, lt=1)
    aimd_increase_per_s: float = Field(DEFAULT_AIMD_INCREASE_PER_S, ge=0)
    aimd_quiet_s: float = Field(DEFAULT_AIMD_QUIET_S, ge=0)
    aimd_decrease_cooldown_s: float = Field(DEFAULT_AIMD_DECREASE_COOLDOWN_S, ge=0)
    budget_overcommit: float = Field(DEFAULT_BUDGET_OVERCOMMIT, ge=0, le=1)
    budget_overcommit_room: float = Field(DEFAULT_BUDGET_OVERCOMMIT_ROOM, gt=0, lt=1)
    # Commit the projected peak of the requests in flight together rather than the sum of
    # their peaks (see gateway.ledger). Off by default: it admits more at once, which pays where
    # the KV cache is what binds (long answers) and costs where compute does (docs/measurements.md).
    kv_multiplexing: bool = False
    # Commit the output_quantile of the sum of what the requests in flight still have to
    # produce rather than the sum of their quantiles (see gateway.ledger).
    output_pooling: bool = False

    # Output length (estimate).
    output_quantile: float = Field(DEFAULT_OUTPUT_QUANTILE, gt=0, le=1)
    output_min_samples: int = Field(DEFAULT_OUTPUT_MIN_SAMPLES, ge=1)
    output_window_samples: int = Field(DEFAULT_OUTPUT_WINDOW_SAMPLES, ge=1)
    # Until a model has output_min_samples answers of its own, reserve the output_quantile of
    # the backend's histogram of output lengths (vllm:request_generation_tokens) rather than
    # the cap, once that histogram holds output_min_samples answers (see gateway.output_model).
    output_backend_prior: bool = True

    # Queue (decide).
    queue_max_high: int = Field(DEFAULT_QUEUE_MAX_REQUESTS, ge=0)
    queue_max_normal: int = Field(DEFAULT_QUEUE_MAX_REQUESTS, ge=0)
    queue_max_low: int = Field(DEFAULT_QUEUE_MAX_REQUESTS, ge=0)
    queue_timeout_high_s: float = Field(DEFAULT_QUEUE_TIMEOUT_S, gt=0)
    queue_timeout_normal_s: float = Field(DEFAULT_QUEUE_TIMEOUT_S, gt=0)
    queue_timeout_low_s: float = Field(DEFAULT_QUEUE_TIMEOUT_S, gt=0)
    hol_max_bypass: int = Field(DEFAULT_HOL_MAX_BYPASS, ge=0)
    hol_deadline_share: float = Field(DEFAULT_HOL_DEADLINE_SHARE, ge=0, le=1)
    early_shed: bool = True
    drain_rate_horizon_s: float = Field(DEFAULT_DRAIN_RATE_HORIZON_S, gt=0)
    objective_lookback_s: float = Field(DEFAULT_OBJECTIVE_LOOKBACK_S, ge=0, le=10)
    overload_wait_share: float = Field(DEFAULT_OVERLOAD_WAIT_SHARE, gt=0, le=1)
    overload_arrival_horizon_s: float = Field(DEFAULT_OVERLOAD_ARRIVAL_HORIZON_S, ge=0, le=60)
    arrival_slack: float = Field(DEFAULT_ARRIVAL_SLACK, ge=0, lt=1)
    # Correct each arrival's predicted wait for its size, learned from past waits (see
    # gateway.rates.WaitCalibration).
    wait_calibration: bool = True
    retry_after_s: float = Field(DEFAULT_RETRY_AFTER_S, gt=0)
    retry_after_min_s: float = Field(DEFAULT_RETRY_AFTER_MIN_S, gt=0)
    retry_after_max_s: float = Field(DEFAULT_RETRY_AFTER_MAX_S, gt=0)
    service_time_margin: float = Field(DEFAULT_SERVICE_TIME_MARGIN, ge=0, le=2)

    # Forwarding.
    connect_timeout_s: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    first_byte_timeout_s: float = Field(DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0)
    between_chunk_timeout_s: float = Field(DEFAULT_BETWEEN_CHUNK_TIMEOUT_S, gt=0)
    write_timeout_s: float = Field(DEFAULT_WRITE_TIMEOUT_S, gt=0)
    client_write_timeout_s: float = Field(DEFAULT_CLIENT_WRITE_TIMEOUT_S, gt=0)
    discovery_timeout_s: float = Field(DEFAULT_DISCOVERY_TIMEOUT_S, gt=0)
    discovery_retry_s: float = Field(DEFAULT_DISCOVERY_RETRY_S, gt=0)
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, ge=1)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    max_header_bytes: int = Field(DEFAULT_MAX_HEADER_BYTES, ge=1024)
    header_timeout_s: float = Field(DEFAULT_HEADER_TIMEOUT_S, gt=0, le=3600)
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0, le=3600)
    max_client_connections: int = Field(DEFAULT_MAX_CLIENT_CONNECTIONS, ge=1)

    # Shutdown.
    shutdown_delay_s: float = Field(DEFAULT_SHUTDOWN_DELAY_S, ge=0)
    shutdown_grace_s: float = Field(DEFAULT_SHUTDOWN_GRACE_S, ge=0)

    # Tokenization.
    tokenizer_threads: int = Field(DEFAULT_TOKENIZER_THREADS, ge=1, le=64)
    tokenizer_max_pending: int = Field(DEFAULT_TOKENIZER_MAX_PENDING, ge=1)
    tokenizer_inline_max_bytes: int = Field(DEFAULT_TOKENIZER_INLINE_MAX_BYTES, ge=0, le=64 * 1024)
    # Chat templates sent in requests (`chat_template`, or inside `chat_template_kwargs`) are
    # code from the client. Off: refused with 400, as vLLM refuses them without its
    # --trust-request-chat-template. On: rendered in bounded worker processes (gateway.render_pool);
    # turn it on only together with vLLM's flag, or vLLM refuses what kvgate rendered.
    trust_request_chat_template: bool = False

    @field_validator("admin_token", "backend_api_key", "priority_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # KVGATE_ADMIN_TOKEN= (set but empty) must not become a token that an empty header matches.
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(raw, str) and not raw.strip():
            return None
        return value

    @field_validator("backend_api_key")
    @classmethod
    def _header_safe(cls, value: SecretStr | None) -> SecretStr | None:
        # It is sent as a header value: printable ASCII only, or requests would be refused.
        if value is not None and not all(" " <= ch <= "~" for ch in value.get_secret_value()):
            raise ValueError("must be printable ASCII (it is sent in the Authorization header)")
        return value

    @field_validator("backend_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
        if parts.query or parts.fragment:
            raise ValueError("must not carry a query or fragment")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        problems: list[str] = []
        if not self.budget_min_fraction <= self.budget_initial_fraction <= self.budget_max_fraction:
            problems.append(
                "need budget_min_fraction <= budget_initial_fraction <= budget_max_fraction, got "
                f"{self.budget_min_fraction} / {self.budget_initial_fraction} / {self.budget_max_fraction}"
            )
        if self.output_window_samples < self.output_min_samples:
            problems.append("output_window_samples must be >= output_min_samples")
        if not self.retry_after_min_s <= self.retry_after_s <= self.retry_after_max_s:
            problems.append("need retry_after_min_s <= retry_after_s <= retry_after_max_s")
        if self.metrics_stale_after_s < self.metrics_poll_interval_s:
            problems.append("metrics_stale_after_s must be at least metrics_poll_interval_s")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def admin_enabled(self) -> bool:
        """Whether /admin/* is served at all (see `admin_api`)."""
        if self.admin_api == "off":
            return False
        return self.admin_api == "on" or self.admin_token is not None or is_loopback(self.host)

    def queue_max(self) -> dict[Priority, int]:
        return {
            Priority.HIGH: self.queue_max_high,
            Priority.NORMAL: self.queue_max_normal,
            Priority.LOW: self.queue_max_low,
        }

    def queue_timeout_s(self) -> dict[Priority, float]:
        return {
            Priority.HIGH: self.queue_timeout_high_s,
            Priority.NORMAL: self.queue_timeout_normal_s,
            Priority.LOW: self.queue_timeout_low_s,
        }

    def public_view(self) -> dict[str, Any]:
        """The settings as JSON-safe values, secrets masked (for /admin/state and logs)."""
        data = self.model_dump(mode="json")
        for secret in ("admin_token", "backend_api_key", "priority_token"):
            if data.get(secret) is not None:
                data[secret] = REDACTED
        data["backend_url"] = redact_url(self.backend_url)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}


# What a reload (SIGHUP or POST /admin/reload) may change while requests are in flight. The
# rest (where to listen, which backend, the tokenizer, pools and threads sized at startup)
# needs a restart; a reload that changes them keeps the running values and says so.
RELOADABLE_SETTINGS = frozenset(
    {
        "log_level",
        "admin_token",
        "admin_api",
        "priority_token",
        "metrics_poll_interval_s",
        "metrics_timeout_s",
        "metrics_stale_after_s",
        "unknown_budget",
        "backend_down_after_failures",
        "settle_s",
        "budget_min_fraction",
        "budget_max_fraction",
        "aimd_decrease_factor",
        "aimd_increase_per_s",
        "aimd_quiet_s",
        "aimd_decrease_cooldown_s",
        "budget_overcommit",
        "budget_overcommit_room",
        "output_quantile",
        "output_backend_prior",
        "queue_max_high",
        "queue_max_normal",
        "queue_max_low",
        "queue_timeout_high_s",
        "queue_timeout_normal_s",
        "queue_timeout_low_s",
        "hol_max_bypass",
        "hol_deadline_share",
        "early_shed",
        "objective_lookback_s",
        "overload_wait_share",
        "arrival_slack",
        "retry_after_s",
        "retry_after_min_s",
        "retry_after_max_s",
        "service_time_margin",
        "first_byte_timeout_s",
        "between_chunk_timeout_s",
        "client_write_timeout_s",
        "max_body_bytes",
        "body_timeout_s",
        "tokenizer_max_pending",
        "tokenizer_inline_max_bytes",
        "shutdown_delay_s",
        "shutdown_grace_s",
    }
)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def reloaded(current: Settings, fresh: Settings) -> tuple[Settings, list[str], list[str]]:
    """`current` with the reloadable values of `fresh`: returns the settings to run with, the
    names applied and the names that changed but need a restart (kept as they are)."""
    changed = [name for name in Settings.model_fields if getattr(fresh, name) != getattr(current, name)]
    applied = sorted(name for name in changed if name in RELOADABLE_SETTINGS)
    ignored = sorted(name for name in changed if name not in RELOADABLE_SETTINGS)
    merged = Settings.model_validate(
        {
            **{name: getattr(current, name) for name in Settings.model_fields},
            **{name: getattr(fresh, name) for name in applied},
        }
    )
    return merged, applied, ignored


class ConfigFileError(ValueError):
    """The --config file cannot be read or is not a TOML/JSON table."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML (.toml) or JSON (anything else) file whose top level is a table.

    A TOML file may put the keys at the top level or under a `[serve]` table.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        if path.suffix.lower() == ".toml":
            data: Any = tomllib.loads(raw.decode("utf-8"))
            if isinstance(data.get("serve"), dict) and len(data) == 1:
                data = data["serve"]
        else:
            data = json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"config file {path} is not valid {path.suffix or 'JSON'}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must hold a table of settings")
    return data


def load_settings(overrides: Mapping[str, Any] | None = None, *, config_file: Path | None = None) -> Settings:
    """Build Settings from flags (`overrides`, None values ignored), the environment and the
    config file, in that order of strength. Raises pydantic.ValidationError listing every
    problem at once, or ConfigFileError."""
    file_values = read_config_file(config_file) if config_file is not None else {}
    # Read the environment the way Settings itself does, so that it outranks the file.
    env_values = EnvSettingsSource(Settings, env_prefix=ENV_PREFIX, case_sensitive=False)()
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    return Settings(**{**file_values, **env_values, **flags})

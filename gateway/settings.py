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
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
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

# The admissible share of the KV pool (docs/admission.md, "The admissible budget").
DEFAULT_BUDGET_MAX_FRACTION = 1.0
DEFAULT_AIMD_DECREASE_FACTOR = 0.9
# How far past budget_max_fraction the share may grow while requests wait and vLLM leaves part
# of the pool unused (see gateway.capacity); 0: never.
DEFAULT_BUDGET_OVERCOMMIT = 1.0

# Output-length model.
DEFAULT_OUTPUT_QUANTILE = 0.9
DEFAULT_OUTPUT_MIN_SAMPLES = 20

# Queue: per priority class, how many may wait and for how long at most.
DEFAULT_QUEUE_MAX_REQUESTS = 256
DEFAULT_QUEUE_TIMEOUT_S = 30.0
# A waiter that does not fit blocks the queue once its wait, were blocks held for it, reaches
# this share of the time left to its deadline (see gateway.admission).
DEFAULT_HOL_DEADLINE_SHARE = 0.5
# An arrival joins the queue only when predicted to leave it this share of its time to the
# deadline early (see gateway.admission.PolicyConfig.arrival_slack).
DEFAULT_ARRIVAL_SLACK = 0.1

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
DEFAULT_LARGE_BODY_BYTES_PER_S = 32 * 1024 * 1024
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


class PriorityClass(BaseModel):
    """What one priority class may hold in the queue (docs/admission.md, "Classes")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_max: int = Field(
        DEFAULT_QUEUE_MAX_REQUESTS,
        ge=0,
        description="requests of the class that may wait, per backend of their model",
    )
    queue_timeout_s: float = Field(
        DEFAULT_QUEUE_TIMEOUT_S,
        gt=0,
        le=86_400,
        description="longest wait in the queue, whatever the deadline",
    )


def _default_classes() -> dict[Priority, PriorityClass]:
    return {
        priority: PriorityClass(queue_max=DEFAULT_QUEUE_MAX_REQUESTS, queue_timeout_s=DEFAULT_QUEUE_TIMEOUT_S)
        for priority in Priority
    }


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """Where a backend is and what it is called in metrics, logs and /admin/state. With
    `resolve`, `url`'s host is a DNS name each of whose addresses is a backend (a Kubernetes
    headless Service), named `address:port`."""

    name: str
    url: str
    resolve: bool = False


# The scheme prefix of a backend entry whose host name stands for all of its addresses.
DNS_SCHEME_PREFIX = "dns+"


_BACKEND_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _backend_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
    if parts.query or parts.fragment:
        raise ValueError("must not carry a query or fragment")
    return value.rstrip("/")


def _backend_spec(entry: str) -> BackendSpec:
    """'URL', 'NAME=URL' or 'dns+URL'; an unnamed backend is labelled by its host and port."""
    name, sep, url = entry.partition("=")
    if not sep or "://" in name:
        name, url = "", entry
    url = url.strip()
    resolve = url.startswith(DNS_SCHEME_PREFIX)
    if resolve:
        url = url[len(DNS_SCHEME_PREFIX) :]
    url = _backend_url(url)
    if not name:
        parts = urlsplit(url)
        name = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    if not _BACKEND_NAME.match(name):
        raise ValueError(f"backend name {name!r}: use letters, digits and . _ : - (64 at most)")
    return BackendSpec(name, url, resolve)


class Settings(BaseSettings):
    """Everything `kvgate serve` can be told. Build it with `load_settings` (or directly).

    Each field's description is its line in the README's settings table, which
    `python -m gateway.settings_doc` writes (a test keeps the two in sync)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True
    )

    # Where and what to serve.
    backend_url: str | None = Field(
        None, description="base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8000 (one backend)"
    )
    backends: list[str] = Field(
        default_factory=list,
        description=(
            "several backends instead: each 'URL' (labelled host:port), 'NAME=URL', or "
            "'dns+URL' (every address the host name resolves to is a backend, re-resolved)"
        ),
    )
    backend_name: str = Field(
        DEFAULT_BACKEND_NAME,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the backend's label in metrics, logs and /admin/state",
    )
    model: str | None = Field(
        None,
        description="served model name, or a model folder / id for the tokenizer (default: the first served)",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer folder or id in the local Hugging Face cache (default: the model's)"
    )
    host: str = Field(DEFAULT_HOST, description="address to listen on")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="port to listen on")
    admin_token: SecretStr | None = Field(
        None, description="token that /admin/* requires (Authorization: Bearer); unset: see admin_api"
    )
    # Who may raise a request's priority (X-Kvgate-Priority: high, or vLLM's body field
    # `priority` below 0): clients that send this token in X-Kvgate-Priority-Token. Unset:
    # nobody (high counts as normal; see gateway.client_hints). Lowering is always allowed.
    priority_token: SecretStr | None = Field(
        None,
        description="token in X-Kvgate-Priority-Token that lets a client raise its priority; unset: nobody may",
    )
    # vLLM started with --scheduling-policy priority serves lower values of the body's
    # `priority` first; kvgate's classes map onto it (high -1, normal 0, low 1) for requests
    # that do not set it themselves.
    priority_to_backend: bool = Field(
        False,
        description="pass X-Kvgate-Priority on to vLLM as the body's priority (for --scheduling-policy priority)",
    )
    # "auto" serves the admin endpoints when an admin token is set (and then requires it) or,
    # without one, only on a loopback bind; "on" also serves them without a token on a public
    # bind; "off" never serves them.
    admin_api: Literal["auto", "on", "off"] = Field(
        "auto", description="serve /admin/*: auto (with a token, or on a loopback bind without), on, off"
    )
    backend_api_key: SecretStr | None = Field(
        None, description="API key kvgate sends to vLLM (its --api-key)"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="text, or json: one JSON object per log line (see gateway.logs)"
    )
    recent_requests: int = Field(
        DEFAULT_RECENT_REQUESTS,
        ge=0,
        le=MAX_RECENT_REQUESTS,
        description="summaries of the last requests kept for /admin/state and /dashboard",
    )

    # Budget (measure).
    metrics_poll_interval_s: float = Field(
        DEFAULT_METRICS_POLL_INTERVAL_S, gt=0, le=60, description="how often vLLM's /metrics is read"
    )
    metrics_timeout_s: float = Field(
        DEFAULT_METRICS_TIMEOUT_S, gt=0, le=60, description="total time limit of one /metrics scrape"
    )
    metrics_stale_after_s: float = Field(
        DEFAULT_METRICS_STALE_AFTER_S, gt=0, description="age past which the last scrape no longer counts"
    )
    unknown_budget: Literal["saturated", "ledger"] = Field(
        "saturated",
        description="without fresh metrics: saturated (admit nothing new) or ledger (trust kvgate's own count)",
    )
    backend_down_after_failures: int = Field(
        DEFAULT_BACKEND_DOWN_AFTER_FAILURES,
        ge=1,
        description=(
            "consecutive unreachable scrapes that mark the backend down (queue answered 503);"
            " as many too slow make arrivals 503 budget_unknown"
        ),
    )
    settle_s: float = Field(
        DEFAULT_SETTLE_S,
        ge=0,
        description="requests younger than this at a scrape earn no credit from vLLM's lower usage",
    )
    budget_max_fraction: float = Field(
        DEFAULT_BUDGET_MAX_FRACTION,
        gt=0,
        le=1,
        description="the admissible share of the pool without overcommit; preemptions never cut below it",
    )
    aimd_decrease_factor: float = Field(
        DEFAULT_AIMD_DECREASE_FACTOR,
        gt=0,
        lt=1,
        description="preemptions multiply an overcommitted share by this, down to budget_max_fraction",
    )
    budget_overcommit: float = Field(
        DEFAULT_BUDGET_OVERCOMMIT,
        ge=0,
        le=1,
        description="how far past budget_max_fraction the share may grow while vLLM leaves a quarter of the pool unused",
    )

    # Output length (estimate).
    output_quantile: float = Field(
        DEFAULT_OUTPUT_QUANTILE,
        gt=0,
        le=1,
        description="quantile of learned answer lengths that a request reserves",
    )
    output_min_samples: int = Field(
        DEFAULT_OUTPUT_MIN_SAMPLES,
        ge=1,
        description="answers a model needs before its learned lengths are used",
    )
    # Until a model has output_min_samples answers of its own, reserve the output_quantile of
    # the backend's histogram of output lengths (vllm:request_generation_tokens) rather than
    # the cap, once that histogram holds output_min_samples answers (see gateway.output_model).
    output_backend_prior: bool = Field(
        True, description="before that, use vLLM's histogram of answer lengths rather than max_tokens"
    )

    # Queue (decide).
    priority_classes: dict[Priority, PriorityClass] = Field(
        default_factory=_default_classes,
        description=(
            "per priority (high, normal, low): queue_max requests waiting (per backend of the"
            " model), queue_timeout_s"
        ),
    )
    hol_deadline_share: float = Field(
        DEFAULT_HOL_DEADLINE_SHARE,
        ge=0,
        le=1,
        description="a waiter holds the queue once its wait reaches this share of its time left",
    )
    arrival_slack: float = Field(
        DEFAULT_ARRIVAL_SLACK,
        ge=0,
        lt=1,
        description="an arrival must be predicted to start this share of its time to the deadline early",
    )

    # Forwarding.
    connect_timeout_s: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0, description="connecting to vLLM")
    first_byte_timeout_s: float = Field(
        DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0, description="vLLM's first byte after the request was sent"
    )
    between_chunk_timeout_s: float = Field(
        DEFAULT_BETWEEN_CHUNK_TIMEOUT_S, gt=0, description="silence between two chunks of vLLM's answer"
    )
    write_timeout_s: float = Field(
        DEFAULT_WRITE_TIMEOUT_S, gt=0, description="sending a request body to vLLM"
    )
    client_write_timeout_s: float = Field(
        DEFAULT_CLIENT_WRITE_TIMEOUT_S,
        gt=0,
        description="a client that reads nothing this long is dropped and its blocks released",
    )
    discovery_timeout_s: float = Field(
        DEFAULT_DISCOVERY_TIMEOUT_S,
        gt=0,
        description="each request of backend discovery (/v1/models, /version)",
    )
    discovery_retry_s: float = Field(
        DEFAULT_DISCOVERY_RETRY_S,
        gt=0,
        description="pause between discovery attempts until the backend answers",
    )
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS,
        ge=1,
        description="connections to each backend at most; a request waits in the queue for one, as for blocks",
    )
    redis_url: SecretStr | None = Field(
        None,
        description=(
            "share one budget with every kvgate process on this Redis (redis:// or rediss:// for "
            "TLS; user and password in the URL); unset: this process's own ledger"
        ),
    )
    redis_key_prefix: str = Field(
        "kvgate",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="keys of this deployment in Redis; deployments sharing a Redis need different ones",
    )
    redis_lease_ttl_s: float = Field(
        10.0,
        gt=0,
        description="a reservation its process stopped renewing (it died) returns its blocks after this",
    )
    redis_timeout_s: float = Field(
        0.5, gt=0, description="a Redis call slower than this counts as Redis unavailable"
    )
    redis_unavailable: Literal["fail_closed", "fail_open"] = Field(
        "fail_closed",
        description=(
            "while Redis is unreachable: admit nothing new (503 with Retry-After), or admit within "
            "1/N of the budget, N the processes last seen alive"
        ),
    )
    redis_shared_scrape: bool = Field(
        True,
        description=(
            "with redis_url: one process at a time reads each backend's /metrics and the others "
            "take its reading from Redis (gateway.shared_scrape); false: every process reads it"
        ),
    )
    workers: int = Field(
        1, ge=1, le=64, description="processes serving on this host; more than one needs redis_url"
    )
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="largest request body (413 above)"
    )
    max_header_bytes: int = Field(
        DEFAULT_MAX_HEADER_BYTES, ge=1024, description="request line and headers together (431 above)"
    )
    header_timeout_s: float = Field(
        DEFAULT_HEADER_TIMEOUT_S, gt=0, le=3600, description="a request's head must arrive within this (408)"
    )
    body_timeout_s: float = Field(
        DEFAULT_BODY_TIMEOUT_S, gt=0, le=3600, description="its body within this after the head (408)"
    )
    large_body_bytes_per_s: int = Field(
        DEFAULT_LARGE_BODY_BYTES_PER_S,
        ge=0,
        description="pace of large bodies' bytes past their first 64 KiB, all of this process's "
        "together, after a burst of max_body_bytes (0: unpaced)",
    )
    max_client_connections: int = Field(
        DEFAULT_MAX_CLIENT_CONNECTIONS,
        ge=1,
        description="open client connections at most (503 and close above)",
    )

    # Shutdown.
    shutdown_delay_s: float = Field(
        DEFAULT_SHUTDOWN_DELAY_S, ge=0, description="on SIGTERM, keep listening (not ready) this long"
    )
    shutdown_grace_s: float = Field(
        DEFAULT_SHUTDOWN_GRACE_S, ge=0, description="then let streams in flight finish for this long"
    )

    # Tokenization.
    tokenizer_threads: int = Field(
        DEFAULT_TOKENIZER_THREADS, ge=1, le=64, description="threads that count prompts off the event loop"
    )
    tokenizer_max_pending: int = Field(
        DEFAULT_TOKENIZER_MAX_PENDING, ge=1, description="bodies waiting to be counted at most (503 above)"
    )
    tokenizer_inline_max_bytes: int = Field(
        DEFAULT_TOKENIZER_INLINE_MAX_BYTES,
        ge=0,
        le=64 * 1024,
        description="bodies up to this size are counted on the event loop",
    )
    # Chat templates sent in requests (`chat_template`, or inside `chat_template_kwargs`) are
    # code from the client. Off: refused with 400, as vLLM refuses them without its
    # --trust-request-chat-template. On: rendered in bounded worker processes (gateway.render_pool);
    # turn it on only together with vLLM's flag, or vLLM refuses what kvgate rendered.
    trust_request_chat_template: bool = Field(
        False,
        description="render chat templates sent in requests (with vLLM's --trust-request-chat-template)",
    )

    @field_validator("priority_classes", mode="before")
    @classmethod
    def _classes(cls, value: Any) -> Any:
        # A partial table names only the classes it changes (`--set` and the environment hand
        # it over as JSON text); every other class keeps the defaults.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"must be a table of classes (JSON: {exc.msg})") from None
        if not isinstance(value, Mapping):
            raise ValueError("must be a table of classes: high, normal, low")
        return {**{priority.value: {} for priority in Priority}, **dict(value)}

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
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else _backend_url(value)

    @field_validator("backends")
    @classmethod
    def _backend_entries(cls, value: list[str]) -> list[str]:
        specs = [_backend_spec(entry) for entry in value]
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"two backends have the same name: {sorted(names)}")
        return [f"{spec.name}={DNS_SCHEME_PREFIX if spec.resolve else ''}{spec.url}" for spec in specs]

    def backend_specs(self) -> list[BackendSpec]:
        """The backends to front, named: `backend_url` as `backend_name`, or `backends`."""
        if self.backend_url is not None:
            return [BackendSpec(self.backend_name, self.backend_url)]
        return [_backend_spec(entry) for entry in self.backends]

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        problems: list[str] = []
        if (self.backend_url is None) == (not self.backends):
            problems.append(
                "give either backend_url (one backend) or backends (several), not both nor neither"
            )
        if self.metrics_stale_after_s < self.metrics_poll_interval_s:
            problems.append("metrics_stale_after_s must be at least metrics_poll_interval_s")
        if self.workers > 1 and self.redis_url is None:
            problems.append("workers > 1 share one budget through Redis: set redis_url too")
        if self.redis_url is not None and not self.redis_url.get_secret_value().startswith(
            ("redis://", "rediss://", "unix://")
        ):
            problems.append("redis_url must start with redis://, rediss:// or unix://")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def admin_enabled(self) -> bool:
        """Whether /admin/* is served at all (see `admin_api`)."""
        if self.admin_api == "off":
            return False
        return self.admin_api == "on" or self.admin_token is not None or is_loopback(self.host)

    def queue_max(self) -> dict[Priority, int]:
        return {priority: cls.queue_max for priority, cls in self.priority_classes.items()}

    def queue_timeout_s(self) -> dict[Priority, float]:
        return {priority: cls.queue_timeout_s for priority, cls in self.priority_classes.items()}

    def public_view(self) -> dict[str, Any]:
        """The settings as JSON-safe values, secrets masked (for /admin/state and logs)."""
        data = self.model_dump(mode="json")
        for secret in ("admin_token", "backend_api_key", "priority_token"):
            if data.get(secret) is not None:
                data[secret] = REDACTED
        if self.backend_url is not None:
            data["backend_url"] = redact_url(self.backend_url)
        data["backends"] = [f"{spec.name}={redact_url(spec.url)}" for spec in self.backend_specs()]
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
        "budget_max_fraction",
        "aimd_decrease_factor",
        "budget_overcommit",
        "output_quantile",
        "output_backend_prior",
        "priority_classes",
        "hol_deadline_share",
        "arrival_slack",
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

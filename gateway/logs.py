"""The log output of `kvgate serve`: readable text (the default) or one JSON object per line.

`configure_logging` puts one handler on the root logger; uvicorn's loggers reach it too (serve
passes uvicorn no logging configuration of its own), so with `log_format = "json"` every line
the process writes is a JSON object. Every line written while a request is handled carries its
request id (`gateway.request_id`).

The logger `kvgate.requests` writes one INFO line per request, when its outcome is final
(`log_request`), from the fields of its `RequestSummary`: ids, labels, times, block and token
counts. Never a prompt, a completion, a key or a header value.

JSON lines hold `ts` (UTC, ISO 8601), `level`, `logger`, `message`, `request_id` when there is
one, the request fields when it is a request line, and `exc_info` for an exception.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from gateway.credentials import redact_urls_in
from gateway.recent import RequestSummary
from gateway.request_id import current_request_id

REQUEST_LOGGER = "kvgate.requests"
# The LogRecord attribute that carries a request line's fields to the formatters.
FIELDS_ATTRIBUTE = "kvgate_fields"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"
QUIET_LOGGERS = ("httpx", "httpcore")
_CORE_KEYS = frozenset({"ts", "level", "logger", "message", "exc_info", "stack_info"})

LogFormat = Literal["text", "json"]


class CredentialFilter(logging.Filter):
    """Masks the credentials of URLs in a record's message (`user:password@` in a backend URL
    that a library logs as it requests it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format: the handler reports it as logging does
            return True
        redacted = redact_urls_in(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class RequestIdFilter(logging.Filter):
    """Stamps each record with the id of the request being handled, unless it has one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS_ATTRIBUTE, None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One compact JSON object per record (see the module docstring for its keys)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            data["request_id"] = request_id
        for key, value in _fields(record).items():
            if key not in _CORE_KEYS:
                data[key] = value
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack_info"] = self.formatStack(record.stack_info)
        # default=str: a stray object in a field must not cost the line.
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger [request id]: message key=value ...`"""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        request_id = getattr(record, "request_id", None)
        record.request_tag = f" [{request_id}]" if request_id else ""
        line = super().formatMessage(record)
        pairs = [f"{key}={value}" for key, value in _fields(record).items() if value is not None]
        return f"{line} {' '.join(pairs)}" if pairs else line


def formatter_for(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else TextFormatter()


def configure_logging(level: str, log_format: LogFormat, stream: TextIO | None = None) -> logging.Handler:
    """Send every logger's records at `level` and above to `stream` (stderr) in `log_format`,
    replacing the root logger's handlers. Returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter_for(log_format))
    handler.addFilter(RequestIdFilter())
    handler.addFilter(CredentialFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # Python warnings become log records too, instead of bare lines on stderr.
    logging.captureWarnings(True)
    if level.lower() != "debug":
        # httpx logs every exchange at INFO: five metrics scrapes a second, and each relayed
        # request twice over beside kvgate's own request line.
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    _adopt_transformers_logging()
    return handler


def _adopt_transformers_logging() -> None:
    """transformers logs through a stderr handler of its own, in its own format, and advises at
    import that PyTorch is missing (kvgate only needs its tokenizers). Import it now without
    that advice, and send its records to the root handler like everyone else's."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover - a dependency; nothing to adopt without it
        return
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()


def log_request(logger: logging.Logger, summary: RequestSummary) -> None:
    """Write the request line of a finished request (INFO)."""
    if logger.isEnabledFor(logging.INFO):
        fields = summary.fields()
        logger.info("request", extra={"request_id": fields.pop("request_id"), FIELDS_ATTRIBUTE: fields})

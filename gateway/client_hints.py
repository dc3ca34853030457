"""What a client tells kvgate in headers: its priority, its deadlines, its answer's length (pure).

Headers (names are case-insensitive; the mapping passed in must be, or use lower case):

- `X-Kvgate-Priority: high|normal|low` (default normal). Anyone may lower a request's
  priority; raising it to high takes the operator's priority token (`priority_token`) in
  `X-Kvgate-Priority-Token`. Without it, high counts as normal: a client cannot jump the
  queue, and one written for a kvgate that trusted the header still gets served. A token that
  is sent but wrong is refused (403), so that a misconfigured client learns of it.
  vLLM's own body field `priority` (lower runs earlier under `--scheduling-policy priority`,
  which also preempts running requests for it; ignored otherwise) follows the same rule: a
  value below 0 takes the token, else 403 (kvgate relays the body as sent, so it cannot lower
  the value instead).
- `X-Kvgate-Deadline-Ms`: the whole response must be complete within this many milliseconds
  of arrival.
- `X-Kvgate-TTFT-Ms`: the first token must arrive within this many milliseconds.
- `x-stainless-read-timeout` (seconds, sent by the OpenAI SDKs): used only when neither
  kvgate header is present. The SDK applies it as an HTTP read timeout, so it bounds the whole
  answer of a non-streaming request and the first chunk of a streaming one.
- `X-Kvgate-Expected-Output-Tokens`: the output tokens per sequence the client expects (a batch
  job or a classifier knows them). kvgate reserves that instead of its learned length (see
  `gateway.output_model.output_reservation`), within what the body guarantees and allows
  (never below `min_tokens` or, with `ignore_eos`, the cap; never above `max_tokens` or the
  context). Anyone may send it, as anyone may set `max_tokens`: it moves only the sender's own
  reservation. That reservation is also what others are admitted against, so a client that
  tells less than its answers run to is admitted sooner and leaves the difference to vLLM's
  preemption, as an answer longer than a learned reservation does. An answer that outgrows it
  is covered as any such answer: a stream's reservation grows with its tokens
  (`gateway.ledger`), a plain answer's excess shows in vLLM's usage at the next scrape
  (`gateway.capacity`).

`queue_deadline` turns them into the last moment a request may leave the queue and still get
what its client asks for: the time minus the service the request still needs once admitted (as
measured on recent requests), never later than its priority class's queue timeout. The
headers say what the client wants. A deadline for the whole answer is what it is judged by
when it sends one, with or without a first-token time: it waits for the answer. A first-token
time alone is where such a client stops caring (a streaming OpenAI SDK client's read timeout),
so it is the deadline then.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.admission import Priority
from gateway.credentials import token_matches
from gateway.errors import PermissionDeniedError

PRIORITY_HEADER = "x-kvgate-priority"
PRIORITY_TOKEN_HEADER = "x-kvgate-priority-token"
# vLLM's request field: lower is served earlier, 0 is everyone's default.
BODY_PRIORITY_FIELD = "priority"
DEADLINE_HEADER = "x-kvgate-deadline-ms"
TTFT_HEADER = "x-kvgate-ttft-ms"
SDK_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
EXPECTED_OUTPUT_HEADER = "x-kvgate-expected-output-tokens"

# A deadline beyond a day is a mistake, not a wish; refuse it rather than overflow timers.
MAX_DEADLINE_MS = 86_400_000.0
# More output than any model's context holds: a larger figure is a mistake. Every value is capped
# by the request's own output cap anyway; the bound keeps the digits parsed few.
MAX_EXPECTED_OUTPUT_TOKENS = 10_000_000
_DIGITS = re.compile(r"[0-9]+")


class HintError(ValueError):
    """A kvgate header is malformed; `header` names it (the 400's `param`)."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header
        self.message = message


@dataclass(frozen=True, slots=True)
class ClientHints:
    priority: Priority
    total_s: float | None  # whole response, from arrival
    first_token_s: float | None  # first token, from arrival
    # Output tokens per sequence the client expects (None: not told; kvgate's model decides).
    expected_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ServiceEstimate:
    """Seconds a request needs once admitted: to its first token and to its last."""

    first_token_s: float
    complete_s: float


NO_SERVICE_ESTIMATE = ServiceEstimate(0.0, 0.0)


def _milliseconds(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise HintError(name, f"header {name} must be a number of milliseconds, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_DEADLINE_MS:
        raise HintError(name, f"header {name} must lie in (0, {MAX_DEADLINE_MS:.0f}] ms, got {raw!r}")
    return value / 1000.0


def parse_hints(
    headers: Mapping[str, str],
    *,
    streaming: bool,
    priority_token: str | None = None,
    body_priority: object = None,
) -> ClientHints:
    """The hints of a request with these `headers`; `priority_token` is the operator's (None:
    nobody may raise priority) and `body_priority` the body's `priority` field (None: absent).
    Raises HintError (400) for a malformed header, PermissionDeniedError (403) for a wrong
    priority token or a raised vLLM priority without the right one."""
    raw_priority = headers.get(PRIORITY_HEADER)
    if raw_priority is None:
        priority = Priority.NORMAL
    else:
        try:
            priority = Priority(raw_priority.strip().lower())
        except ValueError:
            raise HintError(
                PRIORITY_HEADER, f"header {PRIORITY_HEADER} must be high, normal or low, got {raw_priority!r}"
            ) from None
    may_raise = _may_raise_priority(headers.get(PRIORITY_TOKEN_HEADER), priority_token)
    if priority is Priority.HIGH and not may_raise:
        priority = Priority.NORMAL
    if not may_raise and _raises_vllm_priority(body_priority):
        raise PermissionDeniedError(
            f"a '{BODY_PRIORITY_FIELD}' below 0 (served before everyone else's) needs the priority token "
            f"in {PRIORITY_TOKEN_HEADER}",
            param=BODY_PRIORITY_FIELD,
            code="priority_not_allowed",
        )
    total_s = _milliseconds(headers, DEADLINE_HEADER)
    first_token_s = _milliseconds(headers, TTFT_HEADER)
    if total_s is None and first_token_s is None:
        sdk_timeout_s = _sdk_read_timeout(headers.get(SDK_READ_TIMEOUT_HEADER))
        if sdk_timeout_s is not None:
            if streaming:
                first_token_s = sdk_timeout_s
            else:
                total_s = sdk_timeout_s
    return ClientHints(priority, total_s, first_token_s, _expected_output_tokens(headers))


def _expected_output_tokens(headers: Mapping[str, str]) -> int | None:
    raw = headers.get(EXPECTED_OUTPUT_HEADER)
    if raw is None:
        return None
    # Plain ASCII digits only: no sign, no fraction, none of the underscores or other scripts'
    # digits that int() would take.
    digits = raw.strip()
    significant = digits.lstrip("0")
    if (
        _DIGITS.fullmatch(digits) is None
        or len(significant) > len(str(MAX_EXPECTED_OUTPUT_TOKENS))
        or not 1 <= int(significant or "0") <= MAX_EXPECTED_OUTPUT_TOKENS
    ):
        raise HintError(
            EXPECTED_OUTPUT_HEADER,
            f"header {EXPECTED_OUTPUT_HEADER} must be a whole number of tokens in "
            f"[1, {MAX_EXPECTED_OUTPUT_TOKENS}], got {raw!r}",
        )
    return int(significant)


def _may_raise_priority(offered: str | None, priority_token: str | None) -> bool:
    if offered is None or priority_token is None:
        return False  # a token sent to a kvgate that has none configured is just not one
    if not token_matches(offered.strip(), priority_token):
        raise PermissionDeniedError(
            f"the priority token in {PRIORITY_TOKEN_HEADER} is wrong",
            param=PRIORITY_TOKEN_HEADER,
            code="invalid_priority_token",
        )
    return True


def _raises_vllm_priority(value: object) -> bool:
    """Whether vLLM would read `value` as a priority below 0. Its field is a lax pydantic int:
    numbers and numeric strings count, a string is taken as negative if it starts with '-'."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value < 0
    if isinstance(value, str):
        return value.strip().startswith("-")
    return False  # anything else vLLM refuses itself


def _sdk_read_timeout(raw: str | None) -> float | None:
    # The SDK's header is advisory and not ours to police: ignore anything unusable.
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return min(value, MAX_DEADLINE_MS / 1000.0)


def queue_deadline(
    arrived_at: float,
    hints: ClientHints,
    queue_timeout_s: float,
    service: ServiceEstimate,
) -> float:
    """The last moment (monotonic seconds) at which leaving the queue still gives the client
    what its headers ask for (see the module docstring)."""
    deadline = arrived_at + queue_timeout_s
    if hints.total_s is not None:
        return min(deadline, arrived_at + hints.total_s - service.complete_s)
    if hints.first_token_s is not None:
        return min(deadline, arrived_at + hints.first_token_s - service.first_token_s)
    return deadline

"""An admitted request's claim on one backend's ledger, and the summary it concludes with.

The wait queue opens a `Reservation` on the backend its plan chose (`open`, synchronous, at
the moment of admission). The relay then reports to it as its observer: the first byte, the
tokens each choice streamed (they grow the ledger), and the end. `finish` completes it exactly
once, whatever the path: the router (`gateway.router`) closes the ledger entry, concludes the
request and learns from the answer. A connection that fails before any byte was sent may move
the reservation to another backend of the model once (`move`), before the relay starts again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.admission import Ask
from gateway.ledger import ClosedEntry
from gateway.outcomes import CLIENT_CLOSED_STATUS, Outcome
from gateway.prepare import Prepared, Sizing
from gateway.proxy import RelayResult
from gateway.recent import RequestSummary

if TYPE_CHECKING:
    from gateway.backend import Backend
    from gateway.conclude import Concluder

log = logging.getLogger(__name__)

# The backend label of a request concluded before any backend took it, in a fleet.
NO_BACKEND = "none"
# The `code` in the request line of an answer whose token counts were unusable (not learned).
USAGE_INVALID_CODE = "backend_usage_invalid"


@dataclass(frozen=True, slots=True)
class SizedRequest:
    """A prepared request sized for the backends of its model: `reference` is the sizing its
    queue deadline and accounting use, `sizings` the one of each backend that can take it."""

    prepared: Prepared
    reference: Sizing
    sizings: Mapping[str, Sizing]

    @property
    def ask(self) -> Ask:
        return self.reference.ask


class Reservation:
    """An admitted request's claim on the ledger; also the relay's observer."""

    def __init__(
        self, concluder: Concluder, backend_named: Callable[[str], Backend], key: int, request: SizedRequest
    ) -> None:
        self._concluder = concluder
        self._backend_named = backend_named
        self.key = key
        self.request = request
        self.prepared = request.prepared
        self.backend: Backend | None = None
        self.sizing: Sizing = request.reference
        self.queued_at: float | None = None
        # What the queue predicted it would wait, when it had to wait (see QueueEntry).
        self.predicted_queue_s: float | None = None
        self.admitted_at: float | None = None
        self.first_byte_at: float | None = None
        self.moved = False
        self.finished = False

    @property
    def queue_seconds(self) -> float:
        """Time spent in the wait queue (0 until admitted)."""
        if self.admitted_at is None or self.queued_at is None:
            return 0.0
        return max(0.0, self.admitted_at - self.queued_at)

    # Called by the wait queue, synchronously, at the moment of admission.
    def open(self, now: float, onto: str) -> None:
        backend = self._backend_named(onto)
        self._place(backend, now)
        self.admitted_at = now
        self._concluder.admitted(self)

    def _place(self, backend: Backend, now: float) -> None:
        self.backend = backend
        self.sizing = self.request.sizings.get(backend.name, self.request.reference)
        prepared = self.prepared
        hashes = prepared.prompt.block_hashes if prepared.hash_block_size == backend.block_size() else ()
        backend.open(self.key, self.sizing.demand, now, streamed=prepared.streaming, block_hashes=hashes)

    def move(self, backend: Backend, now: float) -> None:
        """Take the reservation off its backend (whose connection failed before any byte was
        sent: it never saw the request) and open it on `backend`."""
        assert self.backend is not None
        self.backend.ledger.close(self.key)
        self.moved = True
        self._place(backend, now)

    def on_first_byte(self, now: float) -> None:
        self.first_byte_at = now
        self._concluder.first_byte(self, now)

    def on_tokens(self, choice: int, tokens: int) -> None:
        if self.backend is not None:
            self.backend.ledger.grow(self.key, choice, tokens)

    def on_finish(self, outcome: Outcome, result: RelayResult, now: float) -> None:
        problem = self._counts_problem(result)
        if problem is not None:
            # The answer went to the client as it was; only the gateway's learning refuses it.
            log.warning(
                "backend %s: unusable token counts in an answer (%s); not learned", self.backend_name, problem
            )
            result = dataclasses.replace(
                result,
                usage=None,
                tokens_by_choice={},
                counts_trusted=False,
                code=result.code or USAGE_INVALID_CODE,
            )
        self.finish(outcome, result, now)

    @property
    def backend_name(self) -> str:
        return self.backend.name if self.backend is not None else NO_BACKEND

    def _counts_problem(self, result: RelayResult) -> str | None:
        """What makes the token counts of a relayed answer unusable, or None. Every sequence of
        a request fits in the model's context: a count beyond that is no count (negative, bool,
        float and huge ones are caught by the parser, see `gateway.sse`)."""
        demand = self.sizing.demand
        info = self.backend.info if self.backend is not None else None
        served = info.find(self.prepared.model) if info is not None else None
        context = served.max_model_len if served is not None else None
        usage = result.usage
        if usage is not None and usage.invalid is not None:
            return usage.invalid
        if context is None:
            return None
        prompts, sequences = len(demand.prompt_tokens), demand.sequences
        if usage is not None and (usage.prompt_tokens or 0) > prompts * context:
            return f"prompt_tokens {usage.prompt_tokens} for {prompts} prompt(s) of {context} at most"
        if usage is not None and (usage.completion_tokens or 0) > sequences * context:
            return f"completion_tokens {usage.completion_tokens} for {sequences} sequence(s) of {context} at most"
        if any(tokens > context for tokens in result.tokens_by_choice.values()):
            return f"a streamed choice counted over {context} tokens"
        return None

    def finish(self, outcome: Outcome, result: RelayResult | None, now: float) -> bool:
        """Complete the reservation; True only for the call that did it."""
        if self.finished:
            return False
        self.finished = True
        self._concluder.finished(self, outcome, result, now)
        return True


def summary(
    backend: str,
    request: SizedRequest,
    outcome: Outcome,
    status: int | None,
    now: float,
    *,
    queue_s: float,
    sizing: Sizing | None = None,
    predicted_queue_s: float | None = None,
    actual_blocks: int | None = None,
    completion_tokens: int | None = None,
    code: str | None = None,
) -> RequestSummary:
    prepared = request.prepared
    sizing = sizing or request.reference
    return RequestSummary(
        request_id=prepared.request_id,
        backend=backend,
        route=prepared.route.value,
        outcome=outcome,
        status=status,
        code=code,
        arrived_at=prepared.arrived_at,
        finished_at=now,
        queue_s=queue_s,
        predicted_queue_s=predicted_queue_s,
        priority=sizing.ask.priority.value,
        model=prepared.model,
        stream=prepared.streaming,
        estimated_blocks=sizing.demand.reserved_blocks,
        actual_blocks=actual_blocks,
        prompt_tokens=prepared.prompt.tokens,
        completion_tokens=completion_tokens,
    )


# The status a client was sent when the relay reported none (it never started).
_STATUS_WITHOUT_RELAY = {Outcome.CLIENT_GONE: CLIENT_CLOSED_STATUS, Outcome.REJECTED_INVALID: 400}


def finished_summary(
    reservation: Reservation,
    outcome: Outcome,
    result: RelayResult | None,
    closed: ClosedEntry | None,
    now: float,
) -> RequestSummary:
    """The summary of an admitted request. Output tokens come from the backend's usage when
    it sent one, else from the ledger's count of streamed tokens; actual blocks from the
    ledger's count for a stream (exact per sequence), else from usage spread evenly over the
    sequences."""
    demand = reservation.sizing.demand
    status = result.status if result is not None else None
    if status is None:
        status = _STATUS_WITHOUT_RELAY.get(outcome)
    trusted = result is None or result.counts_trusted
    streamed = closed.output_tokens if closed is not None and trusted else ()
    usage = result.usage.completion_tokens if result is not None and result.usage is not None else None
    completion = usage if usage is not None else (sum(streamed) if any(streamed) else None)
    actual = None
    if any(streamed) and closed is not None:
        actual = closed.held_blocks
    elif usage is not None:
        per_sequence = math.ceil(usage / demand.sequences)
        actual = demand.blocks_at(min(per_sequence, demand.max_output_tokens))
    return summary(
        reservation.backend_name,
        reservation.request,
        outcome,
        status,
        now,
        queue_s=reservation.queue_seconds,
        sizing=reservation.sizing,
        predicted_queue_s=reservation.predicted_queue_s,
        actual_blocks=actual,
        completion_tokens=completion,
        code=result.code if result is not None else None,
    )

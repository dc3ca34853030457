"""How a request ended, once and for all (pure); the label of `kvgate_requests_total`.

Each request gets exactly one outcome. Admission is not an outcome but a step on the way (an
admitted request ends completed, client_gone or upstream_error): it is counted on its own in
`kvgate_admitted_total`, so that admitted = completed + client_gone + upstream_error +
rejected_by_backend once nothing is in flight.
"""

from __future__ import annotations

from enum import StrEnum

from gateway.admission import Decision, Reason

# nginx's convention for "client closed the request": the status of a request whose client left
# before any answer (nobody is left to read it; it shows in logs and /admin/state).
CLIENT_CLOSED_STATUS = 499


class Outcome(StrEnum):
    COMPLETED = "completed"
    SHED_QUEUE_FULL = "shed_queue_full"
    SHED_DEADLINE = "shed_deadline"  # predicted to miss its deadline (or objective): shed at once
    SHED_TIMEOUT = "shed_timeout"  # still queued when its deadline came
    SHED_UNAVAILABLE = "shed_unavailable"  # 503: no budget known, backend down, not ready
    REJECTED_INVALID = "rejected_invalid"  # 4xx from kvgate's own validation
    REJECTED_BY_BACKEND = "rejected_by_backend"  # admitted, but the backend answered 4xx
    CLIENT_GONE = "client_gone"
    UPSTREAM_ERROR = "upstream_error"

    @property
    def shed(self) -> bool:
        """Answered 429 or 503 by kvgate with a retry hint."""
        return self in _SHED


_SHED = frozenset(
    {Outcome.SHED_QUEUE_FULL, Outcome.SHED_DEADLINE, Outcome.SHED_TIMEOUT, Outcome.SHED_UNAVAILABLE}
)


_SHED_OUTCOMES = {
    Reason.QUEUE_FULL: Outcome.SHED_QUEUE_FULL,
    Reason.DEADLINE_UNREACHABLE: Outcome.SHED_DEADLINE,
    Reason.DEADLINE_EXPIRED: Outcome.SHED_TIMEOUT,
    Reason.BUDGET_UNKNOWN: Outcome.SHED_UNAVAILABLE,
    Reason.BACKEND_DOWN: Outcome.SHED_UNAVAILABLE,
    Reason.SHUTTING_DOWN: Outcome.SHED_UNAVAILABLE,
    Reason.EXCEEDS_POOL: Outcome.REJECTED_INVALID,
}


def outcome_of_refusal(decision: Decision) -> Outcome:
    """The outcome of a request the policy shed or rejected."""
    return _SHED_OUTCOMES.get(decision.reason, Outcome.SHED_UNAVAILABLE)

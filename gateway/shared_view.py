"""One backend's ledger as several kvgate processes share it (pure).

Each process keeps its own requests in an `InMemoryLedger`, exactly as alone: what they hold,
reserve and are credited, token by token. What the others have in flight reaches it from Redis
(`gateway.redis_store`): their booked blocks, exact as of the last answer from Redis, and the
view each published at its last scrape (held blocks, settled or fresh, credit, completions).
`SharedLedger` adds the others to its own totals, so that everything reading the ledger (the
budget's reconciliation with vLLM's /metrics, the admission policy) sees the backend as one
gateway would: vLLM's usage is explained by everyone's requests, not counted twice as someone
else's load, and a free block is free for all of them.

While Redis cannot be reached the others' bookings are unknown. Then `standing` says what the
budget may promise: nothing (fail closed), or `1 / processes` of it over this process's own
requests alone (fail open, processes: as many as were last seen alive).

The lease sink hears of every change of a reservation's size and of every completion, so the
shell can tell Redis; it must not block (the shell queues and batches).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.capacity import Standing
from gateway.ledger import ClosedEntry, HeldSplit, InMemoryLedger, LedgerTotals


@dataclass(frozen=True, slots=True)
class PeerView:
    """What one process published of its requests on a backend at its last scrape, in blocks."""

    held_blocks: int = 0
    settled_blocks: int = 0  # of the held, those of requests settled by then (see capacity)
    settled_sequences: int = 0
    unseen_blocks: int = 0
    credit_blocks: int = 0
    released_blocks: int = 0  # its counter of what its completed requests held
    # Requests waiting in its queue for the backend: while anyone's wait, everyone's budget
    # may grow past the pool on evidence of room (see gateway.capacity, overcommit).
    waiting: int = 0
    # Its counter of the blocks its completed requests had reserved: their differences are
    # the blocks it freed, which the backend's drain rate (waits, Retry-After) must count too.
    freed_blocks: int = 0
    # What its requests are certain still to grow into (min_tokens, ignore_eos): room that
    # vLLM shows unused but is taken (see gateway.capacity, overcommit).
    certain_growth_blocks: int = 0

    def values(self) -> tuple[int, ...]:
        return (
            self.held_blocks,
            self.settled_blocks,
            self.settled_sequences,
            self.unseen_blocks,
            self.credit_blocks,
            self.released_blocks,
            self.waiting,
            self.freed_blocks,
            self.certain_growth_blocks,
        )

    def to_text(self) -> str:
        return json.dumps(self.values(), separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> PeerView | None:
        """Parse a published view; None for text that is not one. Fields are only ever added
        at the end: during a rolling update an older process's view lacks the newest ones
        (read as 0) and a newer one's has more (ignored)."""
        try:
            values = json.loads(text)
        except ValueError:
            return None
        if (
            not isinstance(values, list)
            or len(values) < FIRST_FIELDS
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
        ):
            return None
        return cls(*values[:FIELDS])

    @staticmethod
    def total(views: Iterable[PeerView]) -> PeerView:
        sums = [0] * FIELDS
        for view in views:
            for index, value in enumerate(view.values()):
                sums[index] += value
        return PeerView(*sums)


FIELDS = len(PeerView().values())
# The fields of the first published layout: a view with fewer is not one.
FIRST_FIELDS = 8


class LeaseSink(Protocol):
    """Where a shared ledger reports its reservations' changes. Never blocks, never raises."""

    def resized(self, backend: str, key: int, blocks: int) -> None:
        """The reservation `key` now reserves `blocks` (> 0) on `backend`."""
        ...

    def released(self, backend: str, key: int) -> None:
        """The reservation `key` on `backend` was completed."""
        ...


class SharedLedger(InMemoryLedger):
    """This process's requests on one backend, plus the others' (see the module docstring)."""

    def __init__(self, backend: str, sink: LeaseSink) -> None:
        super().__init__()
        self.backend = backend
        self._sink = sink
        self.others_booked = 0
        self._peers = PeerView()
        self.connected = False  # an answer from Redis has been read since the last failure
        self.fail_open = False
        self.processes = 1  # last seen alive, this one included
        # Told of the blocks the other processes' requests freed since the last views (the
        # backend's pace counts them, see gateway.pace); None: nobody listens.
        self.on_freed: Callable[[int], None] | None = None
        self._freed_by: dict[str, int] = {}
        self._freed = 0

    # -- what Redis said ----------------------------------------------------------------------

    def heard(
        self,
        others_booked: int,
        views: Mapping[str, PeerView] | None = None,
        processes: int | None = None,
    ) -> None:
        """An answer from Redis: the others' booked blocks and, from a renewal, their views by
        process and how many processes are alive."""
        self.others_booked = max(0, others_booked)
        if views is not None:
            self._peers = PeerView.total(views.values())
            freed = 0
            for owner, view in views.items():
                before = self._freed_by.get(owner)
                if before is not None and view.freed_blocks > before:
                    freed += view.freed_blocks - before
            # A process seen for the first time sets its baseline; one gone is forgotten.
            self._freed_by = {owner: view.freed_blocks for owner, view in views.items()}
            if freed and self.on_freed is not None:
                self.on_freed(freed)
        if processes is not None:
            self.processes = max(1, processes)
        self.connected = True

    def lost(self) -> None:
        """Redis did not answer: the others' bookings are unknown from now on."""
        self.connected = False

    def standing(self) -> Standing:
        if self.connected:
            return Standing()
        if self.fail_open:
            return Standing(share=1.0 / self.processes)
        return Standing(unavailable="the shared ledger (Redis) cannot be reached")

    # -- the Ledger, with the others added ----------------------------------------------------

    def grow(self, key: int, sequence: int, tokens: int) -> None:
        before = self.reserved_of(key)
        super().grow(key, sequence, tokens)
        after = self.reserved_of(key)
        if after is not None and after != before:
            self._sink.resized(self.backend, key, after)

    def close(self, key: int) -> ClosedEntry | None:
        closed = super().close(key)
        if closed is not None:
            self._freed += closed.reserved_blocks
            self._sink.released(self.backend, key)
        return closed

    def totals(self) -> LedgerTotals:
        own = super().totals()
        if not self.connected:
            # Fail open: this process's own requests against its share; fail closed: nothing is
            # admitted anyway. The others' last bookings are not counted in either.
            return own
        peers = self._peers
        return LedgerTotals(
            entries=own.entries,
            reserved_blocks=own.reserved_blocks + self.others_booked,
            held_blocks=own.held_blocks + peers.held_blocks,
            credit_blocks=own.credit_blocks + peers.credit_blocks,
            unseen_blocks=own.unseen_blocks + peers.unseen_blocks,
        )

    def own_totals(self) -> LedgerTotals:
        return super().totals()

    @property
    def released_blocks(self) -> int:
        return super().released_blocks + self._peers.released_blocks

    def held_split(self, settled_before: float) -> HeldSplit:
        own = super().held_split(settled_before)
        peers = self._peers
        # The others' held blocks are explained by their requests, which vLLM really holds: the
        # ones settled by their last scrape may earn credit, as ours do; the rest are fresh.
        return HeldSplit(
            own.settled_blocks + peers.settled_blocks,
            own.fresh_blocks + peers.held_blocks - peers.settled_blocks,
            own.settled_sequences + peers.settled_sequences,
            own.newest_settled_at,
            own.certain_growth_blocks + peers.certain_growth_blocks,
        )

    @property
    def others_waiting(self) -> int:
        """Requests the other processes had waiting for this backend at their last scrape."""
        return self._peers.waiting if self.connected else 0

    def view(self, settled_before: float, waiting: int = 0) -> PeerView:
        """What this process publishes of its own requests at a scrape (`waiting`: its queue's
        requests for the backend)."""
        own = super().held_split(settled_before)
        totals = super().totals()
        return PeerView(
            held_blocks=totals.held_blocks,
            settled_blocks=own.settled_blocks,
            settled_sequences=own.settled_sequences,
            unseen_blocks=totals.unseen_blocks,
            credit_blocks=totals.credit_blocks,
            released_blocks=super().released_blocks,
            waiting=waiting,
            freed_blocks=self._freed,
            certain_growth_blocks=own.certain_growth_blocks,
        )

    def leases(self) -> Mapping[int, int]:
        """Every open reservation's key and reserved blocks (for renewing the leases)."""
        return {entry.key: entry.reserved_blocks for entry in self.entries()}

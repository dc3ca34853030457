"""The open loop: what the gateway has sent to a backend and what each request holds (pure).

For every in-flight request the ledger keeps its `Demand`, how many output tokens each of its
sequences has streamed so far, and from those two numbers in blocks:

- `held`: what the request occupies now by the ledger's count (prompt + streamed tokens);
- `reserved`: what it is expected to occupy at its peak, prompt + the reserved output, grown
  past the reservation when the request outgrows it (KV only grows until a request ends, so
  the peak is the end);
- `credit`: blocks the closed loop showed it does not really occupy (prefix-cache sharing),
  set by `gateway.capacity` at each scrape and leaving with the request.

Reservations are peaks, and requests in flight do not reach them all at once, nor all reach
them: the one discount of that over-reservation is the budget's overcommit
(`gateway.capacity`), measured on completed requests, not a projection kept here.

`Ledger` is the interface the rest of the gateway uses, so that a store shared between
replicas can replace the in-memory one. Its contract: called from one event loop only (no
locking), every method is O(1) except the per-scrape `held_split` / `set_credit` (O(entries)),
`close` is idempotent and the totals are exact integer sums over the open entries. Whatever runs on every request (admission, the queue's drain-rate
projection) reads totals only, never iterates the entries: its cost must not grow with the
number of requests in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from estimator.demand import Demand


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """Sums over the open entries, in blocks (credit is already part of none of the others)."""

    entries: int
    reserved_blocks: int
    held_blocks: int
    credit_blocks: int
    # Of the reserved blocks, those of answers the gateway cannot watch grow (sent whole, not
    # streamed): vLLM may hold any of them by now while the ledger still counts the prompt.
    unseen_blocks: int = 0

    @property
    def committed_blocks(self) -> int:
        """Blocks promised to the requests in flight, net of what vLLM shares between them."""
        return self.reserved_blocks - self.credit_blocks


@dataclass(frozen=True, slots=True)
class HeldSplit:
    """Held blocks of the entries admitted before a moment (settled) and after it (fresh)."""

    settled_blocks: int
    fresh_blocks: int
    settled_sequences: int
    # When the most recently admitted settled entry was admitted (None: no settled entry).
    newest_settled_at: float | None = None
    # Blocks the entries (settled or fresh) are certain still to grow into: from what they
    # hold up to their floors (`Demand.floor_blocks`). vLLM's usage cannot show them yet.
    certain_growth_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ClosedEntry:
    """What a request held when its reservation was completed."""

    key: int
    demand: Demand
    admitted_at: float
    output_tokens: tuple[int, ...]  # streamed per sequence
    reserved_blocks: int
    held_blocks: int
    # Whether its growth was seen token by token (else `held_blocks` is its prompt only).
    streamed: bool = True

    @property
    def reached_blocks(self) -> int:
        """The blocks it really came to hold, as far as the ledger saw: its reservation for an
        answer sent whole, whose growth it could not watch."""
        return self.held_blocks if self.streamed else self.reserved_blocks

    @property
    def outgrew_reservation(self) -> bool:
        return max(self.output_tokens, default=0) > self.demand.expected_output_tokens


@dataclass(slots=True)
class LedgerEntry:
    """One in-flight request. Mutable, owned by the ledger; read-only to everyone else."""

    key: int
    demand: Demand
    admitted_at: float
    output_tokens: list[int] = field(default_factory=list)
    longest_output: int = 0
    held_blocks: int = 0
    reserved_blocks: int = 0
    credit_blocks: int = 0
    streamed: bool = True


class Ledger(Protocol):
    """In-flight reservations of one backend. See the module docstring for the contract."""

    def open(self, key: int, demand: Demand, now: float, *, streamed: bool = True) -> LedgerEntry:
        """Book `demand` under a fresh `key`; raises KeyError if the key is already open.
        `streamed`: its answer's tokens will be counted as they come (`grow`)."""
        ...

    def grow(self, key: int, sequence: int, tokens: int) -> None:
        """Count `tokens` more streamed output tokens for one sequence (choice index) of
        `key`; unknown keys are ignored (the entry may already be closed)."""
        ...

    def close(self, key: int) -> ClosedEntry | None:
        """Complete the reservation; returns None when it was already completed."""
        ...

    def totals(self) -> LedgerTotals: ...

    @property
    def released_blocks(self) -> int:
        """What the completed entries held at their ends, summed since the ledger was made: a
        counter, for telling what vLLM may still report of requests that just ended."""
        ...

    def remaining_output_tokens(self) -> int:
        """Output tokens the open entries still expect to produce: the sum over entries of
        max(1, expected output - longest sequence so far), at least one while in flight."""
        ...

    def held_split(self, settled_before: float) -> HeldSplit: ...

    def set_credit(self, kept_fraction: float, settled_before: float) -> None:
        """Credit each settled entry (admitted at or before `settled_before`) with the share
        of its held blocks that vLLM does not occupy: floor((1 - kept_fraction) * held).
        Fresh entries get no credit. `kept_fraction` lies in [0, 1]."""
        ...

    def entries(self) -> Iterator[LedgerEntry]: ...


def _to_go(entry: LedgerEntry) -> int:
    """Output tokens until the entry reaches its reservation (at least one while in flight)."""
    return max(1, entry.demand.expected_output_tokens - entry.longest_output)


def _unseen(entry: LedgerEntry) -> int:
    """Reserved blocks of an entry whose growth the ledger cannot see (see LedgerTotals)."""
    return 0 if entry.streamed else entry.reserved_blocks - entry.held_blocks


class InMemoryLedger:
    """The default `Ledger`: a dict of entries and running totals."""

    def __init__(self) -> None:
        self._entries: dict[int, LedgerEntry] = {}
        self._reserved = 0
        self._held = 0
        self._credit = 0
        self._remaining = 0
        self._released = 0
        self._unseen = 0

    @staticmethod
    def _reserved_for(demand: Demand, longest_output: int) -> int:
        # The reservation covers the expected output; once a sequence passes it, cover a
        # block's worth of tokens ahead. vLLM allocates a token's slot before producing it and
        # runs ahead of the stream the gateway reads; with only the next token covered, a few
        # requests crossing block boundaries at once preempted on a full pool (one in 600
        # requests on the CPU testbed).
        tokens = max(demand.expected_output_tokens, longest_output + demand.cost.block_size)
        return demand.blocks_at(min(tokens, demand.max_output_tokens))

    def open(self, key: int, demand: Demand, now: float, *, streamed: bool = True) -> LedgerEntry:
        if key in self._entries:
            raise KeyError(f"ledger entry {key} is already open")
        entry = LedgerEntry(
            key=key,
            demand=demand,
            admitted_at=now,
            output_tokens=[0] * demand.sequences,
            held_blocks=demand.prompt_blocks,
            reserved_blocks=demand.reserved_blocks,
            streamed=streamed,
        )
        self._entries[key] = entry
        self._unseen += _unseen(entry)
        self._reserved += entry.reserved_blocks
        self._held += entry.held_blocks
        self._remaining += _to_go(entry)
        return entry

    def grow(self, key: int, sequence: int, tokens: int) -> None:
        entry = self._entries.get(key)
        if entry is None or tokens <= 0:
            return
        counts = entry.output_tokens
        # A backend may report more choices than we predicted (it should not); fold extras
        # into the last sequence rather than dropping their growth.
        index = min(max(sequence, 0), len(counts) - 1)
        counts[index] += tokens
        if counts[index] <= entry.longest_output:
            return
        demand = entry.demand
        expected = demand.expected_output_tokens
        # _to_go before and after, inline: this runs once per streamed token.
        longest_before, longest = entry.longest_output, counts[index]
        entry.longest_output = longest
        self._remaining += max(1, expected - longest) - max(1, expected - longest_before)
        held = demand.blocks_at(min(longest, demand.max_output_tokens))
        if longest + demand.cost.block_size <= expected:
            # Within the reservation by a block's worth: _reserved_for is the reservation
            # itself, which the entry already holds (it only grows). Computed once a token
            # otherwise, this was half of what a streamed token cost the ledger.
            reserved = entry.reserved_blocks
        else:
            reserved = max(entry.reserved_blocks, self._reserved_for(demand, longest))
        self._held += held - entry.held_blocks
        self._reserved += reserved - entry.reserved_blocks
        unseen_before = 0 if entry.streamed else _unseen(entry)
        entry.held_blocks = held
        entry.reserved_blocks = reserved
        if not entry.streamed:
            self._unseen += _unseen(entry) - unseen_before

    def close(self, key: int) -> ClosedEntry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._reserved -= entry.reserved_blocks
        self._held -= entry.held_blocks
        self._released += entry.held_blocks
        self._credit -= entry.credit_blocks
        self._remaining -= _to_go(entry)
        self._unseen -= _unseen(entry)
        return ClosedEntry(
            key=key,
            demand=entry.demand,
            admitted_at=entry.admitted_at,
            output_tokens=tuple(entry.output_tokens),
            reserved_blocks=entry.reserved_blocks,
            held_blocks=entry.held_blocks,
            streamed=entry.streamed,
        )

    def reserved_of(self, key: int) -> int | None:
        """The blocks the open entry `key` reserves now (None: not open)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.reserved_blocks

    def totals(self) -> LedgerTotals:
        return LedgerTotals(
            entries=len(self._entries),
            reserved_blocks=self._reserved,
            held_blocks=self._held,
            credit_blocks=self._credit,
            unseen_blocks=self._unseen,
        )

    @property
    def released_blocks(self) -> int:
        return self._released

    def remaining_output_tokens(self) -> int:
        return self._remaining

    def held_split(self, settled_before: float) -> HeldSplit:
        settled = fresh = sequences = growth = 0
        newest: float | None = None
        for entry in self._entries.values():
            growth += max(0, entry.demand.floor_blocks - entry.held_blocks)
            if entry.admitted_at <= settled_before:
                settled += entry.held_blocks
                sequences += entry.demand.sequences
                if newest is None or entry.admitted_at > newest:
                    newest = entry.admitted_at
            else:
                fresh += entry.held_blocks
        return HeldSplit(settled, fresh, sequences, newest, growth)

    def set_credit(self, kept_fraction: float, settled_before: float) -> None:
        if not 0.0 <= kept_fraction <= 1.0:
            raise ValueError(f"kept_fraction must lie in [0, 1], got {kept_fraction}")
        total = 0
        for entry in self._entries.values():
            if entry.admitted_at <= settled_before:
                entry.credit_blocks = math.floor((1.0 - kept_fraction) * entry.held_blocks)
            else:
                entry.credit_blocks = 0
            total += entry.credit_blocks
        self._credit = total

    def entries(self) -> Iterator[LedgerEntry]:
        return iter(self._entries.values())

"""The open loop: what the gateway has sent to a backend and what each request holds (pure).

For every in-flight request the ledger keeps its `Demand`, how many output tokens each of its
sequences has streamed so far, and from those two numbers in blocks:

- `held`: what the request occupies now by the ledger's count (prompt + streamed tokens);
- `reserved`: what it is expected to occupy at its peak, prompt + the reserved output, grown
  past the reservation when the request outgrows it (KV only grows until a request ends, so
  the peak is the end);
- `credit`: blocks the closed loop showed it does not really occupy (prefix-cache sharing),
  set by `gateway.capacity` at each scrape and leaving with the request.

Requests do not all reach their peaks at once: while one is at its end, another has just
begun. With `multiplex` on, the ledger commits the projected peak of the whole set rather than
the sum of the peaks (see `projected_peak_blocks`), and the difference is `multiplex_blocks`.

Requests do not all reach their reserved quantile either: each reserves the output length that
only one in ten exceeds (with the default p90), but of many requests together far fewer than
all run that long. With `pooling_z` set, the ledger commits the quantile of the *sum* of what
the requests in flight still have to produce instead of the sum of their quantiles: from each
request's `OutputDistribution` (the learned lengths, given at open) the mean and variance of
its remaining output given how far it already is, and for the set, mean + z x standard
deviation of the total (normal approximation; z from the same quantile). A request beyond
every length observed, or with no distribution, counts its reservation as it is. The
difference is `pooling_blocks`. One request alone gains little; sixteen gain most of the gap
between the quantile and the mean. When both are on, the larger of the two discounts is taken
off, and the commitment never falls below what the requests hold.

Both discounts are recomputed at each scrape (`rebalance`, after the credit) and at each close
while few requests are in flight; in between, an admission adds its whole reservation and a
close keeps the last discount net of the closed request's part, so closes and admissions never
take the commitment below the projection. Streamed tokens are not a recomputation point (they
come by the thousand per second): one request moving ahead of the others between two of them
shifts the projection by about the blocks it grows meanwhile.

`Ledger` is the interface the rest of the gateway uses, so that a store shared between
replicas can replace the in-memory one. Its contract: called from one event loop only (no
locking), every method is O(1) except the per-scrape `held_split` / `set_credit` (O(entries))
and `rebalance` (O(entries x PEAK_BREAKPOINTS) multiplexed, O(entries x log window) pooled,
also run by `close` while at most `REBALANCE_ON_CLOSE_MAX_ENTRIES` are open), `close` is
idempotent and the totals (but `multiplex_blocks` and `pooling_blocks`) are exact integer sums
over the open entries. Whatever runs on every request (admission, the queue's drain-rate
projection) reads totals only, never iterates the entries: its cost must not grow with the
number of requests in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from estimator.demand import Demand
from gateway.output_model import OutputDistribution


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """Sums over the open entries, in blocks (credit is already part of none of the others)."""

    entries: int
    reserved_blocks: int
    held_blocks: int
    credit_blocks: int
    multiplex_blocks: int = 0
    pooling_blocks: int = 0

    @property
    def committed_blocks(self) -> int:
        """Blocks promised to the requests in flight, net of what vLLM shares between them
        and of the peaks (or output lengths) they do not reach together; never less than
        they hold (a discount is recomputed only now and then, while they keep growing)."""
        discount = max(self.multiplex_blocks, self.pooling_blocks)
        return max(self.held_blocks, self.reserved_blocks - discount) - self.credit_blocks


@dataclass(frozen=True, slots=True)
class HeldSplit:
    """Held blocks of the entries admitted before a moment (settled) and after it (fresh)."""

    settled_blocks: int
    fresh_blocks: int
    settled_sequences: int
    # When the most recently admitted settled entry was admitted (None: no settled entry).
    newest_settled_at: float | None = None


@dataclass(frozen=True, slots=True)
class ClosedEntry:
    """What a request held when its reservation was completed."""

    key: int
    demand: Demand
    admitted_at: float
    output_tokens: tuple[int, ...]  # streamed per sequence
    reserved_blocks: int
    held_blocks: int

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
    outlook: OutputDistribution | None = None  # the learned lengths, for pooling


class Ledger(Protocol):
    """In-flight reservations of one backend. See the module docstring for the contract."""

    def open(
        self, key: int, demand: Demand, now: float, outlook: OutputDistribution | None = None
    ) -> LedgerEntry:
        """Book `demand` under a fresh `key`; raises KeyError if the key is already open.
        `outlook`: the output lengths its reservation was learned from (for pooling)."""
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

    def rebalance(self) -> None:
        """Recompute `multiplex_blocks` and `pooling_blocks` from the entries as they are now
        (a no-op for what is off)."""
        ...

    def entries(self) -> Iterator[LedgerEntry]: ...


# The projected peak is evaluated at most at this many steps (an upper bound between them).
PEAK_BREAKPOINTS = 32
# Up to this many requests in flight, every close recomputes the projected peak; beyond, only
# scrapes do (the cost is O(entries x PEAK_BREAKPOINTS)).
REBALANCE_ON_CLOSE_MAX_ENTRIES = 64


def _to_go(entry: LedgerEntry) -> int:
    """Engine steps until the entry reaches its reservation (at least one while in flight)."""
    return max(1, entry.demand.expected_output_tokens - entry.longest_output)


def _net_hold_at(entry: LedgerEntry, steps: int, to_go: int) -> int:
    """Blocks the entry holds, net of credit, `steps` engine steps from now (its reservation
    once it has reached its end)."""
    if steps >= to_go:
        held = entry.reserved_blocks
    else:
        demand = entry.demand
        grown = demand.blocks_at(min(entry.longest_output + steps, demand.max_output_tokens))
        held = min(entry.reserved_blocks, grown)
    return held - entry.credit_blocks


def projected_peak_blocks(entries: Sequence[LedgerEntry], breakpoints: int = PEAK_BREAKPOINTS) -> int:
    """The most blocks, net of credit, that `entries` will hold at once if each runs to its
    reservation and all of them decode together, one token per engine step (vLLM's continuous
    batching), releasing their blocks when they end.

    The total only grows between two ends and drops at each, so its peak is at an end: with E
    the steps to the entries' ends, peak = max over E of the holds at E of the entries that end
    at or after E. With more distinct ends than `breakpoints`, the ends are thinned to that many
    (the last always kept) and each interval between two kept ends is bounded by the holds at
    its right end of every entry alive at its left end: an upper bound, never below the peak.

    A request that starts decoding later than the others (its prefill queued inside vLLM)
    ends later too, so this is an estimate, not a bound; vLLM's preemption counter, through the
    AIMD share, answers for its misses.
    """
    if not entries:
        return 0
    ends = [(_to_go(entry), entry) for entry in entries]
    distinct = sorted({to_go for to_go, _ in ends})
    if len(distinct) > breakpoints:
        stride = len(distinct) / breakpoints
        distinct = sorted(
            {distinct[min(len(distinct) - 1, math.ceil((k + 1) * stride) - 1)] for k in range(breakpoints)}
        )
    peak = 0
    previous = 0
    for step in distinct:
        total = sum(_net_hold_at(entry, step, to_go) for to_go, entry in ends if to_go > previous)
        peak = max(peak, total)
        previous = step
    return peak


def remaining_moments(entry: LedgerEntry) -> tuple[float, float]:
    """Mean and variance, in blocks, of what the entry will still add to what it holds.

    From its outlook, given the tokens its shortest sequence has produced: every sequence
    grows by the remaining tokens over the block size plus one block (the partly filled one
    and the slot vLLM allocates ahead), and the sequences of one request are taken to run
    equally long (their variances add up as one). Without an outlook, or beyond every length
    it holds, the reservation is taken as it is, with no variance.
    """
    deterministic = float(entry.reserved_blocks - entry.held_blocks)
    if entry.outlook is None:
        return deterministic, 0.0
    demand = entry.demand
    produced = min(entry.output_tokens, default=0)
    moments = entry.outlook.remaining(produced, demand.max_output_tokens)
    if moments is None:
        return deterministic, 0.0
    mean_tokens, variance_tokens = moments
    sequences, block_size = demand.sequences, demand.cost.block_size
    mean = sequences * (mean_tokens / block_size + 1.0)
    variance = (sequences / block_size) ** 2 * variance_tokens
    return mean, variance


def pooled_remaining_blocks(entries: Sequence[LedgerEntry], z: float) -> float:
    """The `z`-quantile of the blocks the entries will still add together, under a normal
    approximation of the sum of their remaining outputs (see `remaining_moments`)."""
    mean = variance = 0.0
    for entry in entries:
        entry_mean, entry_variance = remaining_moments(entry)
        mean += entry_mean
        variance += entry_variance
    return mean + z * math.sqrt(variance)


class InMemoryLedger:
    """The default `Ledger`: a dict of entries and running totals."""

    def __init__(self, *, multiplex: bool = False, pooling_z: float | None = None) -> None:
        self._entries: dict[int, LedgerEntry] = {}
        self._reserved = 0
        self._held = 0
        self._credit = 0
        self._remaining = 0
        self._multiplex = 0
        self._pooling = 0
        self._released = 0
        self.multiplex = multiplex
        self.pooling_z = pooling_z

    @staticmethod
    def _reserved_for(demand: Demand, longest_output: int) -> int:
        # The reservation covers the expected output; once a sequence passes it, cover a
        # block's worth of tokens ahead. vLLM allocates a token's slot before producing it and
        # runs ahead of the stream the gateway reads; with only the next token covered, a few
        # requests crossing block boundaries at once preempted on a full pool (one in 600
        # requests on the CPU testbed).
        tokens = max(demand.expected_output_tokens, longest_output + demand.cost.block_size)
        return demand.blocks_at(min(tokens, demand.max_output_tokens))

    def open(
        self, key: int, demand: Demand, now: float, outlook: OutputDistribution | None = None
    ) -> LedgerEntry:
        if key in self._entries:
            raise KeyError(f"ledger entry {key} is already open")
        entry = LedgerEntry(
            key=key,
            demand=demand,
            admitted_at=now,
            output_tokens=[0] * demand.sequences,
            held_blocks=demand.prompt_blocks,
            reserved_blocks=demand.reserved_blocks,
            outlook=outlook,
        )
        self._entries[key] = entry
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
        to_go = _to_go(entry)
        entry.longest_output = counts[index]
        self._remaining += _to_go(entry) - to_go
        demand = entry.demand
        held = demand.blocks_at(min(entry.longest_output, demand.max_output_tokens))
        reserved = max(entry.reserved_blocks, self._reserved_for(demand, entry.longest_output))
        self._held += held - entry.held_blocks
        self._reserved += reserved - entry.reserved_blocks
        entry.held_blocks = held
        entry.reserved_blocks = reserved

    def close(self, key: int) -> ClosedEntry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._reserved -= entry.reserved_blocks
        self._held -= entry.held_blocks
        self._released += entry.held_blocks
        self._credit -= entry.credit_blocks
        self._remaining -= _to_go(entry)
        if self.multiplex or self.pooling_z is not None:
            if len(self._entries) <= REBALANCE_ON_CLOSE_MAX_ENTRIES:
                self.rebalance()
            else:
                # Keep the last projected peak until the next scrape recomputes it: the rest of
                # the set may still reach it without this entry (see the module docstring).
                self._multiplex = max(0, self._multiplex - (entry.reserved_blocks - entry.credit_blocks))
                # Without the entry the pooled quantile falls by at most its mean (the
                # deviation of a sum shrinks by less than the part's own), so taking its
                # reservation beyond that mean off the discount leaves the discount no larger
                # than a recomputation would make it.
                beyond_mean = entry.reserved_blocks - entry.held_blocks - remaining_moments(entry)[0]
                self._pooling = max(0, self._pooling - math.ceil(max(0.0, beyond_mean)))
        return ClosedEntry(
            key=key,
            demand=entry.demand,
            admitted_at=entry.admitted_at,
            output_tokens=tuple(entry.output_tokens),
            reserved_blocks=entry.reserved_blocks,
            held_blocks=entry.held_blocks,
        )

    def totals(self) -> LedgerTotals:
        return LedgerTotals(
            entries=len(self._entries),
            reserved_blocks=self._reserved,
            held_blocks=self._held,
            credit_blocks=self._credit,
            multiplex_blocks=self._multiplex,
            pooling_blocks=self._pooling,
        )

    @property
    def released_blocks(self) -> int:
        return self._released

    def remaining_output_tokens(self) -> int:
        return self._remaining

    def held_split(self, settled_before: float) -> HeldSplit:
        settled = fresh = sequences = 0
        newest: float | None = None
        for entry in self._entries.values():
            if entry.admitted_at <= settled_before:
                settled += entry.held_blocks
                sequences += entry.demand.sequences
                if newest is None or entry.admitted_at > newest:
                    newest = entry.admitted_at
            else:
                fresh += entry.held_blocks
        return HeldSplit(settled, fresh, sequences, newest)

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
        self.rebalance()

    def rebalance(self) -> None:
        self._multiplex = 0
        self._pooling = 0
        if not self._entries or (not self.multiplex and self.pooling_z is None):
            return  # called at every scrape: nothing to list when neither discount is on
        entries = list(self._entries.values())
        if self.multiplex:
            peak = projected_peak_blocks(entries)
            self._multiplex = max(0, self._reserved - self._credit - peak)
        if self.pooling_z is not None:
            to_come = self._reserved - self._held
            self._pooling = max(0, math.floor(to_come - pooled_remaining_blocks(entries, self.pooling_z)))

    def entries(self) -> Iterator[LedgerEntry]:
        return iter(self._entries.values())

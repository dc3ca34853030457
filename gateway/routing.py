"""Which backend of a fleet takes a request: pure choice from admission headroom and prefix reuse.

Two things make a backend a good home for a request. Headroom: the KV blocks it has free after
the request, counted against its pool (an overcommitted share admits more than the pool, but it
is no more room there than elsewhere). Prefix reuse: the leading blocks of
the prompt it probably still caches, which it would not compute or hold twice. `PrefixIndex`
predicts the second from what the gateway sent each backend; `choose` weighs the two, and lets
reuse win only while it does not pile load onto one backend (IMBALANCE_THRESHOLD).

Nothing here reads a clock or does I/O; the router in the shell builds the candidates.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# How much more loaded (as a fraction of its admissible blocks, after the request) a backend
# with the longest prefix match may be than the least loaded eligible one and still be chosen.
# Past it, recomputing the prefix elsewhere costs less than queueing behind a busy backend.
IMBALANCE_THRESHOLD = 0.25


class PrefixIndex:
    """A bounded record of the block hashes (estimator.prefix) recently sent to ONE backend.

    vLLM's prefix cache holds at most its pool of blocks, and when it needs a block it evicts
    the least recently used free one; so an index that holds at most as many hashes as the pool
    has blocks, evicting the least recently added, predicts which blocks are still cached. It
    is a prediction: the blocks of running requests are not evictable, other clients of the
    backend use the pool too, and a restart empties it (call `clear`).

    Within one `add`, later blocks count as less recent than earlier ones, as in vLLM, which
    frees a finished request's blocks tail first so that its tail is evicted before its head: a
    chain is matched from its head, so losing the head would lose all of it.

    Every operation is O(1) per hash. Not thread-safe: one owner (the router on the event loop).
    """

    __slots__ = ("_capacity", "_hashes")

    def __init__(self, capacity_blocks: int) -> None:
        _check_capacity(capacity_blocks)
        self._capacity = capacity_blocks
        # Least recently used first; the values are unused.
        self._hashes: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    def add(self, hashes: Sequence[int]) -> None:
        """Record `hashes` (one request's chain, head first) as the most recently used, hashes
        already present refreshed; then evict the least recently used beyond capacity."""
        entries = self._hashes
        for block_hash in reversed(hashes):
            if block_hash in entries:
                entries.move_to_end(block_hash)
            else:
                entries[block_hash] = None
        self._evict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, are present: counting stops at the first
        absent one (a chained hash past a missing block cannot be cached). Refreshes nothing:
        a request that only looked here may go elsewhere."""
        entries = self._hashes
        matched = 0
        for block_hash in hashes:
            if block_hash not in entries:
                break
            matched += 1
        return matched

    def resize(self, capacity_blocks: int) -> None:
        """Bound the index by a new pool size (the backend restarted with another, or its pool
        became known), evicting the least recently used beyond it."""
        _check_capacity(capacity_blocks)
        self._capacity = capacity_blocks
        self._evict()

    def clear(self) -> None:
        """Forget everything (the backend restarted: its cache is empty)."""
        self._hashes.clear()

    def __len__(self) -> int:
        return len(self._hashes)

    def _evict(self) -> None:
        entries = self._hashes
        while len(entries) > self._capacity:
            entries.popitem(last=False)


def _check_capacity(capacity_blocks: int) -> None:
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must not be negative, not {capacity_blocks}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One backend as the choice sees it, in KV blocks of that backend.

    `free_blocks` is what the admission check used: admissible - committed, clamped at 0.
    `admissible_blocks` is what the gateway may commit on it in all, `pool_blocks` the pool
    that share is a fraction of (`BudgetSnapshot.pool_limit_blocks`); `committed_blocks` what
    admitted requests hold now; `prefix_blocks` the leading blocks of this request its
    PrefixIndex matched; `chosen_at` when it was last given a request (monotonic seconds),
    so that equal candidates take turns rather than the first by name taking everything."""

    name: str
    free_blocks: int
    admissible_blocks: int
    pool_blocks: int
    committed_blocks: int
    prefix_blocks: int
    chosen_at: float = 0.0


def room(candidate: Candidate) -> int:
    """The blocks `candidate` holds for the gateway as the choice weighs them: its admissible
    share, never more than its pool. An overcommitted share (admissible > pool) admits on the
    evidence that reservations overstate what requests hold; that evidence is about the
    requests, not about this backend, so counted as room it would send the backend whose share
    grew first everything while the others idle."""
    return min(candidate.admissible_blocks, candidate.pool_blocks)


def load_after(candidate: Candidate, reserve_blocks: int) -> float:
    """The fraction of `candidate`'s room committed once this request's `reserve_blocks`
    are: (committed + reserve) / room; infinite when there is no room (and something would be
    reserved)."""
    committed = candidate.committed_blocks + reserve_blocks
    capacity = room(candidate)
    if capacity <= 0:
        return math.inf if committed > 0 else 0.0
    return committed / capacity


def choose(candidates: Sequence[Candidate], reserve_blocks: Mapping[str, int]) -> str | None:
    """The name of the backend that takes the request, or None when none can.

    Eligible: a candidate named in `reserve_blocks` (the request's blocks on that backend)
    whose free_blocks >= its reserve. Among them, the one with the longest prefix match (> 0)
    unless its load after the request exceeds the least loaded eligible candidate's by more
    than IMBALANCE_THRESHOLD (see `load_after`); otherwise, or when no prefix matches, the one
    with the most headroom after the request (room - committed - reserve, see `room`). Ties
    (equal match, then equal headroom after) go to the candidate chosen least recently, then
    the smallest name, so an idle fleet takes turns and the choice is deterministic."""
    eligible = [c for c in candidates if c.name in reserve_blocks and c.free_blocks >= reserve_blocks[c.name]]
    if not eligible:
        return None

    def headroom(c: Candidate) -> tuple[int, float, str]:
        # Sorted ascending: most headroom after the request first, then the one that waited
        # longest since it was last chosen, then the smallest name.
        return (-(room(c) - c.committed_blocks - reserve_blocks[c.name]), c.chosen_at, c.name)

    best_match = min(eligible, key=lambda c: (-c.prefix_blocks, *headroom(c)))
    if best_match.prefix_blocks > 0:
        least_load = min(load_after(c, reserve_blocks[c.name]) for c in eligible)
        if load_after(best_match, reserve_blocks[best_match.name]) <= least_load + IMBALANCE_THRESHOLD:
            return best_match.name
    return min(eligible, key=headroom).name

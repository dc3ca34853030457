"""How fast one backend serves, measured online (pure: injected time, no I/O).

Two decisions lean on the backend's pace. The queue predicts waits from the rate at which
blocks free up; client deadlines net out the service time a request still needs once admitted.
`BackendPace` owns those measurements for one backend. The shell tells it
when a request is admitted (`admitting`), when its reservation is completed (`completed`) and
how long its answer took (`observe_stream`, `observe_whole`); it reads the ledger only for the cold-start
projection of the drain rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gateway.client_hints import ServiceEstimate
from gateway.ledger import Ledger
from gateway.rates import BusyClock, DecayingRate, Ewma

# Over about this many seconds of busy (or saturated) time the drain rates are averaged: long
# enough to span several completions of the longest answers, short enough to follow a change
# of the mix within a deadline.
DRAIN_RATE_HORIZON_S = 10.0
# Smoothing of the service-time estimates netted out of client deadlines.
SERVICE_TIME_EWMA_ALPHA = 0.1
# Smoothing of the blocks completed requests reserved and reached, whose ratio turns the
# saturated drain rate into reserved blocks (see BackendPace.saturated_rate): mostly the last
# four completions, so that it follows the output model as soon as that has learned.
RESERVATION_EWMA_ALPHA = 0.25
# A stream whose relay spent more than this share of its time blocked writing to its client
# was paced by the client, not the backend (see BackendPace.observe_stream).
CLIENT_PACED_SHARE = 0.1


class BackendPace:
    """Drain rates and service times of one backend.

    `queued()` says whether requests wait in the gateway's queue now: the backend counts as
    saturated while they do. Every method takes `now` (monotonic seconds) and must be called
    with non-decreasing times.
    """

    def __init__(
        self,
        ledger: Ledger,
        queued: Callable[[], bool],
        now: float,
        *,
        drain_rate_horizon_s: float = DRAIN_RATE_HORIZON_S,
    ) -> None:
        self._ledger = ledger
        self._queued = queued
        # Blocks freed per busy second (see BusyClock): the fallback until the saturated rate
        # below is known.
        self.drain = DecayingRate(drain_rate_horizon_s)
        self._busy = BusyClock(now)
        # Blocks that requests completed while others waited in the queue (the backend
        # saturated) had really reached, per second: what the engine gets through, whatever
        # kvgate reserved for them (see saturated_rate).
        self.saturated_drain = DecayingRate(drain_rate_horizon_s)
        self._saturated = BusyClock(now)
        self._reserved_per_completion = Ewma(RESERVATION_EWMA_ALPHA)
        self._reached_per_completion = Ewma(RESERVATION_EWMA_ALPHA)
        self.first_token_after_admit = Ewma(SERVICE_TIME_EWMA_ALPHA)
        self.seconds_per_output_token = Ewma(SERVICE_TIME_EWMA_ALPHA)

    # -- events from the shell ----------------------------------------------------------------

    def admitting(self, now: float) -> None:
        """A request is about to enter the ledger: close the interval before it on the busy
        clock, so that idle time before an admission never counts as busy."""
        self.busy_time(now)

    def completed(self, freed_blocks: int, now: float, *, reached_blocks: int | None = None) -> None:
        """The ledger has just closed a reservation of `freed_blocks`, whose request had come to
        hold `reached_blocks` (None: as many as it reserved)."""
        reached = freed_blocks if reached_blocks is None else reached_blocks
        self._reserved_per_completion.add(freed_blocks)
        self._reached_per_completion.add(reached)
        # That request was in flight since its admission, which advanced the busy clock: all
        # of the interval since the clock's last mark was busy.
        busy_s = self._busy.advance(now, True)
        saturated_s = self.saturated_time(now)
        self.drain.add(freed_blocks, busy_s)
        if self._queued():
            self.saturated_drain.add(reached, saturated_s)

    def completed_elsewhere(self, freed_blocks: int, now: float) -> None:
        """Other kvgate processes sharing the backend completed reservations of `freed_blocks`
        since they last said (see gateway.shared_view): the backend drained them too. What
        those requests reached is not told: taken to be as far below their reservations as
        this process's own are."""
        busy_s = self._busy.advance(now, True)
        saturated_s = self.saturated_time(now)
        self.drain.add(freed_blocks, busy_s)
        if self._queued():
            self.saturated_drain.add(freed_blocks / self.reservation_ratio(), saturated_s)

    def observe_stream(
        self,
        admitted_at: float,
        first_byte_at: float,
        finished_at: float,
        output_tokens: int,
        *,
        wait_before_first_byte_s: float = 0.0,
        wait_after_first_byte_s: float = 0.0,
    ) -> None:
        """Learn the service times from a streamed answer whose longest sequence ran to
        `output_tokens`: the first token's delay after admission, and the time per token after
        it.

        The `wait_*` arguments are the seconds the relay spent blocked writing to the client
        before and after the first byte: the client's time, not the backend's, so they are
        taken off. An answer whose relay was blocked for over CLIENT_PACED_SHARE of its
        streaming time was paced by its client (the backend then runs ahead into buffers, so
        taking the wait off would not give its pace back): its time per token is not learned."""
        if output_tokens <= 0:
            return
        self.first_token_after_admit.add(max(0.0, first_byte_at - admitted_at - wait_before_first_byte_s))
        if output_tokens > 1:
            streaming_s = finished_at - first_byte_at
            if wait_after_first_byte_s > CLIENT_PACED_SHARE * streaming_s:
                return
            self.seconds_per_output_token.add(
                max(0.0, streaming_s - wait_after_first_byte_s) / (output_tokens - 1)
            )

    def observe_whole(self, admitted_at: float, finished_at: float, output_tokens: int) -> None:
        """Learn the time per token from an answer sent whole: its first token came with its
        last, so it says nothing of the first token's delay."""
        if output_tokens > 0:
            self.seconds_per_output_token.add((finished_at - admitted_at) / output_tokens)

    # -- clocks and rates ---------------------------------------------------------------------

    def busy_time(self, now: float) -> float:
        """Advance the busy clock to `now`, busy if anything is in the ledger now."""
        # Reserved blocks count the other processes' requests too, when the ledger is shared.
        totals = self._ledger.totals()
        return self._busy.advance(now, totals.entries > 0 or totals.reserved_blocks > 0)

    def saturated_time(self, now: float) -> float:
        """Advance the saturated clock (it runs while requests wait in the queue) to `now`.
        Called on every arrival, completion and queue pump, with the queue's state then
        standing for the (short) interval since the last call."""
        return self._saturated.advance(now, self._queued())

    def drain_rate(self, now: float) -> float | None:
        """Blocks freed per busy second, or None when unknown (the queue's fallback, see
        `capacity_rate`).

        The rate observed over recent busy time when there is one. Before that (a cold start),
        a projection of what is in flight: its reserved blocks over the mean time its requests
        still need (expected output tokens still to come times the measured seconds per token).
        The projection sees decode time only; on a loaded backend requests hold their blocks
        mostly while prompts ahead of them are computed, and on the CPU testbed at three times
        capacity it ran about twice too fast: requests queued on its word waited up to 8 s
        where it had predicted under 2 s.
        """
        observed = self.drain.rate(self.busy_time(now))
        if observed is not None:
            return observed
        per_token_s = self.seconds_per_output_token.value
        if not per_token_s:
            return None
        # From the ledger's running sums: this runs on every queue pump (O(1), not O(n)).
        totals = self._ledger.totals()
        remaining_s = self._ledger.remaining_output_tokens() * per_token_s
        if totals.entries and remaining_s > 0:
            return totals.reserved_blocks / (remaining_s / totals.entries)
        return None

    def saturated_rate(self, now: float) -> float | None:
        """Reserved blocks per second freed while requests waited, or None until measured.

        A queue waits for reserved blocks, but counting the rate in them would tie it to what
        was reserved when it was measured: a fresh gateway reserves whole `max_tokens` until its
        output-length model has seen answers, and a rate learned on those overstated the burst
        after them, whose reservations were smaller, and so its waits (docs/measurements.md).
        So the rate is measured in the blocks requests really reached, which the engine's pace
        sets, and turned into reserved blocks at the ratio of recent completions' reservations
        to what they reached."""
        reached = self.saturated_drain.rate(self.saturated_time(now))
        return None if reached is None else reached * self.reservation_ratio()

    def reservation_ratio(self) -> float:
        """Reserved over reached blocks of the recently completed requests (1 until known)."""
        reserved, reached = self._reserved_per_completion.value, self._reached_per_completion.value
        if not reserved or not reached:
            return 1.0
        return reserved / reached

    def capacity_rate(self, now: float) -> float | None:
        """Blocks per second the backend frees when saturated; the drain rate until known.
        Waits happen only while the backend is saturated: they are predicted at this rate, not
        at the busy-time average, which counts lighter moments and made the queue shed a
        burst's tail that vLLM would still have served in time."""
        rate = self.saturated_rate(now)
        return rate if rate is not None else self.drain_rate(now)

    # -- what the decisions read ----------------------------------------------------------------

    def service_estimate(self, output_tokens: int) -> ServiceEstimate:
        """What a request still needs once admitted: its first token, and its whole answer of
        `output_tokens` (0 for what is not measured yet)."""
        first = self.first_token_after_admit.value or 0.0
        per_token = self.seconds_per_output_token.value
        complete = first + (per_token * output_tokens if per_token is not None else 0.0)
        return ServiceEstimate(first, complete)

    def describe(self, now: float) -> dict[str, Any]:
        """The measurements, for /admin/state (None: not measured yet)."""
        return {
            "drain_rate_blocks_per_s": _round(self.drain_rate(now)),
            # None until measured (the queue then predicts at the busy-time rate).
            "saturated_drain_rate_blocks_per_s": _round(self.saturated_rate(now)),
            "first_token_after_admit_s": _round(self.first_token_after_admit.value),
            "seconds_per_output_token": _round(self.seconds_per_output_token.value),
        }


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


__all__ = [
    "CLIENT_PACED_SHARE",
    "DRAIN_RATE_HORIZON_S",
    "RESERVATION_EWMA_ALPHA",
    "SERVICE_TIME_EWMA_ALPHA",
    "BackendPace",
]

"""How many KV blocks of one backend can be promised right now, and how sure we are (pure).

Two loops meet here:

- the open loop is the `Ledger`: what the gateway sent and what each request will hold at its
  peak. It moves at once with every admission, streamed token and completion, so it is what
  the budget follows between scrapes;
- the closed loop is vLLM's own `/metrics` (`BackendReading`): what the engine really holds.

At each scrape `KvBudget.observe` compares the two and corrects the ledger in both directions:

- vLLM holds more than the ledger explains (other clients, a chat template counted short):
  the excess becomes `external_blocks`, added to every projection until the next scrape. What
  answers sent whole (not streamed) may have grown to within their reservations is explained:
  the ledger cannot watch them grow;
- vLLM holds less than the settled requests' ledger count (prefix-cache sharing, a request
  that finished inside vLLM but whose last bytes are still on the way): the settled entries get
  a credit in proportion, which leaves with each of them when it completes.

Only *settled* entries (admitted at least `settle_s` before the scrape started) earn credit:
a request that was just sent may not be allocated yet, and crediting its absence would let
the gateway promise the same blocks twice. For the same reason no credit is given while vLLM
reports waiting requests (they hold nothing yet but will). One partially filled block per
settled sequence is tolerated before usage counts as external: vLLM allocates the slot of a
token before the gateway sees the token. So are the blocks of requests completed since
`settle_s` before the scrape started: a scrape is a snapshot of some moment during it, and
vLLM's gauges trail its engine by a step, so a request that ended just before or during the
scrape may still be counted there while the ledger has already let it go.

On top sits the admissible share of the pool. It starts at `max_fraction` and never goes
below it: reservations are peaks (prompt plus a high quantile of the answer), held from
admission on, so requests admitted within the pool cannot run one another out of blocks. Where
vLLM holds more than they explain, that is external usage (above), and an answer that outgrows
its reservation grows it; neither is the share's to answer. But the KV a request really holds
grows from its prompt to where its answer really stops, so where answers are long the pool can
sit half empty by vLLM's count while requests wait in the gateway for blocks that are only
promised. With `overcommit` above zero the share may then grow past `max_fraction`, by at most
`overcommit`, but only while requests wait and vLLM's usage at the scrape (plus what was sent
since it settled, and what the requests in flight are certain to grow into: their
`min_tokens`, or their cap with `ignore_eos`) leaves `overcommit_room` of the pool unused: that
room is the evidence that the promises overstate what is held. It grows at
OVERCOMMIT_GROWTH_PER_S, fast enough to follow a burst of a few seconds, because the room is
measured again at every scrape, and stops growing when the room goes. What takes it back is
vLLM's preemption counter: a rise multiplies the share by `decrease_factor` (once per cooldown,
preemptions come in bursts), down to `max_fraction` at the lowest, and growth resumes after a
quiet time. How far the reservations of completed requests exceeded the peaks they reached
(`overstatement`) is reported beside it.

Unknown means saturated: without a fresh reading the budget is not `known`, and the policy
admits nothing new, unless configured to fall back on the ledger alone. A request whose
connection to the backend failed (refused, cut mid-stream) makes the budget `suspect`: not
known until a scrape that started after the failure succeeds. The backend may be gone, and
admitting into its last reading would send the queue to nowhere; if it is gone, the failing
scrapes mark it down and the queue is answered at once.

Frozen metrics (a wedged exporter repeating old text) look like an idle engine: no KV in use,
which would earn every request in flight a full credit. Two guards, each against the state
before the newest settled request was admitted: settled entries earn credit only when vLLM's
engine-step counter has moved since (before that, vLLM may simply not have allocated the
request yet); and when, with settled requests in flight, the scrape stays byte for byte what
it was for `stale_after_s` (a live vLLM's text changes with every scrape: its process metrics
alone see to that), the readings are refused as frozen and the budget goes stale from the
moment they stopped changing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gateway.ledger import Ledger
from gateway.rates import Ewma
from gateway.vllm_metrics import BackendReading


def _last_before(history: deque[tuple[float, float]], moment: float) -> float | None:
    """The value of the last scrape parsed before `moment` (None: none is that old)."""
    for parsed_at, value in reversed(history):
        if parsed_at < moment:
            return value
    return None


def _moved_since(
    history: deque[tuple[float, float]], moment: float | None, value: float | None
) -> bool | None:
    """Whether `value` differs from the one of the last scrape parsed before `moment` (a
    counter that went down, vLLM restarted, counts as moved). None when either is unknown."""
    if moment is None or value is None:
        return None
    before = _last_before(history, moment)
    return None if before is None else value != before


# The share's clock: growth resumes this long after the last preemption, and preemptions, which
# come in bursts, cut the share at most once per cooldown.
AIMD_QUIET_S = 5.0
AIMD_DECREASE_COOLDOWN_S = 2.0
# The overcommit grows only while vLLM's usage leaves this share of the pool unused, and then by
# this share of the pool per second (measured on `make demo`'s burst: docs/measurements.md).
OVERCOMMIT_ROOM = 0.25
OVERCOMMIT_GROWTH_PER_S = 0.25


class BudgetState(StrEnum):
    """Freshness of the closed loop; doubles as a metric label and a /readyz reason."""

    FRESH = "fresh"
    STALE = "stale"  # the last good scrape is older than stale_after_s
    DOWN = "down"  # the backend cannot be reached
    UNSEEN = "unseen"  # no good scrape yet
    SUSPECT = "suspect"  # a request just failed to reach the backend: waiting for a new scrape


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    stale_after_s: float
    # How often a scrape starts and the time limit of each: how long past `stale_after_s` a
    # scrape in flight may still renew the reading.
    scrape_interval_s: float
    scrape_timeout_s: float
    settle_s: float
    unknown_is_saturated: bool
    down_after_failures: int
    max_fraction: float
    decrease_factor: float
    # How far past max_fraction the share may grow while requests wait and vLLM's usage leaves
    # `overcommit_room` of the pool unused (see the module docstring); 0: never.
    overcommit: float = 0.0
    quiet_s: float = AIMD_QUIET_S
    decrease_cooldown_s: float = AIMD_DECREASE_COOLDOWN_S
    overcommit_room: float = OVERCOMMIT_ROOM

    def __post_init__(self) -> None:
        if not 0.0 < self.max_fraction <= 1.0:
            raise ValueError("need 0 < max_fraction <= 1")
        if not 0.0 < self.decrease_factor < 1.0:
            raise ValueError("decrease_factor must lie in (0, 1)")
        if self.overcommit < 0.0:
            raise ValueError("overcommit must not be negative")
        if not 0.0 < self.overcommit_room < 1.0:
            raise ValueError("overcommit_room must lie in (0, 1)")


class AimdLimit:
    """The admissible fraction of the pool: `max_fraction`, and past it as far as vLLM's unused
    room leads and its preemption counter allows (see the module docstring)."""

    def __init__(self, config: CapacityConfig) -> None:
        self._config = config
        self.fraction = config.max_fraction
        self._last_total: float | None = None
        self._decreased_at = -math.inf
        self._pressure_at = -math.inf
        self._updated_at: float | None = None
        self.preemptions_seen = 0.0

    def reconfigure(self, config: CapacityConfig) -> None:
        self._config = config
        ceiling = config.max_fraction + config.overcommit
        self.fraction = min(ceiling, max(config.max_fraction, self.fraction))

    def observe(
        self,
        preemptions_total: float | None,
        now: float,
        *,
        attributable: bool = True,
        headroom: float = 0.0,
    ) -> float:
        """Feed one reading of the counter; returns the preemptions since the last reading.

        `attributable` says whether the gateway had requests in flight on this backend. When it
        had none, the preemptions come from traffic that bypassed it: they are counted, but
        shrinking the admissible share would only punish the gateway's future requests for
        load it neither sent nor can see coming (that load shows up as external blocks).
        `headroom`: how far past `max_fraction` quiet time may grow the share now (see the
        module docstring). Where it is lower than the share, the share stops growing but is not
        taken back: only preemptions say that a promise was too thin.
        """
        config = self._config
        if self._updated_at is not None:
            quiet_from = max(self._updated_at, self._pressure_at + config.quiet_s)
            ceiling = config.max_fraction + min(config.overcommit, max(0.0, headroom))
            if now > quiet_from and self.fraction < ceiling:
                self.fraction = min(ceiling, self.fraction + OVERCOMMIT_GROWTH_PER_S * (now - quiet_from))
        self._updated_at = now if self._updated_at is None else max(self._updated_at, now)

        seen = 0.0
        if preemptions_total is not None:
            if self._last_total is not None and preemptions_total > self._last_total:
                seen = preemptions_total - self._last_total
            # A counter that went down means vLLM restarted: a new baseline, not pressure.
            self._last_total = preemptions_total
        if seen > 0:
            self.preemptions_seen += seen
        if seen > 0 and attributable:
            self._pressure_at = now
            if now - self._decreased_at >= config.decrease_cooldown_s:
                self.fraction = max(config.max_fraction, self.fraction * config.decrease_factor)
                self._decreased_at = now
        return seen


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """The budget as the policy sees it at one moment, in blocks.

    `committed_blocks` is the projected peak of everything in flight: the ledger's
    reservations, net of credit, plus usage vLLM reports that the ledger does not explain.
    """

    state: BudgetState
    known: bool
    total_blocks: int
    pool_limit_blocks: int  # the pool at `max_fraction`: no request may ever need more
    admissible_blocks: int
    committed_blocks: int
    used_reported_blocks: float
    external_blocks: int
    fraction: float
    age_s: float | None
    detail: str
    # Stale, but the scrapes since the last good one were at worst too slow (fewer of them
    # than mark a backend down) and one still in flight may renew it: a backend, or a gateway,
    # slow under a burst, not a budget that is lost.
    renewing: bool = False

    @property
    def free_blocks(self) -> int:
        return max(0, self.admissible_blocks - self.committed_blocks)

    @property
    def settles_soon(self) -> bool:
        """Unknown now, but the next scrape, a moment away, settles it: worth waiting for."""
        return not self.known and (self.state is BudgetState.SUSPECT or self.renewing)


@dataclass(frozen=True, slots=True)
class Standing:
    """How far this process may promise the budget it computes: all of it alone; with others
    sharing the backend through a store that cannot be reached, a share of it (fail open) or
    nothing (fail closed, `unavailable` says why)."""

    share: float = 1.0
    unavailable: str = ""


ALONE = Standing()


class BudgetSource(Protocol):
    """Where the wait queue reads the budget: `KvBudget` here, a store shared by several
    replicas later. Called from the event loop on every queue pump: no I/O, no blocking;
    `now` is monotonic seconds."""

    def snapshot(self, now: float) -> BudgetSnapshot: ...


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What one scrape changed; reported for metrics and tests."""

    preemptions: float
    external_blocks: int
    kept_fraction: float


# Engine-step counts and text digests of the recent scrapes, kept to tell whether anything
# moved since a given moment (at the default 0.2 s interval: the last 200 s).
HISTORY_SCRAPES = 1000
# Each completed request's weight in the moving averages behind `KvBudget.overstatement`, and
# how many must have completed before it says anything.
OVERSTATEMENT_WEIGHT = 0.05
OVERSTATEMENT_MIN_SAMPLES = 20


class KvBudget:
    """Combines readings, the ledger and the AIMD limit. One event loop owns it."""

    def __init__(
        self, config: CapacityConfig, ledger: Ledger, standing: Callable[[], Standing] | None = None
    ) -> None:
        self._config = config
        self._ledger = ledger
        self._standing = standing or (lambda: ALONE)
        self.limit = AimdLimit(config)
        self.reading: BackendReading | None = None
        self._reading_at: float | None = None
        self._external = 0
        self._failures = 0
        self._unreachable_failures = 0
        self._slow_failures = 0  # failures in a row that were answers too slow, not wrong
        self._last_error = ""
        self._suspect_since: float | None = None
        # Why no reading will ever come again (the poller's task ended), else "".
        self._halted = ""
        # (parsed at, engine steps) of recent scrapes, oldest first.
        self._steps: deque[tuple[float, float]] = deque(maxlen=HISTORY_SCRAPES)
        self._digests: deque[tuple[float, float]] = deque(maxlen=HISTORY_SCRAPES)
        # First scrape of a run showing settled requests in flight and a text that never changes.
        self._motionless_since: float | None = None
        # (parsed at, the ledger's released-blocks counter then) of recent scrapes.
        self._released: deque[tuple[float, float]] = deque(maxlen=HISTORY_SCRAPES)
        # Over completed requests: the blocks they reserved and the blocks they reached.
        self._reserved = Ewma(OVERSTATEMENT_WEIGHT)
        self._reached = Ewma(OVERSTATEMENT_WEIGHT)

    def observe_completion(self, reserved_blocks: int, reached_blocks: int) -> None:
        """A request completed (not cut short) having reserved `reserved_blocks` at admission
        and reached `reached_blocks` at its end."""
        self._reserved.add(reserved_blocks)
        self._reached.add(reached_blocks)

    @property
    def overstatement(self) -> float:
        """How far recent completed requests' reservations exceeded what they reached: reserved
        over reached, less one; 0 until OVERSTATEMENT_MIN_SAMPLES have completed."""
        reserved, reached = self._reserved.value, self._reached.value
        if self._reached.count < OVERSTATEMENT_MIN_SAMPLES or not reserved or not reached:
            return 0.0
        return max(0.0, reserved / reached - 1.0)

    @property
    def external_blocks(self) -> int:
        return self._external

    @property
    def last_error(self) -> str:
        """Why the last scrape failed ("" after a good one)."""
        return self._last_error

    def observe(
        self, reading: BackendReading, started_at: float, now: float, *, waiting: bool = False
    ) -> Reconciliation | None:
        """Take a scrape that was started at `started_at` and parsed at `now`. Returns None
        when the reading is refused as frozen (then it counts as a failed scrape). `waiting`:
        requests wait in the gateway for this backend's blocks (see `overcommit`)."""
        config = self._config
        settled_before = started_at - config.settle_s
        split = self._ledger.held_split(settled_before)
        stepped = _moved_since(self._steps, split.newest_settled_at, reading.engine_steps_total)
        changed = _moved_since(self._digests, split.newest_settled_at, reading.digest)
        if reading.engine_steps_total is not None:
            self._steps.append((now, reading.engine_steps_total))
        if reading.digest is not None:
            self._digests.append((now, reading.digest))
        # Blocks of requests completed since the settle horizon, or a little more: counted from
        # the last scrape before it (from the ledger's start when there is none).
        released = self._ledger.released_blocks
        released_since = released - int(_last_before(self._released, settled_before) or 0)
        self._released.append((now, released))
        if changed is False:
            if self._motionless_since is None:
                self._motionless_since = started_at
            elif started_at - self._motionless_since >= config.stale_after_s:
                # The last reading worth trusting is the one from before it stopped moving.
                if self._reading_at is not None:
                    self._reading_at = min(self._reading_at, self._motionless_since)
                self.observe_failure(
                    f"the metrics are frozen: requests are in flight but vLLM's metrics have not "
                    f"changed for {started_at - self._motionless_since:.1f} s",
                    unreachable=False,
                    now=now,
                )
                return None
        else:
            self._motionless_since = None
        used = reading.used_blocks
        # Answers sent whole grow inside vLLM unseen, within what they reserved: that growth is
        # theirs, not someone else's (else it would count twice, reserved and external).
        gap = used - split.settled_blocks - split.fresh_blocks - self._ledger.totals().unseen_blocks
        slack = split.settled_sequences + released_since
        kept = 1.0
        external = 0
        if gap > slack:
            external = math.ceil(gap - slack - 1e-9)
        elif (
            used < split.settled_blocks
            and reading.saturated_waiting == 0
            and stepped is not False
            and changed is not False
        ):
            # Credit only an engine that has stepped since the newest settled request arrived:
            # otherwise vLLM may not have allocated it yet (or its metrics are not moving).
            kept = max(0.0, used / split.settled_blocks)
        self._ledger.set_credit(kept, settled_before)
        self._external = external
        if self.reading is not None and reading.total_blocks != self.reading.total_blocks:
            # vLLM came back with another pool: the old baseline of its counters is void.
            self.limit = AimdLimit(config)
        in_flight = split.settled_sequences > 0 or split.settled_blocks > 0 or split.fresh_blocks > 0
        # vLLM's usage plus what was sent since (not allocated there yet, perhaps) against the
        # pool, less what the requests in flight are certain to grow into: a pool that looks
        # half empty because `ignore_eos` answers have only begun is no evidence of overstated
        # promises.
        unused = reading.total_blocks - used - split.fresh_blocks - split.certain_growth_blocks
        # Room is evidence only from an engine seen to move since the newest settled request:
        # frozen or restarted metrics look like an idle pool.
        room = (
            waiting
            and reading.saturated_waiting == 0
            and changed is True
            and stepped is True
            and unused >= config.overcommit_room * reading.total_blocks
        )
        preemptions = self.limit.observe(
            reading.preemptions_total,
            now,
            attributable=in_flight,
            headroom=self._config.overcommit if room else 0.0,
        )
        self.reading = reading
        self._reading_at = started_at
        if self._suspect_since is not None and started_at >= self._suspect_since:
            self._suspect_since = None
        self._failures = 0
        self._unreachable_failures = 0
        self._slow_failures = 0
        self._last_error = ""
        return Reconciliation(preemptions, external, kept)

    def observe_failure(self, error: str, *, unreachable: bool, now: float, slow: bool = False) -> None:
        """A scrape failed: `unreachable` when no connection could be made at all, `slow` when
        the backend took the request but did not answer it whole within the time limit."""
        self._failures += 1
        self._unreachable_failures = self._unreachable_failures + 1 if unreachable else 0
        self._slow_failures = self._slow_failures + 1 if slow else 0
        self._last_error = error
        self.limit.observe(None, now)

    def halt(self, reason: str) -> None:
        """Nobody reads the metrics any more (the poller's task ended): the budget is stale
        from now on, whatever the last reading, and its detail says why."""
        self._halted = reason

    def reconfigure(self, config: CapacityConfig) -> None:
        """Use `config` from now on (a settings reload); the AIMD share moves into its bounds."""
        self._config = config
        self.limit.reconfigure(config)

    def suspect(self, now: float) -> None:
        """A request failed to reach the backend at `now` (a connection refused or cut, not a
        timeout or an HTTP error): the budget is unknown until a scrape started since then
        succeeds."""
        self._suspect_since = now if self._suspect_since is None else max(self._suspect_since, now)

    def state(self, now: float) -> BudgetState:
        if self._unreachable_failures >= self._config.down_after_failures:
            return BudgetState.DOWN
        if self._reading_at is None:
            return BudgetState.UNSEEN
        if self._halted:
            return BudgetState.STALE
        if self._suspect_since is not None:
            return BudgetState.SUSPECT
        if now - self._reading_at > self._config.stale_after_s:
            return BudgetState.STALE
        return BudgetState.FRESH

    def snapshot(self, now: float) -> BudgetSnapshot:
        state = self.state(now)
        reading = self.reading
        totals = self._ledger.totals()
        if reading is None:
            return BudgetSnapshot(
                state=state,
                known=False,
                total_blocks=0,
                pool_limit_blocks=0,
                admissible_blocks=0,
                committed_blocks=totals.committed_blocks,
                used_reported_blocks=0.0,
                external_blocks=0,
                fraction=self.limit.fraction,
                age_s=None,
                detail=self._detail(state, None),
            )
        assert self._reading_at is not None
        age = max(0.0, now - self._reading_at)
        if state is BudgetState.FRESH:
            known, external = True, self._external
        elif state is BudgetState.STALE and not self._config.unknown_is_saturated:
            # Configured to trust the open loop alone: last pool size, no correction.
            known, external = True, 0
        else:
            known, external = False, self._external
        standing = self._standing()
        detail = self._detail(state, age)
        renewing = state is BudgetState.STALE and not self._halted and self._renewable(age)
        if renewing:
            detail = f"{detail}; a scrape in flight may renew it"
        if standing.unavailable:
            known, renewing, detail = False, False, f"{standing.unavailable}; {detail}"
        elif standing.share < 1.0:
            detail = f"{detail}; promising {standing.share:.0%} of it (the shared ledger is unreachable)"
        total = reading.total_blocks
        return BudgetSnapshot(
            state=state,
            known=known,
            total_blocks=total,
            pool_limit_blocks=math.floor(total * self._config.max_fraction),
            admissible_blocks=math.floor(total * self.limit.fraction * standing.share),
            committed_blocks=totals.committed_blocks + external,
            used_reported_blocks=reading.used_blocks,
            external_blocks=external,
            fraction=self.limit.fraction,
            age_s=age,
            detail=detail,
            renewing=renewing,
        )

    def _renewable(self, age: float) -> bool:
        """Whether the scrape in flight may still renew a stale reading `age` seconds old: no
        scrape since the last good one gave a wrong answer, fewer than `down_after_failures`
        were too slow (a busy backend, or a busy gateway), and the reading is no older than
        those scrapes and the one in flight took at most."""
        config = self._config
        if self._failures != self._slow_failures or self._failures >= config.down_after_failures:
            return False
        scrapes = self._failures + 1
        return age <= config.stale_after_s + scrapes * (config.scrape_interval_s + config.scrape_timeout_s)

    def _detail(self, state: BudgetState, age: float | None) -> str:
        error = f"; last error: {self._last_error}" if self._last_error else ""
        if self._halted:
            error = f"; {self._halted}{error}"
        if state is BudgetState.FRESH:
            return f"metrics fresh ({age:.3f} s old)"
        if state is BudgetState.DOWN:
            return f"backend unreachable for {self._unreachable_failures} scrapes{error}"
        if state is BudgetState.UNSEEN:
            return f"no good metrics scrape yet{error}"
        if state is BudgetState.SUSPECT:
            return f"a request just failed to reach the backend; waiting for a new metrics scrape{error}"
        return f"metrics stale: last good scrape {age:.3f} s ago{error}"

"""BackendPace, the backend's measured pace: the drain-rate projection the queue reads on every
pump (from the ledger's running sums, equal to the sum over the requests in flight, whatever
they streamed or left), the busy and saturated clocks, the service times and the overload test."""

from __future__ import annotations

import pytest

from estimator.demand import BlockCost, Demand
from gateway.client_hints import ServiceEstimate
from gateway.ledger import InMemoryLedger
from gateway.pace import CLIENT_PACED_SHARE, BackendPace
from gateway.rates import DecayingRate

SECONDS_PER_TOKEN = 0.02
HORIZON_S = 10.0


class Queue:
    """Whether requests wait in the gateway's queue: set by the test."""

    def __init__(self) -> None:
        self.waiting = False

    def __call__(self) -> bool:
        return self.waiting


def demand(prompt: int = 40, expected: int = 10, samples: int = 1) -> Demand:
    return Demand(
        prompt_tokens=(prompt,),
        max_output_tokens=600,
        expected_output_tokens=expected,
        samples_per_prompt=samples,
        cost=BlockCost(block_size=16),
    )


def make_pace(ledger: InMemoryLedger, queue: Queue | None = None) -> BackendPace:
    return BackendPace(ledger, queue or Queue(), 0.0, drain_rate_horizon_s=HORIZON_S)


def projected(ledger: InMemoryLedger) -> float:
    """The projection computed the long way, over every entry."""
    entries = list(ledger.entries())
    blocks = sum(entry.reserved_blocks for entry in entries)
    seconds = sum(
        max(1, entry.demand.expected_output_tokens - entry.longest_output) * SECONDS_PER_TOKEN
        for entry in entries
    )
    return blocks / (seconds / len(entries))


def test_projection_follows_the_requests_in_flight() -> None:
    ledger = InMemoryLedger()
    pace = make_pace(ledger)
    assert pace.drain_rate(0.0) is None  # nothing observed, no service time known
    pace.seconds_per_output_token.add(SECONDS_PER_TOKEN)
    assert pace.drain_rate(0.0) is None  # nothing in flight
    for key, (prompt, expected, samples) in enumerate([(40, 100, 1), (300, 20, 2), (5, 500, 1)]):
        ledger.open(key, demand(prompt, expected, samples), now=0.0)
    assert pace.drain_rate(0.0) == pytest.approx(projected(ledger))
    ledger.grow(0, 0, 60)
    ledger.grow(1, 1, 45)  # past its expected output: one token to go, at least
    assert pace.drain_rate(0.0) == pytest.approx(projected(ledger))
    ledger.close(2)
    assert pace.drain_rate(0.0) == pytest.approx(projected(ledger))


def test_the_observed_rate_wins_once_known() -> None:
    ledger = InMemoryLedger()
    pace = make_pace(ledger)
    pace.seconds_per_output_token.add(SECONDS_PER_TOKEN)
    ledger.open(0, demand(), now=0.0)
    fast = pace.drain_rate(0.0)
    assert fast == pytest.approx(projected(ledger))
    # Five blocks freed per busy second for 10 s (the entry above kept the backend busy):
    # slower than the projection, which sees decode time only, and what the queue's
    # predictions use from now on.
    for second in range(1, 11):
        pace.drain.add(5.0, float(second))
    observed = pace.drain.rate(10.0)
    assert observed is not None
    assert fast is not None
    assert observed < fast / 2
    assert pace.drain_rate(10.0) == pytest.approx(observed)


BLOCKS = demand().reserved_blocks


def serve_one_request_a_second(ledger: InMemoryLedger, pace: BackendPace, start: float, seconds: int) -> None:
    """A request of BLOCKS admitted at every whole second and completed 0.5 s later."""
    for second in range(seconds):
        at = start + second
        pace.admitting(at)
        ledger.open(second, demand(), now=at)
        closed = ledger.close(second)
        assert closed is not None
        pace.completed(closed.reserved_blocks, at + 0.5)


def test_idle_time_is_not_busy_time() -> None:
    """Blocks are freed per second of busy time: a lull between two busy stretches neither
    counts on the busy clock nor lowers the drain rate."""
    ledger = InMemoryLedger()
    pace = make_pace(ledger)
    reference = DecayingRate(HORIZON_S)
    serve_one_request_a_second(ledger, pace, 0.0, 10)
    for busy_s in range(1, 11):
        reference.add(BLOCKS, busy_s * 0.5)
    assert pace.busy_time(10.0) == pytest.approx(5.0)
    assert pace.drain_rate(10.0) == pytest.approx(reference.rate(5.0))
    serve_one_request_a_second(ledger, pace, 100.0, 1)
    reference.add(BLOCKS, 5.5)
    assert pace.busy_time(101.0) == pytest.approx(5.5)
    assert pace.drain_rate(101.0) == pytest.approx(reference.rate(5.5))


def test_the_saturated_rate_counts_only_what_was_freed_while_requests_waited() -> None:
    ledger = InMemoryLedger()
    queue = Queue()
    pace = make_pace(ledger, queue)
    serve_one_request_a_second(ledger, pace, 0.0, 10)
    assert pace.saturated_rate(10.0) is None  # nobody waited
    assert pace.capacity_rate(10.0) == pace.drain_rate(10.0)  # the fallback
    queue.waiting = True
    serve_one_request_a_second(ledger, pace, 10.0, 10)
    # Measured on the saturated clock, which ran from the last completion before requests
    # waited (9.5 s): one completion a second of it, not one per busy half second.
    reference = DecayingRate(HORIZON_S)
    for saturated_s in range(1, 11):
        reference.add(BLOCKS, float(saturated_s))
    saturated = pace.saturated_rate(20.0)
    assert saturated == pytest.approx(reference.rate(10.5))
    assert pace.capacity_rate(20.0) == saturated
    assert saturated is not None
    busy = pace.drain_rate(20.0)
    assert busy is not None
    assert saturated < busy / 1.5


def test_the_saturated_rate_follows_the_reservations_not_what_they_were_when_measured() -> None:
    # Requests that each reach 16 blocks complete one a second while others wait. A fresh
    # gateway reserved 24 blocks for each at first; once its output model learned, 18.
    ledger = InMemoryLedger()
    queue = Queue()
    queue.waiting = True
    pace = make_pace(ledger, queue)
    reference = DecayingRate(HORIZON_S)
    for second in range(1, 21):
        pace.completed(24 if second <= 10 else 18, float(second), reached_blocks=16)
        reference.add(16, float(second))
    assert pace.reservation_ratio() == pytest.approx(18 / 16, rel=0.05)
    rate = pace.saturated_rate(20.0)
    # The engine got through 16 blocks a second throughout: at today's reservations that
    # frees 18 reserved blocks for every 16, more than counting reserved blocks says.
    reached = reference.rate(20.0)
    assert reached is not None
    assert rate == pytest.approx(reached * pace.reservation_ratio())
    assert rate == pytest.approx(reached * 18 / 16, rel=0.03)
    counted_in_reserved = DecayingRate(HORIZON_S)
    for second in range(1, 21):
        counted_in_reserved.add(24 if second <= 10 else 18, float(second))
    old = counted_in_reserved.rate(20.0)
    assert old is not None
    assert old > 1.05 * rate
    # Answers sent whole: the ledger saw only their reservations, which count as reached.
    whole = make_pace(InMemoryLedger(), queue)
    for second in range(1, 11):
        whole.completed(24, float(second))
    assert whole.reservation_ratio() == 1.0


def test_service_times_from_streamed_and_whole_answers() -> None:
    pace = make_pace(InMemoryLedger())
    assert pace.service_estimate(100) == ServiceEstimate(0.0, 0.0)  # nothing measured yet
    pace.observe_stream(admitted_at=1.0, first_byte_at=1.5, finished_at=3.5, output_tokens=101)
    assert pace.first_token_after_admit.value == pytest.approx(0.5)
    assert pace.seconds_per_output_token.value == pytest.approx(0.02)
    assert pace.service_estimate(100) == ServiceEstimate(pytest.approx(0.5), pytest.approx(2.5))
    # A whole answer teaches the time per token only; an empty one teaches nothing.
    pace.observe_whole(admitted_at=0.0, finished_at=1.0, output_tokens=10)
    assert pace.first_token_after_admit.count == 1
    assert pace.seconds_per_output_token.count == 2
    pace.observe_whole(admitted_at=0.0, finished_at=1.0, output_tokens=0)
    pace.observe_stream(admitted_at=0.0, first_byte_at=0.5, finished_at=1.0, output_tokens=0)
    assert (pace.first_token_after_admit.count, pace.seconds_per_output_token.count) == (1, 2)
    # One token: its delay is the first token's, with no time per token after it.
    pace.observe_stream(admitted_at=0.0, first_byte_at=0.7, finished_at=0.7, output_tokens=1)
    assert (pace.first_token_after_admit.count, pace.seconds_per_output_token.count) == (2, 2)


def test_time_blocked_writing_to_the_client_is_not_the_backends() -> None:
    pace = make_pace(InMemoryLedger())
    # 2 s of streaming for 101 tokens, 0.1 s of it blocked on the client: the backend took
    # 1.9 s; and 0.2 s of the first byte's delay was the client's.
    pace.observe_stream(
        admitted_at=1.0,
        first_byte_at=1.5,
        finished_at=3.5,
        output_tokens=101,
        wait_before_first_byte_s=0.2,
        wait_after_first_byte_s=0.1,
    )
    assert pace.first_token_after_admit.value == pytest.approx(0.3)
    assert pace.seconds_per_output_token.value == pytest.approx(0.019)


@pytest.mark.parametrize("blocked_share", [CLIENT_PACED_SHARE * 1.01, 0.5, 0.99])
def test_a_stream_paced_by_its_client_teaches_no_time_per_token(blocked_share: float) -> None:
    pace = make_pace(InMemoryLedger())
    pace.observe_stream(
        admitted_at=0.0,
        first_byte_at=0.5,
        finished_at=10.5,
        output_tokens=101,
        wait_after_first_byte_s=10.0 * blocked_share,
    )
    assert pace.seconds_per_output_token.count == 0
    assert pace.first_token_after_admit.value == pytest.approx(0.5)  # that part was not paced


def test_a_stream_within_the_share_is_learned_less_its_wait() -> None:
    pace = make_pace(InMemoryLedger())
    wait_s = 10.0 * CLIENT_PACED_SHARE
    pace.observe_stream(
        admitted_at=0.0,
        first_byte_at=0.5,
        finished_at=10.5,
        output_tokens=101,
        wait_after_first_byte_s=wait_s,
    )
    assert pace.seconds_per_output_token.value == pytest.approx((10.0 - wait_s) / 100)


def test_describe_reports_none_for_what_is_not_measured() -> None:
    pace = make_pace(InMemoryLedger())
    assert pace.describe(0.0) == {
        "drain_rate_blocks_per_s": None,
        "saturated_drain_rate_blocks_per_s": None,
        "first_token_after_admit_s": None,
        "seconds_per_output_token": None,
    }

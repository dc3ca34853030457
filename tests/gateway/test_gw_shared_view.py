"""A backend's ledger shared by several processes: the others' bookings and views added to
this process's own requests, and what it may promise while Redis is away (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from test_gw_ledger import demand

from gateway.shared_view import PeerView, SharedLedger


@dataclass
class Sink:
    changes: list[tuple[str, int, int]] = field(default_factory=list)

    def resized(self, backend: str, key: int, blocks: int) -> None:
        self.changes.append((backend, key, blocks))

    def released(self, backend: str, key: int) -> None:
        self.changes.append((backend, key, 0))


def test_the_others_bookings_and_views_add_to_this_process_own() -> None:
    ledger = SharedLedger("a", Sink())
    ledger.open(1, demand(), 0.0)
    own = ledger.own_totals()
    ledger.heard(
        40,
        {"p2": PeerView(10, 6, 2, 1, 3, 50, 2, 0, 9), "p3": PeerView(5, 5, 1, 0, 1, 7, 0, 0, 3)},
        processes=3,
    )
    totals = ledger.totals()
    assert totals.reserved_blocks == own.reserved_blocks + 40
    assert totals.held_blocks == own.held_blocks + 15
    assert totals.credit_blocks == own.credit_blocks + 4
    assert totals.unseen_blocks == own.unseen_blocks + 1
    assert totals.entries == own.entries == 1  # connections are this process's own
    split = ledger.held_split(settled_before=10.0)
    assert split.settled_blocks == own.held_blocks + 11
    assert split.fresh_blocks == 4
    assert split.settled_sequences == 1 + 3
    # What the others' requests are certain still to grow into is no room for anyone.
    assert split.certain_growth_blocks == own_split_growth(ledger) + 9 + 3
    assert ledger.released_blocks == 57
    assert ledger.others_waiting == 2
    assert ledger.standing().share == 1.0


def test_while_redis_is_away_fail_closed_promises_nothing_and_fail_open_a_share() -> None:
    ledger = SharedLedger("a", Sink())
    assert ledger.standing().unavailable  # nothing heard yet
    ledger.heard(40, {"p2": PeerView(10, 6, 2, 1, 3, 50)}, processes=4)
    ledger.lost()
    assert "Redis" in ledger.standing().unavailable
    assert ledger.totals().reserved_blocks == 0  # the others' last bookings are not counted
    ledger.fail_open = True
    assert ledger.standing().share == 0.25
    assert not ledger.standing().unavailable


def test_changes_of_a_reservation_reach_the_sink_once() -> None:
    sink = Sink()
    ledger = SharedLedger("a", sink)
    ledger.open(1, demand(prompt=20, expected=30, cap=100), 0.0)
    reserved = ledger.reserved_of(1)
    ledger.grow(1, 0, 10)  # within the reservation: nothing to tell
    assert sink.changes == []
    ledger.grow(1, 0, 40)  # past it: the reservation grows
    assert sink.changes == [("a", 1, ledger.reserved_of(1))]
    assert ledger.reserved_of(1) != reserved
    ledger.close(1)
    ledger.close(1)
    assert sink.changes[-1] == ("a", 1, 0)
    assert len(sink.changes) == 2
    assert dict(ledger.leases()) == {}


def own_split_growth(ledger: SharedLedger) -> int:
    return ledger.view(settled_before=10.0).certain_growth_blocks


def test_a_process_publishes_what_its_requests_are_certain_to_grow_into() -> None:
    ledger = SharedLedger("a", Sink())
    floored = replace(demand(prompt=20, expected=300, cap=300), floor_output_tokens=300)
    entry = ledger.open(1, floored, 0.0)
    ledger.open(2, demand(prompt=20, expected=30, cap=100), 0.0)  # no floor: no certain growth
    assert floored.floor_blocks - entry.held_blocks > 0
    assert own_split_growth(ledger) == floored.floor_blocks - entry.held_blocks
    # Published, it is the others' certain growth in another process's split.
    other = SharedLedger("a", Sink())
    other.heard(floored.reserved_blocks, {"p1": ledger.view(10.0)})
    assert other.held_split(10.0).certain_growth_blocks == floored.floor_blocks - entry.held_blocks


def test_a_published_view_round_trips_and_junk_is_refused() -> None:
    view = PeerView(1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert PeerView.from_text(view.to_text()) == view
    # A rolling update: an older process's view lacks the newest field, a newer one's has more.
    assert PeerView.from_text("[1,2,3,4,5,6,7,8]") == PeerView(1, 2, 3, 4, 5, 6, 7, 8, 0)
    assert PeerView.from_text("[1,2,3,4,5,6,7,8,9,10]") == view
    for junk in (
        "",
        "[1,2]",
        "[1,2,3,4,5,6,7]",
        '{"a": 1}',
        "[1,2,3,4,5,6,7,-8]",
        "[1,2,3,4,5,6,7,true]",
        "nan",
    ):
        assert PeerView.from_text(junk) is None


def test_the_blocks_other_processes_freed_reach_the_pace_once() -> None:
    ledger = SharedLedger("a", Sink())
    freed: list[int] = []
    ledger.on_freed = freed.append
    ledger.heard(0, {"p2": PeerView(freed_blocks=100)})  # first sight: a baseline, nothing freed
    ledger.heard(0, {"p2": PeerView(freed_blocks=130), "p3": PeerView(freed_blocks=7)})
    ledger.heard(0, {"p2": PeerView(freed_blocks=130), "p3": PeerView(freed_blocks=12)})
    ledger.heard(0, {"p3": PeerView(freed_blocks=12)})  # p2 left: nothing, and no negative
    assert freed == [30, 5]
    ledger.open(1, demand(), 0.0)
    reserved = ledger.reserved_of(1)
    assert reserved is not None
    ledger.close(1)
    assert ledger.view(0.0).freed_blocks == reserved

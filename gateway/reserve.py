"""A process's standing reserve on one backend of the shared ledger (pure).

Booking every admission in Redis puts a round trip in front of every first token. While
nobody waits for a backend, each process therefore keeps a few blocks booked ahead, under the
same caps as any booking (gateway/lua/reserve.lua), and admits a request that fits them at
once; its lease is made in Redis afterwards, moving its blocks out of the reserve, so the
shared total never changes for it and never exceeds a cap. The reserve is topped up in the
background and given back as soon as anyone waits, so that it never keeps a block from a
request that could use it: the most a process holds is `1 / (RESERVE_DIVISOR * N)` of the
room the budget leaves (N processes alive), so together they hold at most half of it.

`Reserve` keeps the local account: what may be taken now, what was taken and not yet told
to Redis, and what a round trip in flight carries. `reserve_target` is the rule for its size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Together the processes hold at most 1 / RESERVE_DIVISOR of the room under the budget.
RESERVE_DIVISOR = 2


def reserve_target(
    *, cap: int | None, others_booked: int, own_reserved: int, processes: int, waiting: int
) -> int:
    """The blocks this process should hold ahead on a backend: none while anyone waits for
    it (`waiting`: this process's queue and the others' last published ones) or its budget is
    unknown (`cap` None), else its part of the room the cap leaves after every reservation."""
    if cap is None or waiting > 0:
        return 0
    room = cap - others_booked - own_reserved
    return max(0, room // (RESERVE_DIVISOR * max(1, processes)))


@dataclass(slots=True)
class Reserve:
    """The local account of one backend's reserve (see the module docstring)."""

    # Blocks that may be taken now: the reserve as Redis last said, less what was taken since.
    available: int = 0
    # The reserve's blocks in Redis as of the last answer.
    held: int = 0
    # (request key, blocks) taken from the reserve and not yet sent to Redis, in order.
    takes: list[tuple[int, int]] = field(default_factory=list)
    # What the round trip in flight carries.
    sent: list[tuple[int, int]] = field(default_factory=list)

    def take(self, key: int, blocks: int) -> bool:
        """Admit request `key` on `blocks` of the reserve, if it holds them."""
        if blocks > self.available:
            return False
        self.available -= blocks
        self.takes.append((key, blocks))
        return True

    def fits(self, blocks: int) -> bool:
        return blocks <= self.available

    def send(self, target: int | None) -> list[tuple[int, int]]:
        """A round trip is sent with the takes so far and, with `target`, a new size: a
        smaller one counts at once (what is given back may not be taken meanwhile), a larger
        one when Redis answers. Returns the takes it carries."""
        self.sent, self.takes = self.takes, []
        if target is not None:
            self.available = min(self.available, target)
        return self.sent

    def answered(self, held: int) -> None:
        """Redis answered the round trip: the reserve holds `held` blocks now, of which the
        takes made since the trip was sent are already gone."""
        self.held = held
        self.available = max(0, held - sum(blocks for _, blocks in self.takes))
        self.sent = []

    def failed(self) -> None:
        """The round trip failed: nothing of it is known to have happened. Its takes are sent
        again (a take is idempotent), and nothing more is taken until Redis answers."""
        self.takes[:0] = self.sent
        self.sent = []
        self.available = 0

    @property
    def pending(self) -> bool:
        return bool(self.takes)

"""kvgate against its peers, as the issues compare them (pure).

A campaign (`tests/benchmarks/campaign.py`) runs the same arrivals through vLLM straight, vLLM
with its own guard `--max-num-queued-reqs N` for several N, and kvgate, once for each kind of
client. Issue 20 judges kvgate by what each kind of client wants, from its headers:

- deadline clients (`X-Kvgate-Deadline-Ms` only; they give up at the deadline): useful tokens,
  against the best N's and vLLM straight's;
- first-token-deadline clients (`X-Kvgate-TTFT-Ms` only; they wait for the whole answer):
  first-token goodput, against the best N's;
- clients with both headers: useful tokens against the best N's, and first-token goodput
  against vLLM straight's;

and for every kind by its preemptions (against the best N's, the one best by the kind's own
figure, and vLLM straight's), by the share of refusals within 1 s of arrival and by the
refusals that came after the request's own deadline (its first-token objective for ttft
clients). With `--oracle` every kvgate run is made a second time with the true output lengths
in a header; a learned run is then also compared with its oracle twin.

Machine noise is large (vLLM's own figures move by a third from run to run), so with repeated
rounds a peer's figure is its median over the rounds, and every kvgate run is compared with it
on its own: the spread of the ratios is the answer, not one of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

STRAIGHT = "none"
USEFUL = "useful_tokens_per_s"
GOODPUT = "goodput_slo_tokens_per_s"


class Clients(StrEnum):
    """A kind of client, by the headers it sends (see the module docstring)."""

    DEADLINE = "deadline"
    TTFT = "ttft"
    BOTH = "both"

    @property
    def judged_by(self) -> str:
        """The summary figure this kind is judged by against the best N."""
        return GOODPUT if self is Clients.TTFT else USEFUL


# What each kind is, in a table's title.
KIND_TITLES = {
    Clients.DEADLINE: "deadline clients (X-Kvgate-Deadline-Ms only, they give up at the deadline): "
    "judged by useful tokens",
    Clients.TTFT: "first-token-deadline clients (X-Kvgate-TTFT-Ms only, they wait for the rest): "
    "judged by first-token goodput",
    Clients.BOTH: "clients with both headers: judged by useful tokens, and first-token goodput "
    "against vLLM straight's",
}


@dataclass(frozen=True, slots=True)
class Run:
    """One bench result: `guard` is "none" (vLLM straight, or kvgate in front of it) or N
    as text; `variant` is None for vLLM itself and kvgate's extra arguments ("" for the
    defaults) for kvgate; `round` counts from 1 with `--repeat`; `clients` is the kind of
    client replayed; `oracle` marks a kvgate run told the true output lengths."""

    guard: str
    variant: str | None
    rate: float
    round: int
    summary: Mapping[str, Any]
    clients: Clients = Clients.BOTH
    oracle: bool = False

    @property
    def is_kvgate(self) -> bool:
        return self.variant is not None


@dataclass(frozen=True, slots=True)
class Comparison:
    """One kvgate run against its peers at the same rate and kind of client. A ratio is None
    when the peer's figure is missing or zero. Every figure is computed for every kind; the
    rendering shows the ones that kind is judged by."""

    variant: str
    clients: Clients
    oracle: bool
    rate: float
    round: int
    useful_vs_straight: float | None
    useful_vs_best_guard: float | None
    best_useful_guard: str | None
    goodput_vs_straight: float | None
    goodput_vs_best_guard: float | None
    best_goodput_guard: str | None
    preemptions: float | None
    straight_preemptions: float | None
    best_guard_preemptions: float | None  # of the N best by this kind's own figure
    refusals_within_1s_share: float | None
    refusals_after_deadline: float | None  # after the TTFT objective for ttft clients
    rejection_p99_s: float | None
    # Median first token minus vLLM straight's (seconds): at or below capacity a gateway must
    # not delay first tokens (issue 20: at most 100 ms later at 1x, 25 ms at 0.5x).
    ttft_p50_vs_straight_s: float | None = None
    # A learned run's judged figure over its oracle twin's (same variant, rate, round, kind).
    vs_oracle: float | None = None


def _figure(summary: Mapping[str, Any], key: str) -> float | None:
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _percentile(summary: Mapping[str, Any], key: str, which: str) -> float | None:
    percentiles = summary.get(key)
    if not isinstance(percentiles, Mapping):
        return None
    return _figure(percentiles, which)


def _median(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _ratio(value: float | None, peer: float | None) -> float | None:
    if value is None or peer is None or peer == 0:
        return None
    return value / peer


def _difference(value: float | None, peer: float | None) -> float | None:
    return None if value is None or peer is None else value - peer


def _guard_medians(guards: Mapping[str, Sequence[Run]], key: str) -> dict[str, float | None]:
    """Each guard's figure, the median over its rounds."""
    return {guard: _median(_figure(run.summary, key) for run in runs) for guard, runs in guards.items()}


def _best_guard(medians: Mapping[str, float | None]) -> tuple[str | None, float | None]:
    best: tuple[str | None, float | None] = (None, None)
    for guard, value in medians.items():
        if value is not None and (best[1] is None or value > best[1]):
            best = (guard, value)
    return best


def _oracle_twin(run: Run, group: Sequence[Run]) -> Run | None:
    for other in group:
        if other.oracle and other.variant == run.variant and other.round == run.round:
            return other
    return None


def against_peers(runs: Sequence[Run]) -> list[Comparison]:
    """Every kvgate run against the peers that ran at its rate with its kind of client, in the
    order of `runs`."""
    comparisons: list[Comparison] = []
    for rate, clients in dict.fromkeys((run.rate, run.clients) for run in runs):
        group = [run for run in runs if run.rate == rate and run.clients == clients]
        straight = [run for run in group if run.guard == STRAIGHT and not run.is_kvgate]
        guards: dict[str, list[Run]] = {}
        for run in group:
            if run.guard != STRAIGHT and not run.is_kvgate:
                guards.setdefault(run.guard, []).append(run)
        useful_guard, best_useful = _best_guard(_guard_medians(guards, USEFUL))
        goodput_guard, best_goodput = _best_guard(_guard_medians(guards, GOODPUT))
        judged_guard = goodput_guard if clients is Clients.TTFT else useful_guard
        best_preemptions = (
            None if judged_guard is None else _guard_medians(guards, "preemptions")[judged_guard]
        )
        after_key = "refusals_after_ttft_slo" if clients is Clients.TTFT else "refusals_after_deadline"
        for run in group:
            if not run.is_kvgate:
                continue
            # vLLM straight of the same round when there is one: it ran right next to this run.
            same_round = [peer for peer in straight if peer.round == run.round] or straight

            def straight_median(key: str, peers: Sequence[Run] = same_round) -> float | None:
                return _median(_figure(peer.summary, key) for peer in peers)

            useful = _figure(run.summary, USEFUL)
            goodput = _figure(run.summary, GOODPUT)
            twin = None if run.oracle else _oracle_twin(run, group)
            comparisons.append(
                Comparison(
                    variant=run.variant or "",
                    clients=clients,
                    oracle=run.oracle,
                    rate=rate,
                    round=run.round,
                    useful_vs_straight=_ratio(useful, straight_median(USEFUL)),
                    useful_vs_best_guard=_ratio(useful, best_useful),
                    best_useful_guard=useful_guard,
                    goodput_vs_straight=_ratio(goodput, straight_median(GOODPUT)),
                    goodput_vs_best_guard=_ratio(goodput, best_goodput),
                    best_goodput_guard=goodput_guard,
                    preemptions=_figure(run.summary, "preemptions"),
                    straight_preemptions=straight_median("preemptions"),
                    best_guard_preemptions=best_preemptions,
                    refusals_within_1s_share=_figure(run.summary, "refusals_within_1s_share"),
                    refusals_after_deadline=_figure(run.summary, after_key),
                    rejection_p99_s=_percentile(run.summary, "time_to_rejection_s", "p99"),
                    ttft_p50_vs_straight_s=_difference(
                        _percentile(run.summary, "ttft_s", "p50"),
                        _median(_percentile(peer.summary, "ttft_s", "p50") for peer in same_round),
                    ),
                    vs_oracle=(
                        None
                        if twin is None
                        else _ratio(
                            _figure(run.summary, clients.judged_by), _figure(twin.summary, clients.judged_by)
                        )
                    ),
                )
            )
    return comparisons


def _percent(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def _number(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:+.0f} ms"


def _against_guard(ratio: float | None, guard: str | None) -> str:
    return _percent(ratio) + ("" if guard is None else f" (N={guard})")


def render_peers(comparisons: Sequence[Comparison]) -> str:
    """Markdown: one table per kind of client, with the figures that kind is judged by
    (empty string when there are no comparisons)."""
    out: list[str] = []
    for clients in dict.fromkeys(c.clients for c in comparisons):
        rows = [c for c in comparisons if c.clients == clients]
        oracle = any(c.vs_oracle is not None for c in rows)
        after = "429s after TTFT objective" if clients is Clients.TTFT else "429s after deadline"
        figures = {
            Clients.DEADLINE: ["useful / best N (N)", "useful / vLLM straight"],
            Clients.TTFT: ["first-token goodput / best N (N)"],
            Clients.BOTH: ["useful / best N (N)", "first-token goodput / vLLM straight"],
        }[clients]
        header = [
            "kvgate",
            "rate/s",
            "round",
            *figures,
            "preemptions (straight, best N)",
            "429s within 1 s",
            after,
            "TTFT p50 vs straight",
        ]
        if oracle:
            header.append("learned / oracle")
        out += [f"{clients.value}: {KIND_TITLES[clients]}", ""]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for c in rows:
            cells = {
                Clients.DEADLINE: [
                    _against_guard(c.useful_vs_best_guard, c.best_useful_guard),
                    _percent(c.useful_vs_straight),
                ],
                Clients.TTFT: [_against_guard(c.goodput_vs_best_guard, c.best_goodput_guard)],
                Clients.BOTH: [
                    _against_guard(c.useful_vs_best_guard, c.best_useful_guard),
                    _percent(c.goodput_vs_straight),
                ],
            }[clients]
            name = (c.variant or "defaults") + (" (oracle)" if c.oracle else "")
            row = [
                name,
                f"{c.rate:g}",
                str(c.round),
                *cells,
                f"{_number(c.preemptions)} ({_number(c.straight_preemptions)}, "
                f"{_number(c.best_guard_preemptions)})",
                # One decimal: the bound is 98%, and 97.6% must not read as 98%.
                _percent(c.refusals_within_1s_share, 1),
                _number(c.refusals_after_deadline),
                _milliseconds(c.ttft_p50_vs_straight_s),
            ]
            if oracle:
                row.append(_percent(c.vs_oracle))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)

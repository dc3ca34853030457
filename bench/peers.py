"""kvgate against its peers, as the issues compare them (pure).

A campaign (`tests/benchmarks/campaign.py`) runs the same arrivals through vLLM straight, vLLM
with its own guard `--max-num-queued-reqs N` for several N, and kvgate. The issues judge kvgate
by ratios to those peers at the same load: useful tokens and first-token goodput against the
best N's (each figure its own best N), preemptions against the best N's and vLLM straight's,
and the time to a 429. This module computes those ratios from the runs' summaries, so that
every campaign reports them the same way instead of by hand.

Machine noise is large (vLLM's own figures move by a third from run to run), so with repeated
rounds a peer's figure is its median over the rounds, and every kvgate run is compared with it
on its own: the spread of the ratios is the answer, not one of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STRAIGHT = "none"


@dataclass(frozen=True, slots=True)
class Run:
    """One bench result: `guard` is "none" (vLLM straight, or kvgate in front of it) or N
    as text; `variant` is None for vLLM itself and kvgate's extra arguments ("" for the
    defaults) for kvgate; `round` counts from 1 with `--repeat`."""

    guard: str
    variant: str | None
    rate: float
    round: int
    summary: Mapping[str, Any]

    @property
    def is_kvgate(self) -> bool:
        return self.variant is not None


@dataclass(frozen=True, slots=True)
class Comparison:
    """One kvgate run against its peers at the same rate. A ratio is None when the peer's
    figure is missing or zero."""

    variant: str
    rate: float
    round: int
    useful_vs_straight: float | None
    useful_vs_best_guard: float | None
    best_useful_guard: str | None
    goodput_vs_best_guard: float | None
    best_goodput_guard: str | None
    preemptions: float | None
    straight_preemptions: float | None
    best_guards_preemptions: float | None  # the fewer of the two best guards'
    rejection_p99_s: float | None


def _figure(summary: Mapping[str, Any], key: str) -> float | None:
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) else None


def _rejection_p99(summary: Mapping[str, Any]) -> float | None:
    percentiles = summary.get("time_to_rejection_s")
    if not isinstance(percentiles, Mapping):
        return None
    return _figure(percentiles, "p99")


def _median(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _ratio(value: float | None, peer: float | None) -> float | None:
    if value is None or peer is None or peer == 0:
        return None
    return value / peer


def _guard_medians(guards: Mapping[str, Sequence[Run]], key: str) -> dict[str, float | None]:
    """Each guard's figure, the median over its rounds."""
    return {guard: _median(_figure(run.summary, key) for run in runs) for guard, runs in guards.items()}


def _best_guard(medians: Mapping[str, float | None]) -> tuple[str | None, float | None]:
    best: tuple[str | None, float | None] = (None, None)
    for guard, value in medians.items():
        if value is not None and (best[1] is None or value > best[1]):
            best = (guard, value)
    return best


def against_peers(runs: Sequence[Run]) -> list[Comparison]:
    """Every kvgate run against the peers that ran at its rate, in the order of `runs`."""
    comparisons: list[Comparison] = []
    for rate in dict.fromkeys(run.rate for run in runs):
        at_rate = [run for run in runs if run.rate == rate]
        straight = [run for run in at_rate if run.guard == STRAIGHT and not run.is_kvgate]
        guards: dict[str, list[Run]] = {}
        for run in at_rate:
            if run.guard != STRAIGHT and not run.is_kvgate:
                guards.setdefault(run.guard, []).append(run)
        useful_guard, best_useful = _best_guard(_guard_medians(guards, "useful_tokens_per_s"))
        goodput_guard, best_goodput = _best_guard(_guard_medians(guards, "goodput_slo_tokens_per_s"))
        preemption_medians = _guard_medians(guards, "preemptions")
        best_guards_preemptions = [
            value
            for guard in (useful_guard, goodput_guard)
            if guard is not None and (value := preemption_medians[guard]) is not None
        ]
        best_preemptions = min(best_guards_preemptions, default=None)
        for run in at_rate:
            if not run.is_kvgate:
                continue
            # vLLM straight of the same round when there is one: it ran right next to this run.
            same_round = [peer for peer in straight if peer.round == run.round] or straight
            straight_useful = _median(_figure(peer.summary, "useful_tokens_per_s") for peer in same_round)
            useful = _figure(run.summary, "useful_tokens_per_s")
            comparisons.append(
                Comparison(
                    variant=run.variant or "",
                    rate=rate,
                    round=run.round,
                    useful_vs_straight=_ratio(useful, straight_useful),
                    useful_vs_best_guard=_ratio(useful, best_useful),
                    best_useful_guard=useful_guard,
                    goodput_vs_best_guard=_ratio(
                        _figure(run.summary, "goodput_slo_tokens_per_s"), best_goodput
                    ),
                    best_goodput_guard=goodput_guard,
                    preemptions=_figure(run.summary, "preemptions"),
                    straight_preemptions=_median(_figure(peer.summary, "preemptions") for peer in same_round),
                    best_guards_preemptions=best_preemptions,
                    rejection_p99_s=_rejection_p99(run.summary),
                )
            )
    return comparisons


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _number(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_peers(comparisons: Sequence[Comparison]) -> str:
    """A markdown table of the comparisons (empty string when there are none)."""
    if not comparisons:
        return ""
    lines = [
        "| kvgate | rate/s | round | useful / vLLM straight | useful / best N (N) "
        "| goodput / best N (N) | preemptions (straight, best Ns) | 429 p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        guard_useful = _percent(c.useful_vs_best_guard)
        if c.best_useful_guard is not None:
            guard_useful += f" (N={c.best_useful_guard})"
        guard_goodput = _percent(c.goodput_vs_best_guard)
        if c.best_goodput_guard is not None:
            guard_goodput += f" (N={c.best_goodput_guard})"
        preemptions = (
            f"{_number(c.preemptions)} ({_number(c.straight_preemptions)}, "
            f"{_number(c.best_guards_preemptions)})"
        )
        lines.append(
            f"| {c.variant or 'defaults'} | {c.rate:g} | {c.round} | {_percent(c.useful_vs_straight)} "
            f"| {guard_useful} | {guard_goodput} | {preemptions} | {_number(c.rejection_p99_s, '{:.2f}')} |"
        )
    return "\n".join(lines) + "\n"

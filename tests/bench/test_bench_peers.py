"""kvgate against its peers: the ratios the issues judge, per kind of client, from campaign runs."""

from __future__ import annotations

from typing import Any

import pytest

from bench.peers import Clients, Run, against_peers, render_peers


def summary(
    useful: float,
    goodput: float,
    preemptions: int,
    reject_p99: float | None = None,
    *,
    within_1s: float | None = None,
    after_deadline: int | None = 0,
    after_ttft: int = 0,
    ttft_p50: float | None = None,
) -> dict[str, Any]:
    return {
        "ttft_s": {"p50": ttft_p50, "p90": None, "p99": None},
        "useful_tokens_per_s": useful,
        "goodput_slo_tokens_per_s": goodput,
        "preemptions": preemptions,
        "time_to_rejection_s": {"p50": None, "p99": reject_p99},
        "refusals_within_1s_share": within_1s,
        "refusals_after_deadline": after_deadline,
        "refusals_after_ttft_slo": after_ttft,
    }


def test_each_figure_is_compared_with_its_own_best_guard() -> None:
    runs = [
        Run("none", None, 15.0, 1, summary(200.0, 80.0, 20)),
        Run("none", "", 15.0, 1, summary(190.0, 120.0, 1, 0.7, within_1s=0.99, after_deadline=2)),
        Run("16", None, 15.0, 1, summary(130.0, 130.0, 12)),
        Run("32", None, 15.0, 1, summary(150.0, 110.0, 10)),
    ]
    [result] = against_peers(runs)
    assert result.clients is Clients.BOTH
    assert result.useful_vs_straight == pytest.approx(190 / 200)
    assert result.goodput_vs_straight == pytest.approx(120 / 80)
    assert result.useful_vs_best_guard == pytest.approx(190 / 150)
    assert result.best_useful_guard == "32"
    assert result.goodput_vs_best_guard == pytest.approx(120 / 130)
    assert result.best_goodput_guard == "16"
    assert result.straight_preemptions == 20
    # Clients with both headers are judged by useful tokens: the N best by those.
    assert result.best_guard_preemptions == 10
    assert result.preemptions == 1
    assert result.rejection_p99_s == 0.7
    assert result.refusals_within_1s_share == 0.99
    assert result.refusals_after_deadline == 2
    assert result.vs_oracle is None
    assert result.ttft_p50_vs_straight_s is None  # no first-token figures in these summaries


def test_each_kind_of_client_is_judged_against_peers_of_its_own_kind() -> None:
    runs = []
    for kind, scale in ((Clients.DEADLINE, 1.0), (Clients.TTFT, 2.0)):
        runs += [
            Run("none", None, 15.0, 1, summary(100.0 * scale, 50.0 * scale, 20), kind),
            Run("none", "", 15.0, 1, summary(90.0, 60.0, 2, after_deadline=None, after_ttft=3), kind),
            Run("16", None, 15.0, 1, summary(80.0 * scale, 70.0 * scale, 12), kind),
            Run("32", None, 15.0, 1, summary(85.0 * scale, 40.0 * scale, 8), kind),
        ]
    deadline, ttft = against_peers(runs)
    assert (deadline.clients, ttft.clients) == (Clients.DEADLINE, Clients.TTFT)
    assert deadline.useful_vs_straight == pytest.approx(0.9)
    assert ttft.useful_vs_straight == pytest.approx(0.45)
    assert ttft.goodput_vs_best_guard == pytest.approx(60 / 140)
    # Preemptions against the N best by the kind's own figure: 32 for useful, 16 for goodput.
    assert deadline.best_guard_preemptions == 8
    assert ttft.best_guard_preemptions == 12
    # A ttft client has no deadline: its late refusals are those after its first-token objective.
    assert deadline.refusals_after_deadline is None
    assert ttft.refusals_after_deadline == 3


def test_repeated_rounds_use_each_guards_median_and_the_same_rounds_straight_run() -> None:
    runs = [
        Run("none", None, 5.0, 1, summary(100.0, 50.0, 30)),
        Run("none", "--set a=1", 5.0, 1, summary(110.0, 60.0, 0)),
        Run("none", None, 5.0, 2, summary(50.0, 20.0, 30)),
        Run("none", "--set a=1", 5.0, 2, summary(55.0, 30.0, 0)),
        Run("16", None, 5.0, 1, summary(80.0, 70.0, 5)),
        Run("16", None, 5.0, 2, summary(60.0, 40.0, 7)),
        Run("16", None, 5.0, 3, summary(10.0, 10.0, 9)),
    ]
    runs[1] = Run("none", "--set a=1", 5.0, 1, {**runs[1].summary, "ttft_s": {"p50": 0.5}})
    runs[0] = Run("none", None, 5.0, 1, {**runs[0].summary, "ttft_s": {"p50": 0.4}})
    first, second = against_peers(runs)
    # Against vLLM straight of the same round.
    assert first.ttft_p50_vs_straight_s == pytest.approx(0.1)
    assert (first.round, second.round) == (1, 2)
    assert first.variant == second.variant == "--set a=1"
    assert first.useful_vs_straight == pytest.approx(1.1)
    assert second.useful_vs_straight == pytest.approx(1.1)
    # N=16's median over three rounds is 60 useful, 40 goodput, 7 preemptions.
    assert first.useful_vs_best_guard == pytest.approx(110 / 60)
    assert second.goodput_vs_best_guard == pytest.approx(30 / 40)
    assert first.best_guard_preemptions == 7


def test_rates_are_kept_apart_and_missing_peers_give_no_ratio() -> None:
    runs = [
        Run("none", "", 5.0, 1, summary(100.0, 50.0, 0)),
        Run("16", None, 15.0, 1, summary(80.0, 70.0, 5)),
        Run("none", "", 15.0, 1, summary(90.0, 0.0, 0)),
        Run("none", None, 15.0, 1, summary(0.0, 0.0, 3)),
    ]
    low, high = against_peers(runs)
    assert low.rate == 5.0
    assert low.useful_vs_straight is None
    assert low.useful_vs_best_guard is None
    assert low.best_useful_guard is None
    assert low.best_guard_preemptions is None
    # A peer that served nothing gives no ratio rather than a division by zero.
    assert high.useful_vs_straight is None
    assert high.useful_vs_best_guard == pytest.approx(90 / 80)
    assert high.goodput_vs_best_guard == pytest.approx(0.0)


def test_a_learned_run_is_compared_with_its_oracle_twin_by_the_kinds_own_figure() -> None:
    runs = []
    for kind in (Clients.DEADLINE, Clients.TTFT):
        runs += [
            Run("none", None, 15.0, 1, summary(100.0, 50.0, 20), kind),
            Run("none", "", 15.0, 1, summary(90.0, 30.0, 2), kind),
            Run("none", "", 15.0, 2, summary(70.0, 35.0, 2), kind),
            Run("none", "", 15.0, 1, summary(100.0, 60.0, 1), kind, oracle=True),
            Run("none", "", 15.0, 2, summary(80.0, 70.0, 1), kind, oracle=True),
        ]
    comparisons = against_peers(runs)
    learned = [c for c in comparisons if not c.oracle]
    assert [(c.clients, c.round, c.vs_oracle) for c in learned] == [
        (Clients.DEADLINE, 1, pytest.approx(0.9)),
        (Clients.DEADLINE, 2, pytest.approx(70 / 80)),
        (Clients.TTFT, 1, pytest.approx(0.5)),
        (Clients.TTFT, 2, pytest.approx(0.5)),
    ]
    # The oracle runs are judged against the peers as well.
    oracle = [c for c in comparisons if c.oracle]
    assert [c.useful_vs_straight for c in oracle[:2]] == [pytest.approx(1.0), pytest.approx(0.8)]
    assert all(c.vs_oracle is None for c in oracle)


def test_render_shows_each_kind_with_its_own_figures() -> None:
    runs = [
        Run("none", None, 15.0, 1, summary(200.0, 80.0, 20, ttft_p50=0.25)),
        Run("none", "", 15.0, 1, summary(190.0, 120.0, 1, 0.7, within_1s=0.976, ttft_p50=0.31)),
        Run("16", None, 15.0, 1, summary(130.0, 130.0, 12)),
        Run("none", None, 15.0, 1, summary(200.0, 80.0, 20), Clients.TTFT),
        Run("none", "", 15.0, 1, summary(190.0, 120.0, 1), Clients.TTFT),
        Run("none", "", 15.0, 1, summary(200.0, 150.0, 0), Clients.TTFT, oracle=True),
        Run("16", None, 15.0, 1, summary(130.0, 130.0, 12), Clients.TTFT),
    ]
    lines = render_peers(against_peers(runs)).splitlines()
    assert lines[0].startswith("both: clients with both headers")
    assert lines[2] == (
        "| kvgate | rate/s | round | useful / best N (N) | first-token goodput / vLLM straight "
        "| preemptions (straight, best N) | 429s within 1 s | 429s after deadline | TTFT p50 vs straight |"
    )
    assert lines[4] == "| defaults | 15 | 1 | 146% (N=16) | 150% | 1 (20, 12) | 97.6% | 0 | +60 ms |"
    assert lines[6].startswith("ttft: first-token-deadline clients")
    assert lines[8].endswith("| 429s after TTFT objective | TTFT p50 vs straight | learned / oracle |")
    assert lines[10] == "| defaults | 15 | 1 | 92% (N=16) | 1 (20, 12) | - | 0 | - | 80% |"
    assert lines[11] == "| defaults (oracle) | 15 | 1 | 115% (N=16) | 0 (20, 12) | - | 0 | - | - |"
    assert render_peers([]) == ""

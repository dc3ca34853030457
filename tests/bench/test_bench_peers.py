"""kvgate against its peers: the ratios the issues judge, from campaign runs."""

from __future__ import annotations

from typing import Any

import pytest

from bench.peers import Run, against_peers, render_peers


def summary(
    useful: float, goodput: float, preemptions: int, reject_p99: float | None = None
) -> dict[str, Any]:
    return {
        "useful_tokens_per_s": useful,
        "goodput_slo_tokens_per_s": goodput,
        "preemptions": preemptions,
        "time_to_rejection_s": {"p50": None, "p99": reject_p99},
    }


def test_each_figure_is_compared_with_its_own_best_guard() -> None:
    runs = [
        Run("none", None, 15.0, 1, summary(200.0, 80.0, 20)),
        Run("none", "", 15.0, 1, summary(190.0, 120.0, 1, 0.7)),
        Run("16", None, 15.0, 1, summary(130.0, 130.0, 12)),
        Run("32", None, 15.0, 1, summary(150.0, 110.0, 10)),
    ]
    [result] = against_peers(runs)
    assert result.useful_vs_straight == pytest.approx(190 / 200)
    assert result.useful_vs_best_guard == pytest.approx(190 / 150)
    assert result.best_useful_guard == "32"
    assert result.goodput_vs_best_guard == pytest.approx(120 / 130)
    assert result.best_goodput_guard == "16"
    assert result.straight_preemptions == 20
    # The stricter of the two best guards' preemption counts.
    assert result.best_guards_preemptions == 10
    assert result.preemptions == 1
    assert result.rejection_p99_s == 0.7


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
    first, second = against_peers(runs)
    assert (first.round, second.round) == (1, 2)
    assert first.variant == second.variant == "--set a=1"
    assert first.useful_vs_straight == pytest.approx(1.1)
    assert second.useful_vs_straight == pytest.approx(1.1)
    # N=16's median over three rounds is 60 useful, 40 goodput, 7 preemptions.
    assert first.useful_vs_best_guard == pytest.approx(110 / 60)
    assert second.goodput_vs_best_guard == pytest.approx(30 / 40)
    assert first.best_guards_preemptions == 7


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
    assert low.best_guards_preemptions is None
    # A peer that served nothing gives no ratio rather than a division by zero.
    assert high.useful_vs_straight is None
    assert high.useful_vs_best_guard == pytest.approx(90 / 80)
    assert high.goodput_vs_best_guard == pytest.approx(0.0)


def test_render_lists_every_kvgate_run() -> None:
    runs = [
        Run("none", None, 15.0, 1, summary(200.0, 80.0, 20)),
        Run("none", "", 15.0, 1, summary(190.0, 120.0, 1, 0.7)),
        Run("16", None, 15.0, 1, summary(130.0, 130.0, 12)),
    ]
    table = render_peers(against_peers(runs))
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[2] == "| defaults | 15 | 1 | 95% | 146% (N=16) | 92% (N=16) | 1 (20, 12) | 0.70 |"
    assert render_peers([]) == ""

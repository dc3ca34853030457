"""bench.fleet: one gateway's run in front of several engines, from the engines' counters and
the bench's records, and kvgate's verdict against the SGLang policies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench import fleet
from bench.promtext import Reading, parse_reading

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def test_engine_delta_from_two_recorded_vllm_scrapes() -> None:
    before = parse_reading((FIXTURES / "metrics_0.32.0.txt").read_text())
    after = parse_reading((FIXTURES / "metrics_0.32.0_busy.txt").read_text())
    delta = fleet.engine_delta("http://e1", before, after)
    # vllm:prefix_cache_queries_total 4033 -> 32599, hits 2912 -> 11392, generation 170 -> 5254.
    assert delta == fleet.EngineDelta(
        engine="http://e1",
        generation_tokens=5084.0,
        prompt_tokens=28566.0,
        preemptions=1.0,
        prefix_cache_queries=28566.0,
        prefix_cache_hits=8480.0,
    )


def test_a_counter_missing_from_a_scrape_has_no_delta() -> None:
    delta = fleet.engine_delta("e", Reading(generation_tokens_total=5.0), Reading())
    assert delta.generation_tokens is None
    assert delta.preemptions is None


def engine(
    name: str, generated: float | None, *, prompt: float = 100.0, queries: float = 100.0, hits: float = 0.0,
    preemptions: float = 0.0,
) -> fleet.EngineDelta:  # fmt: skip
    return fleet.EngineDelta(name, generated, prompt, preemptions, queries, hits)


def summary(**values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sent": 4,
        "ok": 2,
        "late": 1,
        "errors": 0,
        "useful_tokens": 30,
        "useful_tokens_per_s": 3.0,
        "client_output_tokens": 40,
        "client_prompt_tokens": 200,
        "ttft_s": {"p50": 0.1, "p90": 0.2, "p99": 0.3},
    }
    base.update(values)
    return base


RECORDS = [
    {"status": 200, "prompt_tokens_wanted": 60},
    {"status": 200, "prompt_tokens_wanted": 60},
    {"status": 429, "prompt_tokens_wanted": 50},
    {"status": 503, "prompt_tokens_wanted": 50},
    {"status": None, "prompt_tokens_wanted": 0},
]


def figures(
    target: str = fleet.KVGATE, engines: list[fleet.EngineDelta] | None = None, **values: Any
) -> fleet.RunFigures:
    return fleet.run_figures(
        target=target,
        trace="mooncake",
        rate=2.0,
        round_=1,
        summary=summary(**values),
        records=RECORDS,
        engines=engines or [engine("a", 30.0, hits=40.0), engine("b", 10.0, hits=10.0)],
    )


def test_run_figures_sum_the_engines_and_count_refusals_by_status() -> None:
    run = figures()
    assert (run.sent, run.ok, run.late, run.refused_429, run.refused_503) == (4, 2, 1, 1, 1)
    assert run.useful_tokens == 30
    assert (run.ttft_p50_s, run.ttft_p99_s) == (0.1, 0.3)
    assert run.preemptions == 0.0
    assert run.generated_tokens == 40.0
    assert run.generation_shares == (0.75, 0.25)
    assert run.prefix_hit_rate == pytest.approx(50.0 / 200.0)
    assert run.accounting_gap == 0.0
    assert run.prompt_tokens_sent == 220
    assert run.engines_shared is False
    assert run.to_json()["generation_shares"] == [0.75, 0.25]


@pytest.mark.parametrize(
    ("engines", "shares", "hit_rate", "gap", "shared"),
    [
        # An engine that served nothing of the run.
        ([engine("a", 40.0), engine("b", 0.0)], (1.0, 0.0), 0.0, 0.0, False),
        # Nothing generated at all: no shares, no hit rate without queries.
        ([engine("a", 0.0, queries=0.0), engine("b", 0.0, queries=0.0)], (None, None), None, -40.0, False),
        # A scrape without the counter: no total, no share.
        ([engine("a", None), engine("b", 40.0)], (None, None), 0.0, None, False),
        # More prompt tokens than the run sent: another client used the engines.
        ([engine("a", 40.0, prompt=200.0), engine("b", 1.0, prompt=21.0)], (40 / 41, 1 / 41), 0.0, 1.0, True),
    ],
)
def test_run_figures_edge_cases(
    engines: list[fleet.EngineDelta],
    shares: tuple[float | None, ...],
    hit_rate: float | None,
    gap: float | None,
    shared: bool,
) -> None:
    run = figures(engines=engines)
    assert run.generation_shares == pytest.approx(shares)
    assert run.prefix_hit_rate == hit_rate
    assert run.accounting_gap == gap
    assert run.engines_shared is shared


def peers_and_kvgate(
    kvgate_useful: float, kvgate_hits: float, kvgate_preemptions: float, kvgate_split: tuple[float, float]
) -> list[fleet.RunFigures]:
    a, b = kvgate_split
    return [
        figures(
            fleet.CACHE_AWARE,
            [engine("a", 30.0, hits=60.0, preemptions=2.0), engine("b", 10.0, preemptions=1.0)],
            useful_tokens_per_s=5.0,
        ),
        figures(
            fleet.sglang_target("round_robin"),
            [engine("a", 20.0, hits=10.0, preemptions=1.0), engine("b", 20.0, preemptions=1.0)],
            useful_tokens_per_s=6.0,
        ),
        figures(
            fleet.KVGATE,
            [
                engine("a", a, hits=kvgate_hits, preemptions=kvgate_preemptions),
                engine("b", b),
            ],
            useful_tokens_per_s=kvgate_useful,
        ),
    ]


def test_verdict_compares_with_the_best_policy_cache_aware_and_the_fewest_preemptions() -> None:
    [verdict] = fleet.verdicts(peers_and_kvgate(6.6, 70.0, 1.0, (20.0, 20.0)))
    assert verdict.best_policy == "sglang round_robin"
    assert verdict.useful_vs_best == pytest.approx(1.1)
    assert verdict.hit_rate_minus_cache_aware == pytest.approx(70 / 200 - 60 / 200)
    assert (verdict.preemptions, verdict.fewest_peer_preemptions) == (1.0, 2.0)
    assert verdict.balanced is True
    assert verdict.met is True
    table = fleet.render_verdicts([verdict])
    assert "| mooncake | 2 | 1 | 110% (sglang round_robin) | +5.0 pt | 1 (2) | yes | yes |" in table


@pytest.mark.parametrize(
    ("useful", "hits", "preemptions", "split"),
    [
        (5.9, 70.0, 1.0, (20.0, 20.0)),  # fewer useful tokens than round_robin
        (6.6, 50.0, 1.0, (20.0, 20.0)),  # a lower hit rate than cache_aware
        (6.6, 70.0, 2.0, (20.0, 20.0)),  # as many preemptions as the fewest
        (6.6, 70.0, 1.0, (30.0, 10.0)),  # 75% of the tokens on one engine
    ],
)
def test_verdict_not_met_when_one_criterion_fails(
    useful: float, hits: float, preemptions: float, split: tuple[float, float]
) -> None:
    [verdict] = fleet.verdicts(peers_and_kvgate(useful, hits, preemptions, split))
    assert verdict.met is False


def test_no_verdict_without_peers_beside_kvgate() -> None:
    alone = figures()
    other_rate = replace(figures(fleet.CACHE_AWARE), rate=9.0)
    assert fleet.verdicts([alone, other_rate]) == []
    assert fleet.render_verdicts([]) == ""


def test_render_runs_one_row_per_run() -> None:
    table = fleet.render_runs(peers_and_kvgate(6.6, 70.0, 1.0, (20.0, 20.0)))
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert lines[-1].startswith(
        "| mooncake | 2 | 1 | kvgate | 2 | 1 | 0 | 1 | 1 | 30 | 6.6 | 1 | 35.0% | 50% / 50% |"
    )

"""Aggregation: outcomes, percentiles, goodput, backend deltas, fairness, comparison."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.promtext import Reading, parse_reading
from bench.records import RequestRecord, RunResult
from bench.report import (
    DEFINITIONS,
    FORCING_NOTE,
    Outcome,
    classify,
    compare,
    counter_delta,
    jain_index,
    mean_over_rounds,
    percentile,
    render_markdown,
    summarize,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def rec(index: int = 0, **fields: Any) -> RequestRecord:
    base = RequestRecord(
        index=index,
        tenant=None,
        priority=None,
        scheduled_s=float(index),
        start_lag_s=0.001,
        prompt_tokens_wanted=100,
        output_tokens_wanted=10,
    )
    return replace(base, **fields)


OK: dict[str, Any] = {
    "status": 200,
    "finished": True,
    "ttft_s": 0.5,
    "e2e_s": 1.4,
    "output_tokens": 10,
    "usage_completion_tokens": 10,
    "usage_prompt_tokens": 100,
}


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([float(i) for i in range(1, 101)], 99, 99.01),  # numpy's linear method
        ([float(i) for i in range(1, 101)], 90, 90.1),
    ],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        ([0.0, 0.0], None),
        ([1.0, 1.0, 1.0], 1.0),
        ([1.0, 0.0, 0.0, 0.0], 0.25),  # one tenant gets everything: 1/n
        ([1.0, 0.5], (1.5**2) / (2 * 1.25)),
        ([0.3], 1.0),
    ],
)
def test_jain_index(values: list[float], expected: float | None) -> None:
    assert jain_index(values) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("fields", "deadline", "outcome"),
    [
        (OK, None, Outcome.OK),
        (OK, 2.0, Outcome.OK),
        ({**OK, "e2e_s": 2.5}, 2.0, Outcome.LATE),
        ({"gave_up": True, "status": 200, "e2e_s": 2.0}, 2.0, Outcome.LATE),
        ({"status": 429, "e2e_s": 0.01}, None, Outcome.SHED),
        ({"status": 503, "e2e_s": 0.01}, 2.0, Outcome.SHED),
        ({"status": 500}, None, Outcome.ERROR),
        ({"status": 200, "finished": False, "error": "stream ended without [DONE]"}, None, Outcome.ERROR),
        ({"status": None, "error": "ConnectError"}, None, Outcome.ERROR),
        ({**OK, "error": "bad chunk"}, None, Outcome.ERROR),
    ],
)
def test_classify(fields: dict[str, Any], deadline: float | None, outcome: Outcome) -> None:
    assert classify(rec(**fields), deadline) is outcome


def _result(records: list[RequestRecord], **fields: Any) -> RunResult:
    return RunResult(target="http://t", records=tuple(records), duration_s=12.0, **fields)


def test_goodput_counts_only_ok_requests_and_the_slo_form_needs_a_fast_first_token() -> None:
    records = [
        rec(0, **OK),  # ok, TTFT 0.5
        rec(1, **{**OK, "ttft_s": 2.5, "e2e_s": 3.0}),  # ok, misses the 2 s TTFT objective
        rec(2, **{**OK, "output_tokens": 30}),  # ok, longer
        rec(3, gave_up=True, status=200, ttft_s=1.0, e2e_s=5.0, output_tokens=4),  # late
        rec(4, status=429, e2e_s=0.02, retry_after_s=1.0),  # shed
        rec(5, status=503, e2e_s=0.04),  # shed
        rec(6, status=500, e2e_s=0.01, error="boom"),  # error
    ]
    s = summarize(_result(records), offered_s=10.0, deadline_s=5.0, ttft_slo_s=2.0)
    assert (s.sent, s.ok, s.late, s.shed, s.errors) == (7, 3, 1, 2, 1)
    assert s.useful_tokens == 50
    assert s.useful_tokens_per_s == pytest.approx(5.0)
    assert s.goodput_rps == pytest.approx(0.3)
    assert s.goodput_tokens_per_s == pytest.approx(5.0)
    assert s.goodput_slo_requests == 2
    assert s.goodput_slo_rps == pytest.approx(0.2)
    assert s.goodput_slo_tokens_per_s == pytest.approx(4.0)
    assert s.client_output_tokens == 54  # the late request's tokens count here, not as useful
    assert s.time_to_rejection_s.p99 == pytest.approx(0.02 + 0.99 * 0.02)
    assert s.refusals_within_1s_share == 1.0
    assert (s.refusals_after_deadline, s.refusals_after_ttft_slo) == (0, 0)
    assert s.retry_after_s.p50 == 1.0
    assert s.e2e_s.p50 == pytest.approx(1.4)
    assert s.ttft_s.p50 == pytest.approx(0.75)  # 0.5, 0.5, 1.0, 2.5
    # TPOT over ok requests, (e2e - ttft) / (tokens - 1): 0.9/9, 0.5/9, 0.9/29
    assert s.tpot_s.p50 == pytest.approx(0.5 / 9)
    assert s.forced_length_exact == 2  # the 30-token one was asked for 10
    assert s.prompt_length_exact == 3
    assert s.backend_generation_tokens is None
    assert s.preemptions is None


@pytest.mark.parametrize(
    ("deadline", "within", "after_deadline", "after_ttft"),
    [(5.0, 0.5, 1, 2), (None, 0.5, None, 2)],
)
def test_refusals_are_judged_by_how_early_they_came(
    deadline: float | None, within: float, after_deadline: int | None, after_ttft: int
) -> None:
    records = [
        rec(0, status=429, e2e_s=0.2),
        rec(1, status=429, e2e_s=1.0),  # exactly 1 s still counts as early
        rec(2, status=503, e2e_s=3.0),  # after the 2 s first-token objective
        rec(3, status=429, e2e_s=6.0),  # after the 5 s deadline too
        rec(4, **OK),
    ]
    s = summarize(_result(records), offered_s=10.0, deadline_s=deadline, ttft_slo_s=2.0)
    assert s.refusals_within_1s_share == within
    assert s.refusals_after_deadline == after_deadline
    assert s.refusals_after_ttft_slo == after_ttft
    # The p99 stays in the summary beside the share.
    assert s.time_to_rejection_s.p99 == pytest.approx(3.0 + 0.97 * 3.0)


def test_no_refusals_give_no_share() -> None:
    s = summarize(_result([rec(0, **OK)]), offered_s=1.0, deadline_s=5.0)
    assert s.refusals_within_1s_share is None
    assert s.refusals_after_deadline == 0


def test_burst_without_offered_time_uses_the_run_duration() -> None:
    s = summarize(_result([rec(0, **OK)]), offered_s=0.0, deadline_s=None)
    assert s.goodput_rps == pytest.approx(1 / 12.0)


def test_backend_deltas_and_waste() -> None:
    before = Reading(running=0, waiting=0, preemptions_total=3, generation_tokens_total=100)
    after = Reading(running=0, waiting=0, preemptions_total=5, generation_tokens_total=160)
    records = [
        rec(0, **OK),
        rec(1, **{**OK, "output_tokens": 30}),
        rec(2, gave_up=True, status=200, e2e_s=5.0, output_tokens=20),
    ]
    s = summarize(
        _result(records, baseline={"b": before}, final={"b": after}, vllm_sources=("b",)),
        offered_s=10.0,
        deadline_s=5.0,
    )
    assert s.backend_generation_tokens == 60
    assert s.useful_tokens == 40
    assert s.backend_tokens_wasted == 20  # the late request's tokens
    assert s.preemptions == 2
    assert s.backend_prompt_tokens is None
    assert s.backend_shared is None


@pytest.mark.parametrize(("prompt_delta", "shared"), [(300, False), (250, False), (301, True)])
def test_a_backend_busy_with_other_clients_is_flagged(prompt_delta: int, shared: bool) -> None:
    before = Reading(generation_tokens_total=0, prompt_tokens_total=1000)
    after = Reading(generation_tokens_total=30, prompt_tokens_total=1000 + prompt_delta)
    records = [rec(i, **OK) for i in range(3)]  # 3 x 100 prompt tokens sent
    s = summarize(
        _result(records, baseline={"b": before}, final={"b": after}, vllm_sources=("b",)),
        offered_s=3.0,
        deadline_s=None,
    )
    assert s.backend_prompt_tokens == prompt_delta
    assert s.backend_shared is shared
    text = render_markdown([s], workload={}, settings={})
    assert ("another client used it meanwhile" in text) is shared


@pytest.mark.parametrize(
    ("baseline", "final", "sources", "expected"),
    [
        ({"a": Reading(generation_tokens_total=1)}, {"a": Reading(generation_tokens_total=4)}, ("a",), 3.0),
        (
            {"a": Reading(generation_tokens_total=1), "b": Reading(generation_tokens_total=10)},
            {"a": Reading(generation_tokens_total=4), "b": Reading(generation_tokens_total=12)},
            ("a", "b"),
            5.0,
        ),
        ({"a": Reading(generation_tokens_total=1)}, {}, ("a",), None),
        ({"a": Reading()}, {"a": Reading()}, ("a",), None),
        ({}, {}, (), None),
    ],
)
def test_counter_delta(
    baseline: dict[str, Reading],
    final: dict[str, Reading],
    sources: tuple[str, ...],
    expected: float | None,
) -> None:
    assert counter_delta(baseline, final, sources, "generation_tokens_total") == expected


def test_tenant_shares_and_fairness() -> None:
    records = [
        rec(0, tenant="a", **OK),
        rec(1, tenant="a", **OK),
        rec(2, tenant="b", **OK),
        rec(3, tenant="b", status=429, e2e_s=0.01),
    ]
    s = summarize(_result(records), offered_s=4.0, deadline_s=None)
    shares = {t.tenant: t for t in s.tenants}
    assert shares["a"].served_fraction == 1.0
    assert shares["b"].served_fraction == 0.5
    assert shares["a"].service_share == pytest.approx(2 / 3)
    assert shares["b"].demand_share == pytest.approx(0.5)
    assert s.jain_index == pytest.approx(1.5**2 / (2 * 1.25))


def test_compare_gives_ratios_to_the_first_target() -> None:
    a = summarize(_result([rec(0, **OK), rec(1, **OK)]), offered_s=10.0, deadline_s=None)
    b = summarize(_result([rec(0, **OK), rec(1, status=429, e2e_s=0.1)]), offered_s=10.0, deadline_s=None)
    rows = {row.label: row for row in compare([a, b])}
    assert rows["ok"].values == (2.0, 1.0)
    assert rows["ok"].ratios == (1.0, 0.5)
    assert rows["shed (429/503)"].ratios == (None, None)  # 0 in the first target
    assert rows["preemptions"].values == (None, None)
    text = render_markdown([a, b], workload={"requests": 2}, settings={"seed": 0}, plots=["latency_cdf.png"])
    assert "| ok | 2 | 1 (0.50x) |" in text
    assert FORCING_NOTE in text
    assert DEFINITIONS in text
    assert "![latency_cdf.png](latency_cdf.png)" in text


def test_mean_over_rounds() -> None:
    def run(ok: int) -> Any:
        records = [rec(i, **OK) for i in range(ok)] + [rec(9, status=429, e2e_s=0.1)]
        return summarize(_result(records), offered_s=10.0, deadline_s=None)

    rows = {row.label: row for row in mean_over_rounds([[run(2), run(4)], [run(3), run(6)]])}
    assert rows["ok"].means == (3.0, 4.5)
    assert rows["ok"].mins == (2.0, 3.0)
    assert rows["ok"].maxs == (4.0, 6.0)
    assert rows["ok"].ratios == (1.0, 1.5)
    assert rows["preemptions"].means == (None, None)


def test_metrics_reading_from_the_recorded_vllm_scrape() -> None:
    reading = parse_reading((FIXTURES / "vllm" / "metrics_0.32.0.txt").read_text())
    assert reading.is_vllm
    assert reading.kv_usage == 0.0
    assert (reading.running, reading.waiting, reading.busy) == (0.0, 0.0, 0.0)
    assert reading.preemptions_total == 0.0
    assert reading.generation_tokens_total == 170.0
    assert reading.prompt_tokens_total == 4033.0
    assert reading.prompt_tokens_cached_total == 2912.0
    assert reading.queue_depth is None


def test_metrics_reading_sums_labels_and_averages_kv_usage() -> None:
    text = "\n".join(
        [
            "# TYPE kvgate_queue_depth gauge",
            'kvgate_queue_depth{priority="high"} 2',
            'kvgate_queue_depth{priority="low"} 3',
            "# TYPE kvgate_budget_fraction gauge",
            "kvgate_budget_fraction 1.25",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1"} 0.25',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0"} 4',
            'vllm:num_requests_running{engine="1"} 1',
            "# TYPE vllm:num_preemptions counter",
            'vllm:num_preemptions_total{engine="0"} 7',
            'vllm:num_preemptions_created{engine="0"} 1.7e9',
            "# TYPE other_metric gauge",
            "other_metric 9",
        ]
    )
    reading = parse_reading(text)
    assert reading == Reading(
        queue_depth=5, budget_fraction=1.25, kv_usage=0.375, running=5, preemptions_total=7
    )
    assert not reading.is_vllm
    assert reading.busy == 5

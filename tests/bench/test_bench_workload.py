"""Workload parsing, cutting, scaling, clamping, mixing and synthesis (pure)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from bench import workload as wl

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"
AZURE_FULL = SHARED / "AzureLLMInferenceTrace_code.csv"
MOONCAKE_FULL = SHARED / "mooncake_synthetic_trace.jsonl"


def test_azure_rows_become_offsets_and_lengths() -> None:
    work = wl.load_trace(FIXTURES / "azure_code_head.csv")
    assert len(work) == 10
    first, second, *_, last = work.requests
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 4808, 10)
    # 7 fractional digits in the trace: 04.0319600 - 03.9799600
    assert second.arrival_s == pytest.approx(0.052, abs=1e-6)
    assert last.arrival_s == pytest.approx(5.2792970 - 3.9799600, abs=1e-6)
    assert (last.prompt_tokens, last.output_tokens) == (201, 24)
    assert all(r.prefix_blocks == () and r.tenant is None for r in work.requests)


def test_mooncake_rows_keep_hash_ids_and_ms_timestamps() -> None:
    work = wl.load_trace(FIXTURES / "mooncake_sample.jsonl")
    assert len(work) == 7
    assert work.block_tokens == 512
    assert work.requests[0].arrival_s == 0.0
    assert work.requests[1].arrival_s == pytest.approx((2469 - 529) / 1000)
    shared = [r for r in work.requests if r.prefix_blocks[:5] == (708, 709, 710, 711, 712)]
    assert len(shared) == 3
    assert work.requests[3].prompt_tokens == 2752


def test_rows_are_sorted_by_time_and_zero_lengths_cost_one_token() -> None:
    lines = [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-16 18:00:02.5,10,0",
        "2023-11-16 18:00:01,20,5",
    ]
    work = wl.parse_azure_csv(lines)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in work.requests] == [
        (0.0, 20, 5),
        (1.5, 10, 1),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("TIMESTAMP,Context\n2023-11-16 18:00:00,1\n", "expected columns"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", ":2:"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ],
)
def test_bad_azure_files_say_where(text: str, message: str) -> None:
    with pytest.raises(wl.WorkloadError, match=message):
        wl.parse_azure_csv(text.splitlines())


def test_bad_mooncake_line_names_its_number() -> None:
    with pytest.raises(wl.WorkloadError, match=":2:"):
        wl.parse_mooncake_jsonl(
            ['{"timestamp": 0, "input_length": 1, "output_length": 1}', '{"timestamp": 1}']
        )


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.txt"
    path.write_text("x")
    with pytest.raises(wl.WorkloadError, match="unknown trace format"):
        wl.load_trace(path)


def _work(offsets: list[float], prompt: int = 100, output: int = 10) -> wl.Workload:
    return wl.Workload(tuple(wl.RequestSpec(t, prompt, output) for t in offsets))


def test_rescale_rate_sets_the_mean_rate_and_keeps_the_shape() -> None:
    work = _work([0.0, 1.0, 1.5, 4.0])  # 3 gaps over 4 s: 0.75 req/s
    scaled = wl.rescale_rate(work, 3.0)
    assert wl.mean_rate(scaled) == pytest.approx(3.0)
    assert [r.arrival_s for r in scaled.requests] == pytest.approx([0.0, 0.25, 0.375, 1.0])
    assert wl.offered_seconds(scaled) == pytest.approx(4 / 3.0)


def test_rescale_rate_edge_cases() -> None:
    assert wl.rescale_rate(_work([0.0]), 5.0) == _work([0.0])
    with pytest.raises(wl.WorkloadError, match="same instant"):
        wl.rescale_rate(_work([0.0, 0.0]), 5.0)
    with pytest.raises(wl.WorkloadError, match="positive"):
        wl.rescale_rate(_work([0.0, 1.0]), 0.0)
    assert wl.offered_seconds(_work([0.0, 0.0])) == 0.0


def test_take_first() -> None:
    work = _work([0.0, 1.0, 2.0])
    assert len(wl.take_first(work, 2)) == 2
    assert len(wl.take_first(work, 10)) == 3
    with pytest.raises(wl.WorkloadError):
        wl.take_first(work, 0)


@pytest.mark.parametrize(
    ("ctx", "gen", "prompt", "output", "block"),
    [
        (1.0, 1.0, 1469, 13, 512),
        (0.1, 0.5, 147, 6, 51),  # 146.9 -> 147, 6.5 -> 6 (round half to even), 51.2 -> 51
        (0.0001, 0.01, 1, 1, 1),  # never below one token
    ],
)
def test_scale_lengths(ctx: float, gen: float, prompt: int, output: int, block: int) -> None:
    scaled = wl.scale_lengths(_work([0.0], prompt=1469, output=13), ctx, gen)
    assert (scaled.requests[0].prompt_tokens, scaled.requests[0].output_tokens) == (prompt, output)
    assert scaled.block_tokens == block


@pytest.mark.parametrize(
    ("prompt", "output", "max_len", "cap", "expected", "stats"),
    [
        (100, 10, 1024, None, (100, 10), wl.ClampStats()),
        (1000, 100, 1024, None, (924, 100), wl.ClampStats(0, 1, 0, 76)),
        (10, 2000, 1024, None, (1, 1023), wl.ClampStats(1, 1, 977, 9)),
        (100, 500, 1024, 200, (100, 200), wl.ClampStats(1, 0, 300, 0)),
        (5000, 500, None, None, (5000, 500), wl.ClampStats()),
    ],
)
def test_clamp_to_context(
    prompt: int,
    output: int,
    max_len: int | None,
    cap: int | None,
    expected: tuple[int, int],
    stats: wl.ClampStats,
) -> None:
    clamped, got = wl.clamp_to_context(_work([0.0], prompt, output), max_len, cap)
    r = clamped.requests[0]
    assert (r.prompt_tokens, r.output_tokens) == expected
    assert got == stats
    if max_len is not None:
        assert r.prompt_tokens + r.output_tokens <= max_len


def test_parse_shares() -> None:
    assert wl.parse_shares("a:3/b:1/c") == wl.Shares(("a", "b", "c"), (3.0, 1.0, 1.0))
    assert wl.parse_shares("") == wl.Shares()
    for bad in ("a:x", ":1", "a:-1", "a:0/b:0"):
        with pytest.raises(wl.WorkloadError):
            wl.parse_shares(bad)


def test_assign_mix_is_seeded_and_follows_shares() -> None:
    work = _work([float(i) for i in range(4000)])
    tenants, priorities = wl.parse_shares("a:3/b:1"), wl.parse_shares("high:1/low:1")
    mixed = wl.assign_mix(work, tenants, priorities, seed=7)
    assert mixed == wl.assign_mix(work, tenants, priorities, seed=7)
    assert mixed != wl.assign_mix(work, tenants, priorities, seed=8)
    share_a = sum(r.tenant == "a" for r in mixed.requests) / len(mixed)
    share_high = sum(r.priority == "high" for r in mixed.requests) / len(mixed)
    assert share_a == pytest.approx(0.75, abs=0.03)
    assert share_high == pytest.approx(0.5, abs=0.03)


def test_synthetic_spec_string_and_json_file(tmp_path: Path) -> None:
    text = (
        "n=50,rate=4,arrival=gamma:2,prompt=lognormal:200:0.6,output=uniform:10:120,"
        "tenants=a:3/b:1,priorities=high:1/normal:4,prefix=3:64"
    )
    spec = wl.parse_synthetic_spec(text)
    assert (spec.n, spec.rate, spec.arrival_cv) == (50, 4.0, 2.0)
    assert spec.prompt == wl.LengthDist("lognormal", 200, 0.6)
    assert spec.output == wl.LengthDist("uniform", 10, 120)
    assert spec.tenants.names == ("a", "b")
    assert (spec.prefix_groups, spec.prefix_tokens) == (3, 64)
    path = tmp_path / "spec.json"
    path.write_text(
        json.dumps(
            {
                "n": 50,
                "rate": 4,
                "arrival": "gamma:2",
                "prompt": "lognormal:200:0.6",
                "output": "uniform:10:120",
                "tenants": "a:3/b:1",
                "priorities": "high:1/normal:4",
                "prefix": "3:64",
            }
        )
    )
    assert wl.parse_synthetic_spec(str(path)) == spec


@pytest.mark.parametrize(
    "text",
    [
        "n=0",
        "rate=-1",
        "speed=3",
        "arrival=weird",
        "prompt=uniform:5:1",
        "output=exp",
        "nokey",
        "prefix=2:0",
        "prompt=lognormal:x:1",
    ],
)
def test_bad_synthetic_specs(text: str) -> None:
    with pytest.raises(wl.WorkloadError):
        wl.parse_synthetic_spec(text)


@pytest.mark.parametrize(("arrival", "cv"), [("poisson", 1.0), ("gamma:3", 3.0)])
def test_synthetic_arrivals_have_the_asked_rate_and_burstiness(arrival: str, cv: float) -> None:
    spec = wl.parse_synthetic_spec(f"n=20000,rate=5,arrival={arrival}")
    work = wl.generate_synthetic(spec, seed=1)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(work.requests)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.1)


def test_synthetic_is_seeded_and_lengths_follow_distributions() -> None:
    spec = wl.parse_synthetic_spec(
        "n=3000,prompt=uniform:10:20,output=lognormal:50:0.5,tenants=x:1/y:1,prefix=4:32"
    )
    work = wl.generate_synthetic(spec, seed=3)
    assert work == wl.generate_synthetic(spec, seed=3)
    assert work != wl.generate_synthetic(spec, seed=4)
    prompts = [r.prompt_tokens for r in work.requests]
    # prefix tokens come on top of the drawn prompt length
    assert min(prompts) == 10 + 32
    assert max(prompts) == 20 + 32
    assert statistics.median(r.output_tokens for r in work.requests) == pytest.approx(50, rel=0.1)
    assert len({r.prefix_blocks for r in work.requests}) == 4
    assert work.block_tokens == 32
    assert {r.tenant for r in work.requests} == {"x", "y"}


@pytest.mark.skipif(not AZURE_FULL.exists(), reason="shared Azure trace not present")
def test_full_azure_trace_matches_its_published_figures() -> None:
    work = wl.load_trace(AZURE_FULL)
    assert len(work) == 8819
    prompts = sorted(r.prompt_tokens for r in work.requests)
    outputs = sorted(r.output_tokens for r in work.requests)
    assert statistics.median(prompts) == 1469
    assert statistics.median(outputs) == 13
    # first row 18:17:03.9799600, last 19:14:19.9280160
    assert work.requests[-1].arrival_s == pytest.approx(3435.948056, abs=1e-5)
    scaled = wl.scale_lengths(wl.rescale_rate(wl.take_first(work, 500), 2.0), 0.1, 1.0)
    assert wl.mean_rate(scaled) == pytest.approx(2.0)
    assert max(r.prompt_tokens for r in scaled.requests) <= math.ceil(max(prompts) * 0.1)


@pytest.mark.skipif(not MOONCAKE_FULL.exists(), reason="shared Mooncake trace not present")
def test_full_mooncake_trace_blocks_cover_the_prompts() -> None:
    work = wl.load_trace(MOONCAKE_FULL)
    assert len(work) == 3993
    for r in work.requests:
        assert len(r.prefix_blocks) == math.ceil(r.prompt_tokens / 512)

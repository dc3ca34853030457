"""vLLM /metrics -> BackendReading: golden fixtures from the real testbed, then variants."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.budget import parse_metrics_text
from gateway.vllm_metrics import MetricSample, MetricsFormatError, read_backend

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm"

CACHE_CONFIG_0_32 = (
    'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",'
    'kv_cache_size_tokens="2048",num_gpu_blocks="64",num_cpu_blocks="None"} 1.0'
)


def test_idle_testbed_fixture() -> None:
    reading = parse_metrics_text((FIXTURES / "metrics_0.32.0.txt").read_text())
    # 64 blocks of 32 tokens (2,048 tokens) minus vLLM V1's null block.
    assert reading.total_blocks == 63
    assert reading.block_size == 32
    assert reading.used_blocks == 0.0
    assert (reading.running, reading.waiting) == (0, 0)
    assert reading.preemptions_total == 0.0
    assert reading.engines == 1
    assert reading.prefix_caching is True


def test_busy_testbed_fixture() -> None:
    # Recorded with six 150-token prompts generating 300 tokens each on the testbed.
    reading = parse_metrics_text((FIXTURES / "metrics_0.32.0_busy.txt").read_text())
    assert reading.total_blocks == 63
    assert reading.used_blocks == pytest.approx(34.0)
    assert reading.running == 6
    assert reading.preemptions_total == 1.0


def _text(*lines: str) -> str:
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "total", "used", "running", "waiting", "preemptions"),
    [
        pytest.param(
            _text(
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
                "# TYPE vllm:cache_config_info gauge",
                CACHE_CONFIG_0_32,
                "# TYPE vllm:num_requests_running gauge",
                'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
                "# TYPE vllm:num_requests_waiting gauge",
                'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
                "# TYPE vllm:num_preemptions counter",
                'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0',
            ),
            63,
            31.5,
            3,
            2,
            7.0,
            id="current-names",
        ),
        pytest.param(
            _text(
                # vLLM V0: older gauge name, no kv_cache_size_tokens, no null block, no engine.
                "# TYPE vllm:gpu_cache_usage_perc gauge",
                'vllm:gpu_cache_usage_perc{model_name="m"} 0.25',
                "# TYPE vllm:cache_config_info gauge",
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0',
                "# TYPE vllm:num_preemptions counter",
                'vllm:num_preemptions_total{model_name="m"} 4.0',
            ),
            1000,
            250.0,
            0,
            0,
            4.0,
            id="v0-names",
        ),
        pytest.param(
            _text(
                # Data parallel: two engines, pools and usages summed.
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
                'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0',
                "# TYPE vllm:cache_config_info gauge",
                CACHE_CONFIG_0_32,
                CACHE_CONFIG_0_32.replace('engine="0"', 'engine="1"'),
                "# TYPE vllm:num_requests_running gauge",
                'vllm:num_requests_running{engine="0",model_name="m"} 1.0',
                'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
                "# TYPE vllm:num_preemptions counter",
                'vllm:num_preemptions_total{engine="0",model_name="m"} 1.0',
                'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0',
            ),
            126,
            31.5,
            3,
            0,
            3.0,
            id="data-parallel",
        ),
        pytest.param(
            _text(
                # Both gauge names present (a transition release): the newer wins.
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
                "# TYPE vllm:gpu_cache_usage_perc gauge",
                'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9',
                "# TYPE vllm:cache_config_info gauge",
                CACHE_CONFIG_0_32,
            ),
            63,
            31.5,
            0,
            0,
            None,
            id="newest-name-wins",
        ),
        pytest.param(
            _text(
                # kv_cache_size_tokens preferred over num_gpu_blocks * block_size.
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0"} 1.0',
                "# TYPE vllm:cache_config_info gauge",
                'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="1600",num_gpu_blocks="999"} 1.0',
            ),
            99,
            99.0,
            0,
            0,
            None,
            id="size-tokens-preferred",
        ),
    ],
)
def test_variants(
    text: str, total: int, used: float, running: int, waiting: int, preemptions: float | None
) -> None:
    reading = parse_metrics_text(text)
    assert reading.total_blocks == total
    assert reading.used_blocks == pytest.approx(used)
    assert (reading.running, reading.waiting) == (running, waiting)
    assert reading.preemptions_total == preemptions


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", "cache_config_info", id="empty"),
        pytest.param(_text('vllm:kv_cache_usage_perc{engine="0"} 0.1'), "cache_config_info", id="no-config"),
        pytest.param(_text(CACHE_CONFIG_0_32), "usage", id="no-usage"),
        pytest.param(
            _text(
                'vllm:cache_config_info{engine="0",block_size="None"} 1.0',
                'vllm:kv_cache_usage_perc{engine="0"} 0',
            ),
            "block_size",
            id="no-block-size",
        ),
        pytest.param(
            _text(
                CACHE_CONFIG_0_32,
                CACHE_CONFIG_0_32.replace('engine="0"', 'engine="1"').replace(
                    'block_size="32"', 'block_size="16"'
                ),
                'vllm:kv_cache_usage_perc{engine="0"} 0',
                'vllm:kv_cache_usage_perc{engine="1"} 0',
            ),
            "block size",
            id="block-sizes-disagree",
        ),
        pytest.param(_text("vllm:kv_cache_usage_perc{engine=0} 0.1 junk"), "malformed", id="unparsable"),
        pytest.param(
            _text(CACHE_CONFIG_0_32, 'vllm:kv_cache_usage_perc{engine="0"} NaN'), "impossible", id="nan"
        ),
    ],
)
def test_refusals(text: str, message: str) -> None:
    with pytest.raises(MetricsFormatError, match=message):
        parse_metrics_text(text)


def test_pure_core_reads_parsed_samples() -> None:
    samples = [
        MetricSample("vllm:cache_config_info", {"block_size": "32", "num_gpu_blocks": "11"}, 1.0),
        MetricSample("vllm:kv_cache_usage_perc", {}, 0.2),
        MetricSample("vllm:num_requests_waiting", {"engine": "0"}, 4.0),
        MetricSample("vllm:something_else", {}, 123.0),
    ]
    reading = read_backend(samples)
    assert reading.total_blocks == 10
    assert reading.used_blocks == pytest.approx(2.0)
    assert reading.waiting == 4


def test_usage_rounding_noise_never_exceeds_the_pool() -> None:
    reading = read_backend(
        [
            MetricSample("vllm:cache_config_info", {"block_size": "32", "num_gpu_blocks": "11"}, 1.0),
            MetricSample("vllm:kv_cache_usage_perc", {}, 1.0000000002),
        ]
    )
    assert reading.used_blocks == reading.total_blocks


def test_output_length_histogram_of_the_busy_fixture() -> None:
    reading = parse_metrics_text((FIXTURES / "metrics_0.32.0_busy.txt").read_text())
    buckets = dict(reading.output_length_buckets)
    assert (buckets[1.0], buckets[50.0], buckets[float("inf")]) == (235.0, 303.0, 311.0)
    assert [bound for bound, _ in reading.output_length_buckets] == sorted(buckets)


def _histogram(engine: str, *counts: tuple[str, float]) -> list[str]:
    return [
        f'vllm:request_generation_tokens_bucket{{engine="{engine}",le="{bound}",model_name="m"}} {count}'
        for bound, count in counts
    ]


POOL = ['vllm:kv_cache_usage_perc{engine="0"} 0.1', CACHE_CONFIG_0_32]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        pytest.param(
            _histogram("0", ("10.0", 3), ("100.0", 5), ("+Inf", 6))
            + _histogram("1", ("10.0", 1), ("100.0", 1), ("+Inf", 2)),
            ((10.0, 4.0), (100.0, 6.0), (float("inf"), 8.0)),
            id="engines-summed",
        ),
        pytest.param(_histogram("0", ("10.0", 3), ("100.0", 5)), (), id="no-inf-bucket"),
        pytest.param(_histogram("0", ("10.0", 3), ("100.0", 2), ("+Inf", 6)), (), id="counts-fall"),
        pytest.param(_histogram("0", ("ten", 3), ("+Inf", 6)), (), id="bound-not-a-number"),
        pytest.param(_histogram("0", ("10.0", "NaN"), ("+Inf", 6)), (), id="count-not-a-number"),
        pytest.param([], (), id="not-exported"),
    ],
)
def test_output_length_histogram_variants(
    lines: list[str], expected: tuple[tuple[float, float], ...]
) -> None:
    # A doubtful histogram is dropped; the pool it comes with is still read.
    reading = parse_metrics_text(_text(*POOL, *lines))
    assert reading.output_length_buckets == expected
    assert reading.total_blocks == 63

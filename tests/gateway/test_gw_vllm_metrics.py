"""vLLM /metrics -> BackendReading: golden fixtures from the real testbed, then variants."""

from __future__ import annotations

import math
import random
import re
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.budget import MAX_METRICS_BODY_BYTES, MAX_METRICS_KEPT_BYTES, MetricsBody, parse_metrics_text
from gateway.vllm_metrics import (
    MAX_BLOCK_SIZE_TOKENS,
    MAX_COUNTER,
    MAX_ENGINE_BLOCKS,
    METRIC_NAMES,
    BackendReading,
    MetricSample,
    MetricsFormatError,
    VllmMetric,
    read_backend,
)

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


# -- absurd values: refused as malformed, naming what is wrong, or clamped ------------------

USAGE = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5'


def _config(**labels: str) -> str:
    fields = {"block_size": "32", "engine": "0", "kv_cache_size_tokens": "2048", "num_gpu_blocks": "64"}
    fields.update(labels)
    return "vllm:cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in fields.items()) + "} 1.0"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        pytest.param(
            [_config(num_gpu_blocks="1e308"), USAGE], "num_gpu_blocks is out of range", id="blocks-1e308"
        ),
        pytest.param(
            [_config(num_gpu_blocks=str(2**70)), USAGE], "num_gpu_blocks is out of range", id="blocks-2**70"
        ),
        pytest.param(
            [_config(num_gpu_blocks="inf"), USAGE], "num_gpu_blocks is not a whole", id="blocks-inf"
        ),
        pytest.param(
            [_config(num_gpu_blocks="NaN"), USAGE], "num_gpu_blocks is not a whole", id="blocks-nan"
        ),
        pytest.param(
            [_config(num_gpu_blocks="-64"), USAGE], "num_gpu_blocks is out of range", id="blocks-negative"
        ),
        pytest.param([_config(num_gpu_blocks="0"), USAGE], "num_gpu_blocks is out of range", id="blocks-0"),
        pytest.param(
            [_config(num_gpu_blocks="63.5"), USAGE], "num_gpu_blocks is not a whole", id="blocks-63.5"
        ),
        pytest.param(
            [_config(num_gpu_blocks="many"), USAGE], "num_gpu_blocks is not a number", id="blocks-word"
        ),
        pytest.param(
            [_config(kv_cache_size_tokens="1e400"), USAGE],
            "kv_cache_size_tokens is not a whole",
            id="tokens-1e400",
        ),
        pytest.param(
            [_config(kv_cache_size_tokens="9" * 30), USAGE],
            "kv_cache_size_tokens is out of range",
            id="tokens-huge",
        ),
        pytest.param([_config(block_size="0"), USAGE], "block_size is out of range", id="block-size-0"),
        pytest.param(
            [_config(block_size="-32"), USAGE], "block_size is out of range", id="block-size-negative"
        ),
        pytest.param([_config(block_size="1e9"), USAGE], "block_size is out of range", id="block-size-1e9"),
        pytest.param([_config(block_size="32.5"), USAGE], "block_size is not a whole", id="block-size-32.5"),
        pytest.param([_config(block_size="inf"), USAGE], "block_size is not a whole", id="block-size-inf"),
        pytest.param(
            [_config(), 'vllm:kv_cache_usage_perc{engine="0"} 1.5'], "kv_cache_usage_perc", id="usage-1.5"
        ),
        pytest.param(
            [_config(), 'vllm:kv_cache_usage_perc{engine="0"} -0.1'], "kv_cache_usage_perc", id="usage-neg"
        ),
        pytest.param(
            [_config(), 'vllm:kv_cache_usage_perc{engine="0"} +Inf'], "kv_cache_usage_perc", id="usage-inf"
        ),
        pytest.param(
            [_config(), USAGE, 'vllm:num_requests_running{engine="0"} 1e308'],
            "num_requests_running",
            id="running-1e308",
        ),
        pytest.param(
            [_config(), USAGE, 'vllm:num_requests_running{engine="0"} -1'],
            "num_requests_running",
            id="running-neg",
        ),
        pytest.param(
            [_config(), USAGE, 'vllm:num_requests_waiting{engine="0"} +Inf'],
            "num_requests_waiting",
            id="waiting-inf",
        ),
        pytest.param(
            [_config(), USAGE, 'vllm:num_preemptions_total{engine="0"} 1e300'],
            "num_preemptions",
            id="preempt-huge",
        ),
        pytest.param(
            [_config(), USAGE, 'vllm:num_preemptions_total{engine="0"} -3'],
            "num_preemptions",
            id="preempt-negative",
        ),
        pytest.param(
            [_config(), USAGE, 'vllm:iteration_tokens_total_count{engine="0"} +Inf'],
            "iteration_tokens",
            id="steps-inf",
        ),
        pytest.param(
            [_config(engine="x" * 5000), USAGE.replace('"0"', '"' + "x" * 5000 + '"')],
            "label 'engine' of 5000 characters",
            id="label-5000-chars",
        ),
        pytest.param(
            [_config(model_name="m" * (1 << 20)), USAGE],
            "a line of vllm:cache_config_info is longer than 16384 bytes",
            id="label-of-a-megabyte",
        ),
    ],
)
def test_absurd_values_are_refused_naming_the_metric(lines: list[str], message: str) -> None:
    with pytest.raises(MetricsFormatError, match=re.escape(message)):
        parse_metrics_text(_text(*lines))


def test_two_engines_whose_counters_overflow_together_are_refused_not_summed_to_inf() -> None:
    # Each within a float, their sum is not: every series is bounded before it is added.
    lines = [_config(), USAGE, 'vllm:num_requests_waiting{engine="0"} 1.7e308']
    lines += [
        _config(engine="1"),
        USAGE.replace('"0"', '"1"'),
        'vllm:num_requests_waiting{engine="1"} 1.7e308',
    ]
    with pytest.raises(MetricsFormatError, match="num_requests_waiting"):
        parse_metrics_text(_text(*lines))


def test_token_capacity_beyond_the_blocks_is_clamped_to_the_pool() -> None:
    # vLLM derives kv_cache_size_tokens from the maximum concurrency, which can exceed what
    # num_gpu_blocks blocks hold (sliding-window and Mamba layers); the pool has 64 blocks.
    reading = parse_metrics_text(_text(_config(kv_cache_size_tokens="1000000"), USAGE))
    assert reading.total_blocks == 63
    assert reading.used_blocks == pytest.approx(31.5)


def test_whole_numbers_written_as_floats_are_read() -> None:
    reading = parse_metrics_text(_text(_config(block_size="32.0", kv_cache_size_tokens="2048.0"), USAGE))
    assert (reading.total_blocks, reading.block_size) == (63, 32)


@pytest.mark.parametrize(
    "lines",
    [
        pytest.param(_histogram("0", ("-5.0", 3), ("+Inf", 6)), id="negative-bound"),
        pytest.param(_histogram("0", ("1e300", 3), ("+Inf", 6)), id="absurd-bound"),
        pytest.param(_histogram("0", ("10.0", 3), ("+Inf", 1e300)), id="absurd-count"),
        pytest.param(_histogram("0", ("10.0", 3), ("+Inf", "+Inf")), id="infinite-count"),
        pytest.param(
            _histogram("0", ("10.0", 1), ("+Inf", 8e15)) + _histogram("1", ("10.0", 1), ("+Inf", 8e15)),
            id="counts-summed-past-2**53",
        ),
    ],
)
def test_an_absurd_output_length_histogram_is_dropped(lines: list[str]) -> None:
    reading = parse_metrics_text(_text(*POOL, *lines))
    assert reading.output_length_buckets == ()
    assert reading.total_blocks == 63


# -- the body: read chunk by chunk, within bounds ---------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 1000, 65536, 1 << 30])
def test_the_reading_does_not_depend_on_how_the_body_arrives(chunk: int) -> None:
    raw = (FIXTURES / "metrics_0.32.0_busy.txt").read_bytes()
    body = MetricsBody()
    for offset in range(0, len(raw), chunk):
        body.feed(raw[offset : offset + chunk])
    assert body.reading() == parse_metrics_text(raw.decode())
    assert body.reading().digest == float(zlib.crc32(raw))


def test_a_body_past_the_size_bound_is_refused_as_it_arrives() -> None:
    body = MetricsBody(max_bytes=1000)
    body.feed(b"#" * 999 + b"\n")
    with pytest.raises(MetricsFormatError, match="larger than 1000 bytes"):
        body.feed(b"x")


def test_long_lines_kvgate_does_not_read_are_skipped_unread() -> None:
    # A megabyte of a metric kvgate ignores, in one line, arriving in pieces: nothing kept.
    raw = _text(*POOL, 'vllm:other{x="' + "y" * (1 << 20) + '"} 1', 'vllm:num_requests_running{engine="0"} 2')
    body = MetricsBody()
    for offset in range(0, len(raw), 4096):
        body.feed(raw[offset : offset + 4096].encode())
    assert body.kept_bytes < 1000
    reading = body.reading()
    assert (reading.total_blocks, reading.running) == (63, 2)


def test_the_lines_kvgate_reads_are_bounded_together() -> None:
    line = 'vllm:num_requests_running{engine="0",model_name="m"} 1'
    with pytest.raises(MetricsFormatError, match="exceed 1048576 bytes"):
        parse_metrics_text(_text(*POOL, *[line] * ((1 << 20) // len(line) + 1)))


def test_a_kept_line_that_is_not_utf8_is_refused() -> None:
    body = MetricsBody()
    body.feed(_text(*POOL).encode() + b'vllm:num_requests_running{engine="\xff\xfe"} 1\n')
    with pytest.raises(MetricsFormatError, match="not UTF-8"):
        body.reading()


def test_binary_garbage_is_refused_as_malformed() -> None:
    body = MetricsBody()
    body.feed(random.Random(3).randbytes(1 << 20))
    with pytest.raises(MetricsFormatError):
        body.reading()


# -- properties: a sane reading or MetricsFormatError, nothing else ---------------------------

_NUMBERS = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 16, 32, 64, 2048, 2**32, 2**53, 2**70]),
)


def _mostly(plausible: st.SearchStrategy[Any], absurd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`plausible` nine times in ten: a scrape is read only when every value in it is sane."""
    return st.integers(0, 9).flatmap(lambda roll: absurd if roll == 0 else plausible)


_PLAUSIBLE = st.sampled_from(["16", "32", "64", "1000", "2048", "2048.0"])
_LABEL_VALUES = _mostly(
    _PLAUSIBLE,
    st.one_of(
        _NUMBERS.map(str),
        st.sampled_from(["None", "", "nan", "inf", "-inf", "1e308", "32.5", "0x20", " 32 ", "True"]),
        st.text(max_size=12),
    ),
)
_LABELS = st.dictionaries(
    st.sampled_from(
        ["block_size", "num_gpu_blocks", "kv_cache_size_tokens", "engine", "le", "enable_prefix_caching"]
    ),
    _LABEL_VALUES,
    max_size=6,
)
_NAMES = st.sampled_from(
    [name for names in METRIC_NAMES.values() for name in names if name != "vllm:cache_config_info"]
    + ["vllm:other", "process_cpu_seconds_total"]
)
_PLAUSIBLE_VALUES = st.one_of(st.floats(0.0, 1.0), st.integers(0, 100).map(float))
_VALUES = _mostly(_PLAUSIBLE_VALUES, _NUMBERS.map(float))
_SAMPLE = st.builds(MetricSample, _NAMES, _LABELS, _VALUES)
_ENGINES = st.sampled_from(["0", "1"])
_USAGE = st.builds(
    MetricSample,
    st.sampled_from(METRIC_NAMES[VllmMetric.KV_CACHE_USAGE]),
    st.fixed_dictionaries({}, optional={"engine": _ENGINES}),
    _mostly(st.floats(0.0, 1.0), _NUMBERS.map(float)),
)
_CONFIGS = st.builds(
    MetricSample,
    st.just("vllm:cache_config_info"),
    st.fixed_dictionaries(
        {"block_size": _LABEL_VALUES, "num_gpu_blocks": _LABEL_VALUES},
        optional={"kv_cache_size_tokens": _LABEL_VALUES, "engine": _ENGINES},
    ),
    st.just(1.0),
)


def _sane(reading: BackendReading) -> None:
    assert 1 <= reading.total_blocks <= reading.engines * MAX_ENGINE_BLOCKS
    assert 1 <= reading.block_size <= MAX_BLOCK_SIZE_TOKENS
    assert 0.0 <= reading.used_blocks <= reading.total_blocks
    assert 0.0 <= reading.usage <= 1.0
    assert reading.running >= 0
    assert reading.waiting >= 0
    for counter in (reading.preemptions_total, reading.engine_steps_total):
        assert counter is None or 0.0 <= counter < math.inf
    assert all(bound >= 0.0 and 0.0 <= count <= MAX_COUNTER for bound, count in reading.output_length_buckets)


@given(
    st.tuples(st.lists(_CONFIGS, max_size=2), st.lists(_USAGE, max_size=2), st.lists(_SAMPLE, max_size=6))
    .map(lambda parts: [sample for part in parts for sample in part])
    .flatmap(st.permutations)
)
@settings(max_examples=400)
def test_any_samples_give_a_sane_reading_or_a_format_error(samples: list[MetricSample]) -> None:
    try:
        reading = read_backend(samples)
    except MetricsFormatError:
        return
    _sane(reading)


_REAL_LINES = (FIXTURES / "metrics_0.32.0_busy.txt").read_text().splitlines()
_READ_LINES = [
    line for line in _REAL_LINES if line.startswith(("vllm:cache_config", "vllm:kv_cache", "vllm:num_"))
]


@st.composite
def _mangled_line(draw: st.DrawFn) -> str:
    """A line kvgate reads with its value, or one of its label values, replaced."""
    line = draw(st.sampled_from(_READ_LINES))
    value = draw(_LABEL_VALUES)
    labels = list(re.finditer(r'="([^"]*)"', line))
    if labels and draw(st.booleans()):
        match = draw(st.sampled_from(labels))
        return line[: match.start(1)] + value.replace('"', "") + line[match.end(1) :]
    return line.rsplit(" ", 1)[0] + " " + value


@given(
    st.lists(
        st.tuples(
            st.integers(0, len(_REAL_LINES)),
            st.one_of(_mangled_line(), st.binary(max_size=40).map(lambda raw: raw.decode("latin-1"))),
        ),
        max_size=8,
    )
)
def test_any_text_gives_a_sane_reading_or_a_format_error(changes: list[tuple[int, str]]) -> None:
    """The busy fixture with lines it reads mangled and garbage lines put in anywhere."""
    lines = list(_REAL_LINES)
    for index, line in changes:
        lines.insert(index, line)
    try:
        reading = parse_metrics_text("\n".join(lines) + "\n")
    except MetricsFormatError:
        return
    _sane(reading)


# -- the real testbed ------------------------------------------------------------------------


@pytest.mark.vllm
def test_the_real_testbeds_metrics_are_read_unchanged(vllm_url: str) -> None:
    raw = httpx.get(f"{vllm_url}/metrics", timeout=10).content
    reading = parse_metrics_text(raw.decode())
    assert (reading.total_blocks, reading.block_size, reading.engines) == (63, 32, 1)
    assert 0.0 <= reading.used_blocks <= 63
    assert reading.preemptions_total is not None
    assert reading.engine_steps_total is not None
    assert reading.digest == float(zlib.crc32(raw))
    # Read as the poller reads it, in network-sized pieces, the body gives the same reading.
    body = MetricsBody()
    for offset in range(0, len(raw), 1500):
        body.feed(raw[offset : offset + 1500])
    assert body.reading() == reading
    assert len(raw) < MAX_METRICS_BODY_BYTES // 100
    assert body.kept_bytes < MAX_METRICS_KEPT_BYTES // 100


def test_waiting_for_capacity_is_told_apart_from_deferred_waiting() -> None:
    # The real testbed says why its requests wait (both reasons exported, at 0 when idle).
    assert parse_metrics_text((FIXTURES / "metrics_0.32.0.txt").read_text()).waiting_for_capacity == 0
    base = [
        CACHE_CONFIG_0_32,
        'vllm:kv_cache_usage_perc{engine="0"} 0.5',
        'vllm:num_requests_waiting{engine="0"} 3.0',
    ]
    deferred = parse_metrics_text(
        _text(
            *base,
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 0.0',
            'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 3.0',
        )
    )
    assert (deferred.waiting, deferred.waiting_for_capacity, deferred.saturated_waiting) == (3, 0, 0)
    full = parse_metrics_text(
        _text(*base, 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 3.0')
    )
    assert full.saturated_waiting == 3
    # An older vLLM does not say why: every waiting request counts as held back for room.
    older = parse_metrics_text(_text(*base))
    assert (older.waiting_for_capacity, older.saturated_waiting) == (None, 3)

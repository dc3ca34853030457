"""/metrics pinned against the testbed's recording: same families, types, labels, buckets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.engine import EngineConfig
from sim.metrics import cache_config_labels, request_token_buckets
from sim.testing import SimServer

GOLDEN = "vllm/metrics_0.32.0.txt"
# The families kvgate's gateway and bench read.
USED_BY_KVGATE = (
    "vllm:cache_config_info",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
)


@dataclass(frozen=True)
class FamilyShape:
    type: str
    sample_names: frozenset[str]
    label_names: frozenset[frozenset[str]]
    buckets: tuple[float, ...]


def shapes(text: str) -> dict[str, FamilyShape]:
    result: dict[str, FamilyShape] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        buckets = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        result[family.name] = FamilyShape(
            type=family.type,
            sample_names=frozenset(s.name for s in family.samples),
            label_names=frozenset(frozenset(k for k in s.labels if k != "le") for s in family.samples),
            buckets=tuple(buckets),
        )
    return result


@pytest.fixture(scope="module")
def golden(fixtures_dir: Path) -> str:
    return (fixtures_dir / GOLDEN).read_text()


def test_every_vllm_family_of_the_recording_has_the_same_shape(sim: SimServer, golden: str) -> None:
    # Traffic first, so histograms and labelled series exist on both sides.
    httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1] * 40, "max_tokens": 5})
    expected = shapes(golden)
    actual = shapes(httpx.get(f"{sim.url}/metrics").text)
    assert set(expected) <= set(actual), sorted(set(expected) - set(actual))
    for name, shape in expected.items():
        assert actual[name].type == shape.type, name
        assert actual[name].label_names == shape.label_names, name
        if shape.buckets:
            assert actual[name].buckets == shape.buckets, name
        # The recording is of an idle server: it has every series, just zero-valued.
        assert shape.sample_names <= actual[name].sample_names, name


def test_families_kvgate_reads_are_in_the_recording(golden: str) -> None:
    recorded = shapes(golden)
    for name in USED_BY_KVGATE:
        assert name in recorded, name


def test_cache_config_info_matches_the_testbed_for_its_pool(golden: str) -> None:
    (recorded,) = [
        s
        for family in text_string_to_metric_families(golden)
        if family.name == "vllm:cache_config_info"
        for s in family.samples
    ]
    assert cache_config_labels(EngineConfig()) == recorded.labels
    assert recorded.value == 1.0


def test_token_buckets_follow_vllms_one_two_five_series() -> None:
    assert request_token_buckets(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert request_token_buckets(8192)[-1] == 5000


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


def test_metric_values_follow_the_engine(sim: SimServer) -> None:
    before = httpx.get(f"{sim.url}/metrics").text
    assert sample(before, "vllm:generation_tokens_total") == 0
    assert sample(before, "vllm:kv_cache_usage_perc") == 0
    for _ in range(2):
        httpx.post(f"{sim.url}/v1/completions", json={"prompt": [9] * 50, "max_tokens": 7})
    after = httpx.get(f"{sim.url}/metrics").text
    assert sample(after, "vllm:generation_tokens_total") == 14
    assert sample(after, "vllm:prompt_tokens_total") == 100
    # The second identical prompt reused the first one's single full block (32 tokens).
    assert sample(after, "vllm:prefix_cache_hits_total") == 32
    assert sample(after, "vllm:request_success_total", finished_reason="length") == 2
    assert sample(after, "vllm:e2e_request_latency_seconds_count") == 2
    assert sample(after, "vllm:time_to_first_token_seconds_count") == 2
    assert sample(after, "vllm:inter_token_latency_seconds_count") == 12
    assert sample(after, "vllm:request_generation_tokens_sum") == 14
    assert sample(after, "vllm:request_params_n_count") == 2
    assert sample(after, "vllm:num_requests_running") == 0
    assert sample(after, "vllm:num_preemptions_total") == 0

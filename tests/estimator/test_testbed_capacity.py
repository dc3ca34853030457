"""`kvgate estimate` agrees with what the real vLLM reports about its own KV pool."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import main as kvgate

# The testbed's flags (tests/testbed/testbed.py): 1 GiB of KV space, 32-token blocks, 64 blocks.
TESTBED_FLAGS = ["--block-size", "32", "--max-model-len", "1024", "--dtype", "bfloat16"]


def _estimate(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert kvgate(["estimate", *args, "--json"]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def _cache_config(metrics_text: str) -> dict[str, str]:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no vllm:cache_config_info in /metrics")


@pytest.mark.vllm
def test_live_cache_config_matches_estimate(
    vllm_url: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labels = _cache_config(httpx.get(f"{vllm_url}/metrics", timeout=10).text)
    result = _estimate(
        capsys, str(tiny_model_dir), *TESTBED_FLAGS, "--num-gpu-blocks-override", labels["num_gpu_blocks"]
    )
    assert result["block_size"] == int(labels["block_size"])
    assert result["num_blocks"] == int(labels["num_gpu_blocks"])
    assert result["kv_cache_tokens"] == int(labels["kv_cache_size_tokens"])
    assert result["max_concurrency"] == pytest.approx(float(labels["kv_cache_max_concurrency"]))
    # Before the override, vLLM sized the pool from its KV memory: the same bytes per block.
    kv_memory = int(labels["kv_cache_memory_bytes"])
    unoverridden = _estimate(
        capsys,
        str(tiny_model_dir),
        *TESTBED_FLAGS,
        "--gpu-memory-gib",
        str(kv_memory / 2**30),
        "--gpu-memory-utilization",
        "1",
        "--weights-gib",
        "0",
    )
    assert unoverridden["num_blocks"] == kv_memory // int(str(result["bytes_per_block"]))


def test_recorded_startup_log_matches_estimate(
    fixtures_dir: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = (fixtures_dir / "vllm" / "startup_tiny_llama_0.32.0.log").read_text()
    memory_gib = float(re.search(r"Explicitly set \(([\d.]+)/", log).group(1))  # type: ignore[union-attr]
    blocks_before = int(re.search(r"num_gpu_blocks=(\d+)", log).group(1))  # type: ignore[union-attr]
    blocks_after = int(re.search(r"num_gpu_blocks_override=(\d+)", log).group(1))  # type: ignore[union-attr]
    tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))  # type: ignore[union-attr]
    concurrency = float(re.search(r"concurrency for [\d,]+ tokens per request: ([\d.]+)x", log).group(1))  # type: ignore[union-attr]

    sized = _estimate(
        capsys,
        str(tiny_model_dir),
        *TESTBED_FLAGS,
        "--gpu-memory-gib",
        str(memory_gib),
        "--gpu-memory-utilization",
        "1",
        "--weights-gib",
        "0",
    )
    assert sized["num_blocks"] == blocks_before
    overridden = _estimate(
        capsys, str(tiny_model_dir), *TESTBED_FLAGS, "--num-gpu-blocks-override", str(blocks_after)
    )
    assert overridden["kv_cache_tokens"] == tokens
    assert overridden["max_concurrency"] == pytest.approx(concurrency)

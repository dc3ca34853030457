"""Parallel samples on a real vLLM whose prefix cache is off: each holds its own prompt blocks.

kvgate reads `enable_prefix_caching` from vLLM's `vllm:cache_config_info` and then counts no
shared prompt block, whereas on the usual testbed (prefix caching on) the samples of one prompt
share its full blocks. The engine is started for this module unless
KVGATE_TEST_VLLM_NO_PREFIX_CACHE_URL names one (about 100 s to start).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import testbed
from conftest import Served, ledger_is_empty, served_gateway

pytestmark = pytest.mark.vllm

URL_ENV = "KVGATE_TEST_VLLM_NO_PREFIX_CACHE_URL"
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def uncached_vllm_url(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    port = int(os.environ.get("KVGATE_TEST_VLLM_NO_PREFIX_CACHE_PORT", "8023"))
    log_dir = tmp_path_factory.mktemp("vllm-no-prefix-cache")
    with testbed.serving(URL_ENV, log_dir, ["--no-enable-prefix-caching"], port) as url:
        yield url


@pytest.fixture(scope="module")
def kvgate(uncached_vllm_url: str) -> Iterator[Served]:
    with served_gateway(
        uncached_vllm_url, discover_tokenizer=True, metrics_poll_interval_s=0.1, output_backend_prior=False
    ) as served:
        yield served


def test_without_prefix_caching_every_sample_reserves_its_own_prompt(kvgate: Served) -> None:
    reading = kvgate.call(lambda: kvgate.gateway.budget.reading)
    assert reading is not None
    assert reading.prefix_caching is False
    prompt, cap, n = 100, 20, 3
    body = {
        "model": "tiny-llama",
        "prompt": [5] * prompt,
        "max_tokens": cap,
        "ignore_eos": True,
        "n": n,
        "temperature": 1.0,
    }
    answer = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, n * cap)
    # Three sequences of 120 tokens, 4 blocks each, none shared (with the cache on: 3 shared
    # + 3 x 1 = 6).
    assert int(answer.headers["x-kvgate-blocks"]) == n * math.ceil((prompt + cap) / BLOCK_SIZE) == 12
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")

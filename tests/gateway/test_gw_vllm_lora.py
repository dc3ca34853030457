"""kvgate in front of a real vLLM serving a LoRA adapter of the tiny model.

vLLM lists the adapter in /v1/models with its `parent` and no `max_model_len`; kvgate must give
it the base's context (so that it validates and reserves as for the base) and count its prompts
with the base's tokenizer, as vLLM does. The adapter is random (rank 8 on q_proj and v_proj),
written here with safetensors; the engine is started for this module unless
KVGATE_TEST_VLLM_LORA_URL names one already serving `tiny-lora` (about 100 s to start).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import testbed
from conftest import Served, ledger_is_empty, served_gateway
from safetensors.numpy import save_file

pytestmark = pytest.mark.vllm

ADAPTER = "tiny-lora"
BASE = "tiny-llama"
LORA_URL_ENV = "KVGATE_TEST_VLLM_LORA_URL"
RANK = 8
BLOCK_SIZE = 32


def write_adapter(folder: Path, model_dir: Path) -> Path:
    """A PEFT LoRA adapter for the tiny Llama: random A, zero B (it changes nothing, but vLLM
    loads and applies it like any other)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    widths = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, width in widths.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((RANK, hidden)) * 0.01).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((width, RANK), np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": sorted(widths),
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


@pytest.fixture(scope="module")
def lora_vllm_url(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("lora")
    adapter = write_adapter(folder / "adapter", tiny_model_dir)
    port = int(os.environ.get("KVGATE_TEST_VLLM_LORA_PORT", "8022"))
    flags = ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", str(RANK)]
    with testbed.serving(LORA_URL_ENV, folder, flags, port) as url:
        yield url


@pytest.fixture(scope="module")
def kvgate(lora_vllm_url: str) -> Iterator[Served]:
    with served_gateway(
        lora_vllm_url,
        discover_tokenizer=True,
        metrics_poll_interval_s=0.1,
        output_backend_prior=False,
        model=ADAPTER,  # the tokenizer is found from the adapter's entry: its base's
    ) as served:
        yield served


def test_discovery_gives_the_adapter_its_bases_context_and_tokenizer(kvgate: Served) -> None:
    info = kvgate.call(lambda: kvgate.gateway.info)
    adapter = info.find(ADAPTER)
    assert adapter is not None
    assert adapter.parent == BASE
    assert adapter.max_model_len == info.find(BASE).max_model_len == 1024
    assert info.version == "0.32.0"
    assert kvgate.call(lambda: kvgate.gateway.counter_source) == info.find(BASE).root


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [(1000, 25), (1023, None), (1024, 1), (10, 1024), (10, 1025)],
)
def test_the_adapter_is_validated_as_its_base(
    kvgate: Served, lora_vllm_url: str, prompt: int, max_tokens: int | None
) -> None:
    body: dict[str, object] = {"model": ADAPTER, "prompt": [5] * prompt, "logit_bias": {"2": 100}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    direct = httpx.post(f"{lora_vllm_url}/v1/completions", json=body, timeout=120)
    relayed = httpx.post(f"{kvgate.url}/v1/completions", json=body, timeout=120)
    assert relayed.status_code == direct.status_code, (direct.text[:300], relayed.text[:300])
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")


def test_the_adapters_chat_prompts_are_counted_and_reserved_as_vllm_counts_them(kvgate: Served) -> None:
    body = {
        "model": ADAPTER,
        "messages": [{"role": "user", "content": "How many tokens does the adapter see here?"}],
        "max_tokens": 40,
        "ignore_eos": True,
    }
    answer = httpx.post(f"{kvgate.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert answer.json()["model"] == ADAPTER
    assert usage["completion_tokens"] == 40
    # Cold, with ignore_eos: the reservation is the prompt (counted exactly) plus the whole cap.
    assert int(answer.headers["x-kvgate-blocks"]) == math.ceil((usage["prompt_tokens"] + 40) / BLOCK_SIZE)
    kvgate.wait_until(ledger_is_empty, what="the ledger to balance")

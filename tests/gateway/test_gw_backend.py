"""Discovery: /v1/models (LoRA adapters included) and /version, and what they decide.

`models_lora_0.32.0.json` is the answer of a real vLLM 0.32 started with
`--enable-lora --lora-modules tiny-lora=DIR` (see test_gw_vllm_lora.py): the adapter is listed
with its `parent` and `max_model_len: null`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import FAST_ENGINE, TEST_SETTINGS, InProcess, gateway_over_sim, ledger_is_empty, wait_until
from one_backend import OneBackend
from starlette.types import Receive, Scope, Send

from estimator.kv import blocks_for_tokens, kv_cache_layout, model_shape, request_blocks
from estimator.tokens import TokenCounter
from gateway.app import create_app
from gateway.discovery import BackendInfo, ServedModel, parse_models, parse_version, tokenizer_candidates
from gateway.settings import Settings
from sim.config import SimConfig
from sim.server import create_sim_app


def recorded_models(fixtures_dir: Path) -> Any:
    return json.loads((fixtures_dir / "vllm" / "models_lora_0.32.0.json").read_text())


def test_a_lora_adapter_takes_its_base_models_context(fixtures_dir: Path) -> None:
    info = parse_models(recorded_models(fixtures_dir), "0.32.0")
    assert info.names() == ["tiny-llama", "tiny-lora"]
    adapter = info.find("tiny-lora")
    assert adapter is not None
    assert adapter.parent == "tiny-llama"
    assert adapter.max_model_len == 1024
    assert adapter.root is not None
    assert adapter.root.endswith("lora-adapter")
    assert info.version == "0.32.0"


def test_an_adapter_is_tokenized_with_its_base_models_tokenizer(fixtures_dir: Path) -> None:
    info = parse_models(recorded_models(fixtures_dir))
    base_root = "/root/.cache/kvgate/tiny-llama"
    candidates = tokenizer_candidates(None, "tiny-lora", info)
    # The operator's setting first (as for any model), then the base's folder, then the
    # adapter's own (vLLM 0.32 has no per-adapter tokenizer).
    assert candidates[:3] == ["tiny-lora", base_root, "tiny-llama"]
    assert candidates[3].endswith("lora-adapter")
    assert tokenizer_candidates(None, None, info) == [base_root, "tiny-llama"]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # An adapter whose base is not listed keeps no context (the gateway then takes none).
        ([{"id": "lora", "parent": "elsewhere", "max_model_len": None}], None),
        # Its own context, when it has one, stands.
        (
            [{"id": "base", "max_model_len": 4096}, {"id": "lora", "parent": "base", "max_model_len": 2048}],
            2048,
        ),
        ([{"id": "base", "max_model_len": 4096}, {"id": "lora", "parent": "base"}], 4096),
        ([{"id": "lora", "parent": "base"}, {"id": "base", "max_model_len": 8192}], 8192),  # any order
        ([{"id": "lora", "parent": 7, "max_model_len": None}], None),
    ],
)
def test_adapter_context_resolution(data: list[dict[str, Any]], expected: int | None) -> None:
    adapter = parse_models({"data": data}).find("lora")
    assert adapter is not None
    assert adapter.max_model_len == expected


@pytest.mark.parametrize(
    ("payload", "version"),
    [
        ({"version": "0.32.0"}, "0.32.0"),
        ({"version": " 0.11.2 "}, "0.11.2"),
        ({"version": ""}, None),
        ({"version": 32}, None),
        (["0.32.0"], None),
        ("0.32.0", None),
    ],
)
def test_parse_version(payload: Any, version: str | None) -> None:
    assert parse_version(payload) == version


def test_tokenizer_candidates_without_models() -> None:
    info = BackendInfo((ServedModel("m", None, 1024),))
    assert tokenizer_candidates("tok", None, info) == ["tok", "m"]


@contextlib.asynccontextmanager
async def gateway_over_versioned_sim(version: str | None) -> AsyncIterator[InProcess]:
    """kvgate in front of the emulator, whose /version answers `version` (404 for None)."""
    sim_app = create_sim_app(SimConfig(engine=FAST_ENGINE))

    async def versioned(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/version":
            status, body = (
                (404, b"{}") if version is None else (200, json.dumps({"version": version}).encode())
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await sim_app(scope, receive, send)

    async with sim_app.run(), httpx.AsyncClient(transport=httpx.ASGITransport(versioned)) as backend:
        settings = Settings(backend_url="http://sim", **TEST_SETTINGS)
        app = create_app(settings, http_client=backend, token_counter=TokenCounter.approximate())
        async with app.router.lifespan_context(app):
            gateway = OneBackend(app.state.kvgate)
            await wait_until(lambda: gateway.readiness()[0], 10.0, "the gateway to be ready")
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://kvgate"
            ) as client:
                yield InProcess(app, client, sim_app)


@pytest.mark.parametrize(
    ("version", "status"),
    [("0.32.0", 200), ("0.31.9", 400), (None, 200)],  # an unknown version gets the current rule
)
async def test_the_context_rule_follows_the_backends_version(version: str | None, status: int) -> None:
    # A 4-token prompt with max_tokens 1,024 on a 1,024 context: vLLM 0.32 serves it (it stops
    # at the context); earlier versions refused it.
    body = {"model": "tiny-llama", "prompt": [5, 5, 5, 5], "max_tokens": 1024, "logit_bias": {"2": 100}}
    async with gateway_over_versioned_sim(version) as harness:
        assert harness.gateway.info is not None
        assert harness.gateway.info.version == version
        answer = await harness.client.post("/v1/completions", json=body)
        if status == 400:
            assert answer.status_code == 400
            assert answer.json()["error"]["code"] == "context_length_exceeded"
            assert answer.json()["error"]["param"] == "max_tokens"
        else:
            assert answer.headers.get("x-kvgate-blocks") is not None, answer.text
        assert ledger_is_empty(harness.gateway)


# A small Gemma-2-shaped model: one sliding-window layer beside one full-attention layer. vLLM
# gives each kind its own KV group, and a request holds blocks in both.
HYBRID_CONFIG = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 64,
    "max_position_embeddings": 1024,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}


async def test_a_hybrid_models_requests_reserve_blocks_in_every_kv_group(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HYBRID_CONFIG))
    prompt = list(range(1, 601))
    async with gateway_over_sim(model=str(tmp_path), output_backend_prior=False) as harness:
        gateway = harness.gateway
        # Read in the executor after discovery: on a loaded machine after readiness.
        await wait_until(lambda: gateway.model_shape is not None, 10.0, "the model's config to be read")
        response = await harness.client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "ignore_eos": True}
        )
        assert response.status_code == 200, response.text
        block_size = gateway.budget.reading.block_size if gateway.budget.reading else 0
        layout = kv_cache_layout(model_shape(HYBRID_CONFIG), block_size=block_size)
        expected = request_blocks(layout, len(prompt) + 20)
        assert expected > blocks_for_tokens(len(prompt) + 20, block_size)  # the groups matter
        assert int(response.headers["x-kvgate-blocks"]) == expected
        await wait_until(lambda: ledger_is_empty(gateway), what="the ledger to empty")


async def test_without_a_model_config_blocks_are_plain_paged_attention(tmp_path: Path) -> None:
    async with gateway_over_sim(model=str(tmp_path), output_backend_prior=False) as harness:
        assert harness.gateway.model_shape is None
        response = await harness.client.post(
            "/v1/completions", json={"prompt": list(range(1, 601)), "max_tokens": 20, "ignore_eos": True}
        )
        assert response.status_code == 200, response.text
        assert int(response.headers["x-kvgate-blocks"]) == -(-620 // 32)

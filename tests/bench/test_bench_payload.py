"""How the bench forces output lengths: request bodies (bench.payload, pure) and the probe that
tells whether a target reads the private field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from bench.counting import honours_forced_length
from bench.instant import DEFAULT_MODEL, InstantBackend, serving
from bench.payload import (
    DEADLINE_HEADER,
    EXPECTED_OUTPUT_HEADER,
    OUTPUT_TOKENS_FIELD,
    TTFT_HEADER,
    Forcing,
    PayloadOptions,
    build_body,
    build_headers,
    plan_requests,
)
from bench.workload import RequestSpec
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.lengths import OUTPUT_TOKENS_FIELD as SIM_FIELD
from sim.testing import running_sim_server

SPEC = RequestSpec(0.0, 12, 40)
TESTBED = Path(__file__).resolve().parents[1] / "testbed"


def test_the_bench_the_emulator_and_the_processor_name_one_field() -> None:
    # The processor runs in vLLM's environment and cannot import kvgate's packages.
    source = (TESTBED / "bench_lengths.py").read_text()
    assert f'FIELD = "{OUTPUT_TOKENS_FIELD}"' in source
    assert SIM_FIELD == OUTPUT_TOKENS_FIELD
    assert "bench_lengths:ForcedOutputLength" in (TESTBED / "testbed.py").read_text()


def test_the_default_forces_the_length_by_the_private_field_only() -> None:
    body = build_body(SPEC, "some prompt", PayloadOptions(model="m", max_tokens_cap=512))
    assert body["vllm_xargs"] == {OUTPUT_TOKENS_FIELD: 40}
    # Nothing a gateway reads tells it the answer: max_tokens stays at the cap, no floor, no bias.
    assert body["max_tokens"] == 512
    assert "min_tokens" not in body
    assert "logit_bias" not in body
    assert "ignore_eos" not in body


def test_the_min_tokens_path_stays_for_a_vllm_without_the_processor() -> None:
    options = PayloadOptions(model="m", forcing=Forcing.MIN_TOKENS, eos_token_id=2, max_tokens_cap=512)
    body = build_body(SPEC, "some prompt", options)
    assert body["min_tokens"] == 39
    assert body["logit_bias"] == {"2": 100.0}
    assert "vllm_xargs" not in body


def test_no_forcing_sends_neither() -> None:
    body = build_body(SPEC, "p", PayloadOptions(model="m", forcing=Forcing.NONE))
    assert not {"vllm_xargs", "min_tokens", "logit_bias"} & set(body)


def test_min_tokens_forcing_needs_the_eos_id() -> None:
    with pytest.raises(ValueError, match="EOS"):
        PayloadOptions(model="m", forcing=Forcing.MIN_TOKENS)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_planned_bodies_carry_each_requests_own_length(api: str) -> None:
    specs = [RequestSpec(0.0, 5, n) for n in (1, 7, 300)]
    plan = plan_requests(specs, ["a b c"] * 3, PayloadOptions(model="m", api=api))
    assert [json.loads(p.body)["vllm_xargs"][OUTPUT_TOKENS_FIELD] for p in plan] == [1, 7, 300]


def test_the_oracle_sends_each_requests_true_length_and_nothing_else_changes() -> None:
    specs = [RequestSpec(0.0, 5, n) for n in (0, 7, 300)]
    learned = plan_requests(specs, ["a b c"] * 3, PayloadOptions(model="m"))
    oracle = plan_requests(specs, ["a b c"] * 3, PayloadOptions(model="m", oracle=True))
    assert [dict(p.headers).get(EXPECTED_OUTPUT_HEADER) for p in oracle] == ["1", "7", "300"]
    # The forced length and the told one are the same number.
    assert [json.loads(p.body)["vllm_xargs"][OUTPUT_TOKENS_FIELD] for p in oracle] == [1, 7, 300]
    assert all(EXPECTED_OUTPUT_HEADER not in dict(p.headers) for p in learned)
    assert [p.body for p in learned] == [p.body for p in oracle]


@pytest.mark.parametrize(
    ("deadline_s", "ttft_s", "sent"),
    [
        (10.0, None, {DEADLINE_HEADER: "10000"}),
        (None, 2.0, {TTFT_HEADER: "2000"}),
        (10.0, 2.0, {DEADLINE_HEADER: "10000", TTFT_HEADER: "2000"}),
    ],
)
def test_each_kind_of_client_sends_only_its_own_headers(
    deadline_s: float | None, ttft_s: float | None, sent: dict[str, str]
) -> None:
    headers = dict(build_headers(SPEC, PayloadOptions(model="m", deadline_s=deadline_s, ttft_slo_s=ttft_s)))
    assert {k: v for k, v in headers.items() if k.startswith("X-Kvgate")} == sent


# -- does a target read the field? (bench.counting.honours_forced_length) ----------------------


def test_the_emulator_and_the_instant_fake_read_the_field() -> None:
    config = SimConfig(engine=EngineConfig(step_cost=StepCost(base_s=0.001, per_token_s=0.0, per_seq_s=0.0)))
    with running_sim_server(config) as sim, httpx.Client(timeout=10) as client:
        assert honours_forced_length(client, sim.url, "tiny-llama", OUTPUT_TOKENS_FIELD)

    async def probe() -> bool:
        async with serving(InstantBackend()) as url:
            with httpx.Client(timeout=10) as client:
                return await asyncio.to_thread(
                    honours_forced_length, client, url, DEFAULT_MODEL, OUTPUT_TOKENS_FIELD
                )

    assert asyncio.run(probe())


@pytest.mark.parametrize(
    ("status", "text"),
    [
        (200, '{"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}'),  # field ignored
        (400, '{"error": {"message": "max_tokens must be at least 1"}}'),  # refused for another reason
        (503, '{"error": {"message": "busy"}}'),
    ],
)
def test_a_target_that_ignores_the_field_is_found_out(status: int, text: str) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, text=text)

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        assert not honours_forced_length(client, "http://vllm", "m", OUTPUT_TOKENS_FIELD)

"""The emulator's OpenAI surface over real HTTP (uvicorn in a thread), shaped like vLLM 0.32."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.lengths import OUTPUT_TOKENS_FIELD, OutputLengthModel
from sim.server import create_sim_app
from sim.testing import SimServer, engine_idle, running_sim_server, wait_for


def sse_events(text: str) -> list[str]:
    """The payloads of `data: ...` frames, checking the framing on the way."""
    frames = text.split("\n\n")
    assert frames[-1] == "", "the stream must end with a blank line"
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        payloads.append(frame[len("data: ") :])
    return payloads


def stream(url: str, route: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.read().decode())


def test_completion_matches_vllm_shape_and_usage(sim: SimServer) -> None:
    response = httpx.post(
        f"{sim.url}/v1/completions",
        json={"model": "tiny-llama", "prompt": [1, 2, 3, 4, 5], "max_tokens": 7},
    )
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "tiny-llama"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str)
    assert choice["text"]
    # Token-id prompts are counted exactly; the testbed's model never samples EOS by itself.
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == 12
    assert engine_idle(sim.url)


def test_completions_default_to_sixteen_tokens_and_chat_to_the_context(sim: SimServer) -> None:
    completion = httpx.post(f"{sim.url}/v1/completions", json={"prompt": [7] * 10}).json()
    assert completion["usage"]["completion_tokens"] == 16
    chat = httpx.post(
        f"{sim.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        timeout=30,
    ).json()
    usage = chat["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 1024
    assert chat["choices"][0]["finish_reason"] == "length"


def test_min_tokens_with_eos_logit_bias_stops_right_after_min_tokens(sim: SimServer) -> None:
    body = {"prompt": [1] * 8, "max_tokens": 50, "min_tokens": 5, "logit_bias": {"2": 100}}
    result = httpx.post(f"{sim.url}/v1/completions", json=body).json()
    # As on the testbed: five masked tokens, then EOS, which counts as a completion token.
    assert result["usage"]["completion_tokens"] == 6
    assert result["choices"][0]["finish_reason"] == "stop"

    ignored = httpx.post(f"{sim.url}/v1/completions", json={**body, "ignore_eos": True}).json()
    assert ignored["usage"]["completion_tokens"] == 50
    assert ignored["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("length", [1, 6, 33])
def test_the_benchs_private_length_field_forces_exactly_that_many_tokens(
    sim: SimServer, route: str, length: int
) -> None:
    # As the testbed's logits processor does (tests/bench/test_bench_forcing_vllm.py): EOS as
    # token N, for every choice, even against min_tokens, and max_tokens still ends it first.
    prompt = (
        {"prompt": [1] * 8}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body = {**prompt, "max_tokens": 50, "n": 2, "vllm_xargs": {OUTPUT_TOKENS_FIELD: length}}
    result = httpx.post(f"{sim.url}{route}", json=body, timeout=30).json()
    assert result["usage"]["completion_tokens"] == 2 * length
    assert [c["finish_reason"] for c in result["choices"]] == ["stop", "stop"]
    events = stream(sim.url, route, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 2 * length
    floor = httpx.post(f"{sim.url}{route}", json={**body, "n": 1, "min_tokens": 40}, timeout=30).json()
    assert floor["usage"]["completion_tokens"] == length
    capped = httpx.post(f"{sim.url}{route}", json={**body, "n": 1, "max_tokens": 3}, timeout=30).json()
    assert capped["usage"]["completion_tokens"] == min(3, length)


def test_other_xargs_and_ignore_eos_leave_the_length_alone(sim: SimServer) -> None:
    other = {"prompt": [1] * 8, "max_tokens": 20, "vllm_xargs": {"some_other_key": 3}}
    assert httpx.post(f"{sim.url}/v1/completions", json=other).json()["usage"]["completion_tokens"] == 20
    ignored = {**other, "vllm_xargs": {OUTPUT_TOKENS_FIELD: 3}, "ignore_eos": True}
    assert httpx.post(f"{sim.url}/v1/completions", json=ignored).json()["usage"]["completion_tokens"] == 20
    # vLLM's request model reads JSON true as the integer 1.
    one = {**other, "vllm_xargs": {OUTPUT_TOKENS_FIELD: True}}
    assert httpx.post(f"{sim.url}/v1/completions", json=one).json()["usage"]["completion_tokens"] == 1


def test_output_length_distribution_applies_when_nothing_forces_the_length(
    fast_config: SimConfig,
) -> None:
    config = replace(fast_config, output_len=OutputLengthModel.parse("fixed:9"))
    with running_sim_server(config) as server:
        free = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 100})
        assert free.json()["usage"]["completion_tokens"] == 9
        assert free.json()["choices"][0]["finish_reason"] == "stop"
        capped = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 4})
        assert capped.json()["usage"]["completion_tokens"] == 4


def test_chat_stream_with_usage_has_vllm_chunk_sequence(sim: SimServer) -> None:
    events = stream(
        sim.url,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 3
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    assert all(isinstance(c["choices"][0]["delta"]["content"], str) for c in content)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 3


def test_completion_stream_without_usage_option_has_no_usage_chunk(sim: SimServer) -> None:
    events = stream(sim.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert all("usage" not in c for c in chunks)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_several_prompts_and_n_give_prompt_major_choices(sim: SimServer) -> None:
    body = {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 3}
    result = httpx.post(f"{sim.url}/v1/completions", json=body).json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert result["usage"]["prompt_tokens"] == 5
    assert result["usage"]["completion_tokens"] == 12
    events = stream(sim.url, "/v1/completions", {**body, "stream": True})
    indices = [json.loads(e)["choices"][0]["index"] for e in events[:-1]]
    assert sorted(indices) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 1025}, 400, "input_tokens"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "vllm_xargs": 5}, 400, "vllm_xargs"),
        ("/v1/completions", {"prompt": "x", "vllm_xargs": {OUTPUT_TOKENS_FIELD: 0}}, 400, None),
        ("/v1/completions", {"prompt": "x", "vllm_xargs": {OUTPUT_TOKENS_FIELD: "3"}}, 400, None),
        ("/v1/completions", {"prompt": "x", "vllm_xargs": {OUTPUT_TOKENS_FIELD: 2.5}}, 400, None),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ],
)
def test_invalid_requests_get_openai_errors(
    sim: SimServer, route: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    response = httpx.post(f"{sim.url}{route}", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_a_prompt_plus_max_tokens_beyond_the_context_stops_at_the_context(sim: SimServer) -> None:
    result = httpx.post(f"{sim.url}/v1/completions", json={"prompt": [3] * 961, "max_tokens": 100}).json()
    # The testbed answered this very request with 63 tokens and "length".
    assert result["usage"]["completion_tokens"] == 63
    assert result["choices"][0]["finish_reason"] == "length"


def test_models_and_health(sim: SimServer) -> None:
    models = httpx.get(f"{sim.url}/v1/models").json()
    assert models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == "tiny-llama"
    assert model["max_model_len"] == 1024
    assert httpx.get(f"{sim.url}/health").status_code == 200


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(
    fast_config: SimConfig,
) -> None:
    slow = replace(fast_config, engine=replace(fast_config.engine, step_cost=StepCost(0.01, 0, 0, 0)))
    with running_sim_server(slow) as server:
        body = {"prompt": [1] * 300, "max_tokens": 500, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            state = httpx.get(f"{server.url}/sim/state").json()
            assert state["num_running"] == 1
            assert state["num_free_blocks"] < state["num_usable_blocks"]
        # Leaving the block closed the connection mid-stream.
        wait_for(lambda: engine_idle(server.url))
        metrics = httpx.get(f"{server.url}/metrics").text
        # As on the testbed, a client's abort is not a finished request in vLLM's counters.
        assert 'finished_reason="abort",model_name="tiny-llama"} 0.0' in metrics
        assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny-llama"} 0.0' in metrics


def test_prompts_are_counted_with_the_real_tokenizer(fast_config: SimConfig, tiny_model_dir: Path) -> None:
    config = replace(fast_config, tokenizer=str(tiny_model_dir))
    with running_sim_server(config) as server:
        completion = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Hello world, this is", "max_tokens": 1},
        ).json()
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 1},
        ).json()
    # What the testbed's vLLM reported for the same bodies.
    assert completion["usage"]["prompt_tokens"] == 5
    assert chat["usage"]["prompt_tokens"] == 16


async def test_in_process_through_asgi_transport(fast_config: SimConfig) -> None:
    app = create_sim_app(fast_config)
    async with app.run() as runtime:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            response = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
            assert response.json()["usage"]["completion_tokens"] == 5
        assert runtime.engine.snapshot().generation_tokens_total == 5


async def test_two_hundred_concurrent_streams_all_complete(fast_config: SimConfig) -> None:
    engine = EngineConfig(num_blocks=2048, max_num_seqs=256, step_cost=StepCost(0.002, 0.0, 0.0, 0.0))
    with running_sim_server(replace(fast_config, engine=engine)) as server:
        # Pooled connections expire well before the server's keep-alive (5 s): on a loaded
        # machine the streams take longer than that, and the state read after them would
        # otherwise go out on a connection the server is closing just then.
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250, keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as client:

            async def one(i: int) -> int:
                body = {"prompt": [i % 100 + 1] * 20, "max_tokens": 20, "stream": True}
                count = 0
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            count += 1
                return count

            counts = await asyncio.gather(*(one(i) for i in range(200)))
            state = (await client.get("/sim/state")).json()
        assert counts == [20] * 200
        assert state["generation_tokens_total"] == 4000
        assert state["num_free_blocks"] == state["num_usable_blocks"]


def test_stream_body_starts_with_the_first_token_not_the_headers(fast_config: SimConfig) -> None:
    slow = replace(fast_config, engine=replace(fast_config.engine, step_cost=StepCost(0.3, 0, 0, 0)))
    with running_sim_server(slow) as server:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            headers_after = time.monotonic() - started
            chunks = response.iter_bytes()
            first = next(chunks)
            first_after = time.monotonic() - started
        # The role chunk comes with the first token, one 300 ms step after the headers.
        assert b'"role":"assistant"' in first
        assert headers_after < 0.25
        assert first_after >= 0.3

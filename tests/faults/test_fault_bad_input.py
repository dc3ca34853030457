"""Bad input: whatever a client sends, kvgate answers with OpenAI's error JSON and the right
4xx, never a 500, and passes what it does not check to the backend untouched.

- Fuzzed from kvgate's own OpenAPI document (schemathesis: bodies valid and invalid for the
  documented request schemas, headers, methods) and from hypothesis strategies of JSON
  bodies that mix plausible and absurd values for the fields kvgate reads.
- Named cases: oversized bodies (413 at `max_body_bytes`, declared or streamed), invalid UTF-8,
  lone surrogates, deeply nested JSON, huge, negative, fractional and mistyped numbers,
  `n` and `best_of` counted in the KV demand, unknown models (404), bad hint headers.
- Pass-through: logprobs and every other field reach the backend as the very bytes sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from faultkit import RecordingBackend, Served, recording_backend, served_gateway
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks

from gateway.app import create_app
from gateway.settings import Settings
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import SimServer, running_sim_server

# Zero-cost steps: valid requests come back at once, so the fuzzers spend their time on input.
INSTANT = EngineConfig(step_cost=StepCost(base_s=0.0, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0))
MAX_BODY_BYTES = 4096
ERROR_TYPES = {"invalid_request_error", "BadRequestError", "NotFoundError"}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with running_sim_server(SimConfig(engine=INSTANT)) as server:
        yield server


@pytest.fixture(scope="module")
def kvgate(sim: SimServer) -> Iterator[Served]:
    with served_gateway(sim.url, max_body_bytes=MAX_BODY_BYTES) as served:
        yield served


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    if status is not None:
        assert response.status_code == status, response.text[:300]
    body = response.json()
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


def post_raw(kvgate: Served, raw: bytes, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return httpx.post(
        f"{kvgate.url}{path}",
        content=raw,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


def post_json(kvgate: Served, body: Any, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return post_raw(kvgate, json.dumps(body).encode(), path, **headers)


OK = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}
CHAT = "/v1/chat/completions"
NEST = 900


@pytest.mark.parametrize(
    ("raw", "path", "status", "param"),
    [
        pytest.param(b"", "/v1/completions", 400, None, id="empty"),
        pytest.param(
            b'{"model":"tiny-llama","prompt":"\xff\xfe"}', "/v1/completions", 400, None, id="invalid-utf8"
        ),
        pytest.param(
            b'{"model":"tiny-llama","prompt":"\\ud800 x"}', "/v1/completions", 400, "prompt", id="surrogate"
        ),
        pytest.param(
            b'{"model":"tiny-llama","messages":[{"role":"user","content":"a\\udfff"}]}',
            CHAT,
            400,
            "messages[0].content",
            id="surrogate-chat",
        ),
        pytest.param(b"[" * 4000, "/v1/completions", 400, None, id="deeply-nested"),
        pytest.param(
            (
                '{"model":"tiny-llama","messages":[{"role":"user","content":%s}]}' % ("[" * NEST + "]" * NEST)
            ).encode(),
            CHAT,
            400,
            None,
            id="deeply-nested-content",
        ),
        pytest.param(b'{"model":"tiny-llama","prompt":"hi"', "/v1/completions", 400, None, id="truncated"),
        pytest.param(b'["not", "an", "object"]', "/v1/completions", 400, None, id="array"),
        pytest.param(b"null", "/v1/completions", 400, None, id="null"),
        pytest.param(
            b'{"model":"tiny-llama","prompt":"hi","max_tokens":1e400}',
            "/v1/completions",
            400,
            "max_tokens",
            id="inf",
        ),
        pytest.param(
            b'{"model":"tiny-llama","prompt":"hi","max_tokens":NaN}',
            "/v1/completions",
            400,
            "max_tokens",
            id="nan",
        ),
    ],
)
def test_malformed_bodies(kvgate: Served, raw: bytes, path: str, status: int, param: str | None) -> None:
    error = assert_openai_error(post_raw(kvgate, raw, path), status)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("changes", "status", "param"),
    [
        ({"max_tokens": 10**30}, 400, "max_tokens"),
        ({"max_tokens": -1}, 400, "max_tokens"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 2.5}, 400, "max_tokens"),
        ({"max_tokens": "2"}, 400, "max_tokens"),
        ({"max_tokens": True}, 400, "max_tokens"),
        ({"n": 0}, 400, "n"),
        ({"n": -3}, 400, "n"),
        ({"n": 10**12}, 400, "max_tokens"),  # counted: larger than the whole KV pool
        ({"best_of": 10**6}, 400, "max_tokens"),
        ({"best_of": "many"}, 400, "best_of"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"model": 7}, 400, "model"),
        ({"stream": "yes"}, 400, "stream"),
        ({"prompt": []}, 400, None),
        ({"prompt": [[]]}, 400, None),
        ({"prompt": {"text": "hi"}}, 400, None),
    ],
)
def test_bad_fields(kvgate: Served, changes: dict[str, Any], status: int, param: str | None) -> None:
    error = assert_openai_error(post_json(kvgate, {**OK, **changes}), status)
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-kvgate-priority", "urgent"),
        ("x-kvgate-deadline-ms", "-5"),
        ("x-kvgate-deadline-ms", "1e400"),
        ("x-kvgate-ttft-ms", "soon"),
    ],
)
def test_bad_hint_headers(kvgate: Served, header: str, value: str) -> None:
    error = assert_openai_error(post_json(kvgate, OK, **{header: value}), 400)
    assert error["param"] == header


def test_an_unusable_sdk_timeout_is_ignored(kvgate: Served) -> None:
    # The OpenAI SDK's own header is advisory, not the client's to get wrong: no 400 for it.
    for value in ("NaN", "-1", "inf", "soon"):
        assert post_json(kvgate, OK, **{"x-stainless-read-timeout": value}).status_code == 200


def test_oversized_bodies_are_refused_with_413(kvgate: Served) -> None:
    big = {**OK, "prompt": "x" * MAX_BODY_BYTES}
    declared = post_json(kvgate, big)
    assert assert_openai_error(declared, 413)["code"] == "request_too_large"
    assert declared.headers["x-should-retry"] == "false"

    def chunks() -> Iterator[bytes]:  # no content-length: the limit holds as the bytes arrive
        raw = json.dumps(big).encode()
        for start in range(0, len(raw), 512):
            yield raw[start : start + 512]

    streamed = httpx.post(f"{kvgate.url}/v1/completions", content=chunks(), timeout=30)
    assert "content-length" not in streamed.request.headers
    assert_openai_error(streamed, 413)
    # Just under the limit is fine.
    fits = {**OK, "x_padding": "x" * (MAX_BODY_BYTES - 200)}
    assert post_json(kvgate, fits).status_code == 200


def test_n_and_best_of_are_counted_in_the_demand(kvgate: Served) -> None:
    def blocks(**changes: Any) -> int:
        response = post_json(kvgate, {**OK, "max_tokens": 100, **changes})
        return int(response.headers["x-kvgate-blocks"])

    one = blocks()
    assert blocks(n=4) >= 4 * one - 3  # the prompt's blocks may be shared, each output is not
    assert blocks(best_of=4) == blocks(n=4)
    assert blocks(n=2, best_of=4) == blocks(n=4)


# -- hypothesis: bodies that mix plausible and absurd values ------------------------------------

_json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
_json = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_counts = st.integers(min_value=-(2**70), max_value=2**70) | st.integers(min_value=1, max_value=8) | _json
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | _json},
        optional={"content": st.text(max_size=40) | _json, "name": _json, "tool_calls": _json},
    ),
    max_size=3,
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("tiny-llama") | st.text(max_size=12) | _json,
        "prompt": st.text(max_size=60) | st.lists(st.integers(0, 40000), max_size=20) | _json,
        "messages": _messages | _json,
        "max_tokens": _counts,
        "max_completion_tokens": _counts,
        "n": _counts,
        "best_of": _counts,
        "stream": st.booleans() | _json,
        "logprobs": _json,
        "temperature": _json,
        "stream_options": _json,
        "tools": _json,
    },
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_body, chat=st.booleans())
def test_fuzzed_bodies_never_make_kvgate_fail(kvgate: Served, body: dict[str, Any], chat: bool) -> None:
    response = post_json(kvgate, body, CHAT if chat else "/v1/completions")
    assert response.status_code in (200, 400, 404), f"{response.status_code}: {response.text[:300]}"
    if response.status_code != 200:
        error = assert_openai_error(response)
        assert error["type"] in ERROR_TYPES


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzzed_bytes_never_make_kvgate_fail(kvgate: Served, raw: bytes) -> None:
    response = post_raw(kvgate, raw)
    assert response.status_code in (200, 400, 404), f"{response.status_code}: {response.text[:300]}"
    if response.status_code != 200:
        assert_openai_error(response)


# -- schemathesis: from kvgate's own OpenAPI document -------------------------------------------


def _document() -> dict[str, Any]:
    """The document kvgate serves at /openapi.json; it depends on no backend, so it is built at
    collection (schemathesis's lazy fixture loader does not run on this pytest)."""
    return create_app(Settings.model_validate({"backend_url": "http://backend.invalid"})).openapi()


schema = schemathesis.openapi.from_dict(_document())
# A schema-violating request is rejected with any 4xx kvgate documents (413 for a body over the
# limit is as much a rejection as 400).
schema.config.checks.negative_data_rejection.expected_statuses = ["400", "401", "404", "405", "413"]


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_as_documented(case: schemathesis.Case[Any], kvgate: Served) -> None:
    response = case.call(base_url=kvgate.url, timeout=30)
    case.validate_response(
        response,
        checks=[
            checks.not_a_server_error,
            checks.status_code_conformance,
            checks.content_type_conformance,
            checks.response_schema_conformance,
            checks.negative_data_rejection,
        ],
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_conforms_to_the_document(path: str, kvgate: Served) -> None:
    # Each server-sent event is checked against the documented event schema (the examples
    # above reach a stream only now and then).
    body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 4, "stream": True}
    body.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call(base_url=kvgate.url, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(
        response, checks=[checks.content_type_conformance, checks.response_schema_conformance]
    )


def test_the_document_describes_the_generation_bodies(kvgate: Served) -> None:
    document = httpx.get(f"{kvgate.url}/openapi.json", timeout=5).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        operation = document["paths"][path]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(model)
        assert {"200", "400", "404", "413", "429", "502", "503", "504"} <= set(operation["responses"])
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    assert chat["additionalProperties"] is True


# -- pass-through -------------------------------------------------------------------------------


@pytest.fixture
def recorder() -> Iterator[tuple[RecordingBackend, str]]:
    with recording_backend() as pair:
        yield pair


def test_fields_kvgate_does_not_check_reach_the_backend_as_sent(
    recorder: tuple[RecordingBackend, str],
) -> None:
    backend, url = recorder
    # Key order, spacing, number spellings, unicode escapes and unknown fields: all kept.
    raw = (
        b'{ "prompt" : "caf\\u00e9 \xe2\x98\x95", "model":"tiny-llama", "max_tokens":3,\n'
        b'  "logprobs": 5, "top_logprobs": 2, "echo": true, "temperature": 1.0e0,\n'
        b'  "logit_bias": {"50256": -100}, "seed": 12345678901234567890,\n'
        b'  "x_vendor_extension": {"nested": [1, 2.50, null]}, "n": 1, "best_of": 1 }'
    )
    with served_gateway(url) as kvgate:
        response = httpx.post(
            f"{kvgate.url}/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=10,
        )
        assert response.status_code == 200
        chat = b'{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":3}'
        assert httpx.post(f"{kvgate.url}{CHAT}", content=chat, timeout=10).status_code == 200
    sent = backend.generation()
    assert [s.body for s in sent] == [raw, chat]

"""kvgate is no open proxy: a request cannot choose where it goes, and what crosses is filtered.

- The backend URL and path are the configured ones, whatever the request line says: an
  absolute-form target, `..` segments, encoded slashes, a query string, Host and forwarding
  headers change nothing; paths kvgate does not serve never reach the backend.
- Hop-by-hop headers (and those a Connection header names) stay on their side, both ways.
- With a gateway key for the backend, the client's Authorization never reaches vLLM, on any
  of the calls kvgate makes; kvgate's own hint and admin headers never do either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from faultkit import RecordingBackend, Served, raw_exchange, recording_backend, served_gateway

BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
GATEWAY_KEY = "gateway-own-key"


@pytest.fixture
def backend() -> Iterator[tuple[RecordingBackend, str]]:
    with recording_backend() as pair:
        yield pair


@pytest.fixture
def kvgate(backend: tuple[RecordingBackend, str]) -> Iterator[Served]:
    with served_gateway(backend[1], backend_api_key=GATEWAY_KEY) as served:
        yield served


def post(target: str, *, host: str = "kvgate", extra: str = "") -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\nconnection: close\r\n{extra}\r\n"
    ).encode() + BODY


@pytest.mark.parametrize(
    ("target", "host", "extra"),
    [
        pytest.param("http://evil.example:9999/v1/completions", "evil.example:9999", "", id="absolute-form"),
        pytest.param("/v1/completions?url=http://evil.example/&target=/admin", "kvgate", "", id="query"),
        pytest.param("/v1%2Fcompletions", "kvgate", "", id="encoded-slash"),
        pytest.param(
            "/v1/completions", "evil.example", "x-forwarded-host: evil.example\r\n", id="host-header"
        ),
        pytest.param(
            "/v1/completions",
            "kvgate",
            "x-original-url: /admin/state\r\nx-rewrite-url: /metrics\r\nx-forwarded-prefix: /evil\r\n",
            id="rewrite-headers",
        ),
    ],
)
def test_the_backend_target_is_always_the_configured_one(
    kvgate: Served, backend: tuple[RecordingBackend, str], target: str, host: str, extra: str
) -> None:
    recorder, url = backend
    status, _, _ = raw_exchange(kvgate.url, post(target, host=host, extra=extra))
    assert status == 200
    (seen,) = recorder.generation()
    assert (seen.method, seen.raw_path, seen.query) == ("POST", b"/v1/completions", b"")
    assert seen.header("host") == [url.removeprefix("http://")]
    assert seen.body == BODY


@pytest.mark.parametrize(
    "target",
    [
        "/v1/../admin/state",
        "/v1/completions/../../metrics",
        "/v1/completions%2F..%2F..%2Fmetrics",
        "/v1/chat/completions/..",
        "/v1/embeddings",
        "/v1/responses",
        "//evil.example/v1/completions",
        "/v1/completions/",
        "/V1/COMPLETIONS",
    ],
)
def test_paths_outside_the_served_ones_never_reach_the_backend(
    kvgate: Served, backend: tuple[RecordingBackend, str], target: str
) -> None:
    recorder, _ = backend
    status, headers, body = raw_exchange(kvgate.url, post(target))
    assert status in (404, 405), body
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert "x-request-id" in headers
    assert recorder.generation() == []


def test_models_listing_takes_no_target_from_the_request(
    kvgate: Served, backend: tuple[RecordingBackend, str]
) -> None:
    recorder, _ = backend
    before = len(recorder.seen)
    request = b"GET http://evil.example/v1/models?path=/admin HTTP/1.1\r\nhost: evil.example\r\nconnection: close\r\n\r\n"
    status, _, body = raw_exchange(kvgate.url, request)
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == "tiny-llama"
    listed = [s for s in recorder.seen[before:] if s.raw_path == b"/v1/models"]
    assert listed
    assert all(s.query == b"" for s in listed)
    assert all(s.header("authorization") == [f"Bearer {GATEWAY_KEY}"] for s in listed)


def test_hop_by_hop_headers_stay_on_their_side(kvgate: Served, backend: tuple[RecordingBackend, str]) -> None:
    recorder, _ = backend
    extra = (
        "connection: keep-alive, x-client-hop\r\n"  # closes after all: "close" is sent too below
        "x-client-hop: secret\r\n"
        "keep-alive: timeout=99\r\n"
        "te: trailers\r\n"
        "upgrade: h2c\r\n"
        "proxy-authorization: Basic cHJveHk6c2VjcmV0\r\n"
        "proxy-connection: keep-alive\r\n"
        "trailer: x-late\r\n"
        "x-kvgate-priority: high\r\n"
        "x-kvgate-admin-token: admin-secret\r\n"
        "x-kvgate-priority-token: priority-secret\r\n"
        "x-end-to-end: kept\r\n"
    )
    status, headers, _ = raw_exchange(kvgate.url, post("/v1/completions", extra=extra))
    assert status == 200
    (seen,) = recorder.generation()
    names = {name for name, _ in seen.headers}
    dropped = {
        "x-client-hop", "keep-alive", "te", "upgrade", "proxy-authorization", "proxy-connection",
        "trailer", "x-kvgate-priority", "x-kvgate-admin-token", "x-kvgate-priority-token",
    }  # fmt: skip
    assert not names & dropped, names & dropped
    assert seen.header("x-end-to-end") == ["kept"]
    assert seen.header("connection") in ([], ["keep-alive"])  # the gateway's own, if any
    # The backend's hop-by-hop headers do not reach the client either.
    assert "x-backend-hop" not in headers
    assert "keep-alive" not in headers
    assert "upgrade" not in headers
    assert headers["x-backend-kept"] == "1"


def test_the_client_credentials_never_reach_the_backend(
    kvgate: Served, backend: tuple[RecordingBackend, str]
) -> None:
    recorder, _ = backend
    for route in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": "tiny-llama", "max_tokens": 2}
        body |= (
            {"prompt": "hi"}
            if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]}
        )
        response = httpx.post(
            f"{kvgate.url}{route}",
            json=body,
            headers={"authorization": "Bearer client-secret", "Authorization-Extra": "x"},
            timeout=10,
        )
        assert response.status_code == 200
    httpx.get(f"{kvgate.url}/v1/models", headers={"authorization": "Bearer client-secret"}, timeout=10)
    kvgate.wait_until(lambda gw: gw.poller.failures == 0 and gw.snapshot().known, what="a scrape")
    assert recorder.seen, "nothing reached the backend"
    for seen in recorder.seen:
        assert seen.header("authorization") == [f"Bearer {GATEWAY_KEY}"], seen
        assert all("client-secret" not in value for _, value in seen.headers)


def test_without_a_gateway_key_the_client_credentials_pass_through(
    backend: tuple[RecordingBackend, str],
) -> None:
    """Documented behaviour: with no key of its own, kvgate is transparent to the client's key
    (vLLM's --api-key then checks it)."""
    recorder, url = backend
    with served_gateway(url) as kvgate:
        response = httpx.post(
            f"{kvgate.url}/v1/completions",
            content=BODY,
            headers={"authorization": "Bearer client-key", "content-type": "application/json"},
            timeout=10,
        )
        assert response.status_code == 200
    (seen,) = recorder.generation()
    assert seen.header("authorization") == ["Bearer client-key"]

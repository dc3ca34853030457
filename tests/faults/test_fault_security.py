"""Security: the admin API, secrets and prompts in logs, request ids, header and body limits.

- /admin/* needs the admin token when one is set (Bearer or X-Kvgate-Admin-Token); without one
  it is served on a loopback bind only, unless `admin_api = on`; an empty token is no token.
- Tokens, keys and prompts never reach a log line, even at debug level.
- Every response carries an x-request-id, and the request's log line the same id.
- A request line and headers past `max_header_bytes` get 431; a body past `max_body_bytes`
  gets 413; the server goes on serving.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from faultkit import ADMIN_TOKEN, SimProcess, kvgate_process, raw_exchange, served_gateway

from sim.config import SimConfig

SECRET_PROMPT = "zebra-quartz-prompt-7731"
SECRET_KEY = "client-key-4471-secret"
GATEWAY_KEY = "gateway-key-9902-secret"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    process = SimProcess(SimConfig())
    process.start()
    try:
        yield process
    finally:
        process.stop()


def admin(url: str, **headers: str) -> int:
    return httpx.get(f"{url}/admin/state", headers=headers, timeout=5).status_code


def test_the_admin_token_is_required_when_set(sim: SimProcess) -> None:
    with served_gateway(sim.url, admin_token=ADMIN_TOKEN) as kvgate:
        url = kvgate.url
        assert admin(url) == 401
        assert admin(url, authorization="Bearer wrong") == 401
        assert admin(url, authorization=f"Bearer {ADMIN_TOKEN[:-1]}") == 401  # a prefix is not it
        assert admin(url, authorization=f"Bearer {ADMIN_TOKEN}x") == 401
        assert admin(url, **{"x-kvgate-admin-token": ""}) == 401
        assert admin(url, authorization=f"Basic {ADMIN_TOKEN}") == 401
        assert admin(url, authorization=f"Bearer {ADMIN_TOKEN}") == 200
        assert admin(url, authorization=f"bearer {ADMIN_TOKEN}") == 200
        assert admin(url, **{"x-kvgate-admin-token": ADMIN_TOKEN}) == 200
        state = httpx.get(f"{url}/admin/state", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
        assert state.json()["settings"]["admin_token"] == "***"
        assert ADMIN_TOKEN not in state.text
        assert httpx.post(f"{url}/admin/reload", timeout=5).status_code == 401


@pytest.mark.parametrize(
    ("host", "token", "admin_api", "without", "with_token"),
    [
        pytest.param("127.0.0.1", None, "auto", 200, 200, id="loopback-no-token"),
        pytest.param("::1", None, "auto", 200, 200, id="loopback-v6-no-token"),
        pytest.param("localhost", "", "auto", 200, 200, id="loopback-empty-token-is-none"),
        pytest.param("0.0.0.0", None, "auto", 404, 404, id="public-no-token-off"),
        pytest.param("10.1.2.3", "", "auto", 404, 404, id="public-empty-token-off"),
        pytest.param("0.0.0.0", "   ", "auto", 404, 404, id="public-blank-token-off"),
        pytest.param("0.0.0.0", ADMIN_TOKEN, "auto", 401, 200, id="public-token"),
        pytest.param("::", None, "on", 200, 200, id="public-opt-in"),
        pytest.param("127.0.0.1", ADMIN_TOKEN, "off", 404, 404, id="off"),
    ],
)
def test_admin_api_by_bind_and_token(
    sim: SimProcess, host: str, token: str | None, admin_api: str, without: int, with_token: int
) -> None:
    """Decided by the address kvgate binds (the setting), not by who asks: behind a proxy on
    the same host every client would look local. The server here listens on loopback."""
    with served_gateway(sim.url, host=host, admin_token=token, admin_api=admin_api) as kvgate:
        assert admin(kvgate.url) == without
        assert admin(kvgate.url, authorization=f"Bearer {ADMIN_TOKEN}") == with_token
        if without == 404:
            body = httpx.get(f"{kvgate.url}/admin/state", timeout=5).json()
            assert body["error"]["code"] == "admin_api_disabled"
            assert httpx.post(f"{kvgate.url}/admin/reload", timeout=5).status_code == 404


def test_an_empty_admin_token_on_a_public_bind_leaves_admin_off(sim: SimProcess, tmp_path: Path) -> None:
    """The real process, bound to every interface, with KVGATE_ADMIN_TOKEN set but empty."""
    with kvgate_process(
        sim.url, tmp_path / "kvgate.log", admin_token="", extra_args=["--host", "0.0.0.0"]
    ) as kvgate:
        assert admin(kvgate.url) == 404
        assert admin(kvgate.url, **{"x-kvgate-admin-token": ""}) == 404
        assert admin(f"http://localhost:{kvgate.port}") == 404


def test_no_secret_and_no_prompt_in_the_logs_and_an_id_everywhere(sim: SimProcess, tmp_path: Path) -> None:
    with kvgate_process(
        sim.url,
        tmp_path / "kvgate.log",
        settings={"log_level": "debug", "log_format": "json", "backend_api_key": GATEWAY_KEY},
    ) as kvgate:
        url = kvgate.url
        client_auth = {"authorization": f"Bearer {SECRET_KEY}", "x-kvgate-admin-token": "not-the-token"}
        responses = [
            httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny-llama", "prompt": SECRET_PROMPT, "max_tokens": 3},
                headers=client_auth,
                timeout=10,
            ),
            httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "messages": [{"role": "user", "content": SECRET_PROMPT}],
                    "stream": True,
                },
                headers=client_auth,
                timeout=10,
            ),
            # Refusals too: the prompt is in the body of a request that fails validation.
            httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny-llama", "prompt": SECRET_PROMPT, "max_tokens": -1},
                headers=client_auth,
                timeout=10,
            ),
            httpx.post(
                f"{url}/v1/completions", content=SECRET_PROMPT.encode(), headers=client_auth, timeout=10
            ),
            httpx.get(f"{url}/v1/embeddings", headers=client_auth, timeout=10),
            httpx.get(f"{url}/admin/state", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10),
            httpx.get(f"{url}/admin/state", headers={"authorization": f"Bearer {SECRET_KEY}"}, timeout=10),
            httpx.get(f"{url}/healthz", timeout=10),
            httpx.get(f"{url}/readyz", timeout=10),
            httpx.get(f"{url}/metrics", timeout=10),
            httpx.get(f"{url}/v1/models", headers=client_auth, timeout=10),
            httpx.get(f"{url}/openapi.json", timeout=10),
        ]
        assert [r.status_code for r in responses] == [
            200,
            200,
            400,
            400,
            404,
            200,
            401,
            200,
            200,
            200,
            200,
            200,
        ]
        ids = [r.headers.get("x-request-id") for r in responses]
        assert all(ids)
        assert len(set(ids)) == len(ids)
        log = kvgate.output()
    for secret in (SECRET_PROMPT, SECRET_KEY, GATEWAY_KEY, ADMIN_TOKEN):
        assert secret not in log, f"{secret} was logged"
    request_lines = [json.loads(line) for line in log.splitlines() if '"logger":"kvgate.requests"' in line]
    logged_ids = {line["request_id"] for line in request_lines}
    assert set(ids[:4]) <= logged_ids  # each generation request's line carries its response's id
    assert all(line.get("request_id") for line in request_lines)


def test_header_and_body_limits_on_a_real_process(sim: SimProcess, tmp_path: Path) -> None:
    with kvgate_process(
        sim.url, tmp_path / "kvgate.log", settings={"max_header_bytes": 8192, "max_body_bytes": 4096}
    ) as kvgate:
        body = b'{"model":"tiny-llama","prompt":"hi","max_tokens":2}'
        head = "POST /v1/completions HTTP/1.1\r\nhost: k\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(body)}\r\n"
        for extra in (
            "x-big: " + "a" * 9000 + "\r\n",
            "".join(f"x-h{i}: {'b' * 90}\r\n" for i in range(100)),
        ):
            status, headers, answer = raw_exchange(kvgate.url, (head + extra + "\r\n").encode() + body)
            assert status == 431
            assert json.loads(answer)["error"]["code"] == "request_header_fields_too_large"
            assert "x-request-id" in headers
        # A client that streams headers forever is cut off, not buffered. The client waits a
        # moment for an answer after each line: the kernel's socket buffers hold megabytes on
        # loopback, so an unpaced sender measures them, not when kvgate cut it off.
        host, port = kvgate.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode())
            sent = 0
            cut_off = False
            try:
                while sent < 2_000_000 and not cut_off:
                    sock.sendall(b"x-more: " + b"c" * 4000 + b"\r\n")
                    sent += 4010
                    cut_off = bool(select.select([sock], [], [], 0.02)[0])
                answer_start = sock.recv(64) if cut_off else b""
            except OSError:  # reset by kvgate's close: also a cut-off
                cut_off, answer_start = True, b""
            assert cut_off, "kvgate never cut off a client streaming headers"
            assert sent < 1_000_000, f"kvgate read {sent} bytes of headers before cutting off"
            assert answer_start == b"" or answer_start.startswith(b"HTTP/1.1 431 ")
        # Within the limits all is well; a body over its limit is 413.
        status, headers, _ = raw_exchange(kvgate.url, (head + "connection: close\r\n\r\n").encode() + body)
        assert status == 200
        assert "x-request-id" in headers
        big = httpx.post(f"{kvgate.url}/v1/completions", content=b"x" * 5000, timeout=10)
        assert big.status_code == 413
        assert "x-request-id" in big.headers

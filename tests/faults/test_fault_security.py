"""Security: the admin API, secrets and prompts in logs, request ids, header and body limits.

- /admin/* needs the admin token when one is set (Bearer or X-Kvgate-Admin-Token); without one
  it is served on a loopback bind only, unless `admin_api = on`; an empty token is no token.
- Tokens, keys and prompts never reach a log line, even at debug level.
- Every response carries an x-request-id, and the request's log line the same id.
- A request line and headers past `max_header_bytes` get 431; a body past `max_body_bytes`
  gets 413; the server goes on serving.
- Raising a request's priority (X-Kvgate-Priority: high, vLLM's `priority` below 0) takes the
  priority token; nobody may by default.
- No client-facing body names the backend's address or its credentials; the URL's credentials
  are masked wherever it is shown.
- The admin API refuses what a page of another site can send.
"""

from __future__ import annotations

import json
import re
import select
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from faultkit import (
    ADMIN_TOKEN,
    SimProcess,
    clear_faults,
    kvgate_process,
    poll_until,
    raw_exchange,
    served_gateway,
    set_faults,
)

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


# -- who may raise a request's priority --------------------------------------------------------

PRIORITY_TOKEN = "priority-token-6620-secret"
PLAIN = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}


def admitted(url: str, priority: str) -> float:
    prefix = f'kvgate_admitted_total{{backend="default",priority="{priority}"}} '
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def test_without_a_priority_token_nobody_jumps_the_queue(sim: SimProcess) -> None:
    """The default: high counts as normal, a vLLM priority below 0 is refused, lowering is fine."""
    with served_gateway(sim.url) as kvgate:
        url = f"{kvgate.url}/v1/completions"
        high = {"x-kvgate-priority": "high", "x-kvgate-priority-token": PRIORITY_TOKEN}
        assert httpx.post(url, json=PLAIN, headers=high, timeout=10).status_code == 200
        assert (
            httpx.post(url, json=PLAIN, headers={"x-kvgate-priority": "low"}, timeout=10).status_code == 200
        )
        for value in (-1, "-1", -0.5):
            refused = httpx.post(url, json={**PLAIN, "priority": value}, timeout=10)
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert (error["code"], error["param"]) == ("priority_not_allowed", "priority")
        assert httpx.post(url, json={**PLAIN, "priority": 3}, timeout=10).status_code == 200
        assert (admitted(kvgate.url, "high"), admitted(kvgate.url, "normal")) == (0, 2)
        assert admitted(kvgate.url, "low") == 1


def test_the_priority_token_lets_its_holders_raise_priority(sim: SimProcess) -> None:
    with served_gateway(sim.url, priority_token=PRIORITY_TOKEN) as kvgate:
        url = f"{kvgate.url}/v1/completions"
        token = {"x-kvgate-priority-token": PRIORITY_TOKEN}
        assert (
            httpx.post(url, json=PLAIN, headers={"x-kvgate-priority": "high"}, timeout=10).status_code == 200
        )
        raised = httpx.post(url, json=PLAIN, headers={"x-kvgate-priority": "high", **token}, timeout=10)
        assert raised.status_code == 200
        assert httpx.post(url, json={**PLAIN, "priority": -5}, headers=token, timeout=10).status_code == 200
        wrong = httpx.post(
            url,
            json=PLAIN,
            headers={"x-kvgate-priority": "high", "x-kvgate-priority-token": "guess"},
            timeout=10,
        )
        assert wrong.status_code == 403
        assert wrong.json()["error"]["code"] == "invalid_priority_token"
        assert PRIORITY_TOKEN not in wrong.text
        assert httpx.post(url, json={**PLAIN, "priority": -5}, timeout=10).status_code == 403
        assert (admitted(kvgate.url, "high"), admitted(kvgate.url, "normal")) == (1, 2)
        state = httpx.get(f"{kvgate.url}/admin/state", timeout=5).json()
        assert state["settings"]["priority_token"] == "***"


# -- what errors reveal ------------------------------------------------------------------------

BACKEND_USER = "kvuser"
BACKEND_PASSWORD = "backend-pass-3391-secret"


def test_no_client_facing_body_names_the_backend_or_its_credentials(tmp_path: Path) -> None:
    """kvgate in front of an emulator whose URL carries credentials; the emulator hangs, then
    dies. Every body a client can read (errors, /readyz, /v1/models, the admin state, the
    dashboard) and every log line is searched for the backend's address and its credentials."""
    sim = SimProcess(SimConfig())
    sim.start()
    address = f"127.0.0.1:{sim.port}"
    backend_url = f"http://{BACKEND_USER}:{BACKEND_PASSWORD}@{address}"
    bodies: list[str] = []  # what anyone may read
    admin_bodies: list[str] = []  # the operator's view: the address, but no credentials

    def collect(response: httpx.Response, into: list[str] = bodies) -> httpx.Response:
        into.append(response.text)
        into.extend(f"{name}: {value}" for name, value in response.headers.items())
        return response

    try:
        with kvgate_process(
            backend_url,
            tmp_path / "kvgate.log",
            settings={"log_level": "debug", "log_format": "json", "first_byte_timeout_s": 0.5},
        ) as kvgate:
            url = kvgate.url
            admin_headers = kvgate.admin_headers()
            assert collect(httpx.post(f"{url}/v1/completions", json=PLAIN, timeout=10)).status_code == 200
            state = collect(
                httpx.get(f"{url}/admin/state", headers=admin_headers, timeout=5), admin_bodies
            ).json()
            assert state["backends"][0]["url"] == f"http://***@{address}"
            assert state["settings"]["backend_url"] == f"http://***@{address}"
            collect(httpx.get(f"{url}/dashboard", timeout=5))
            # A backend that accepts and never answers: 504, plain and streamed.
            set_faults(sim.url, hang=True)
            assert collect(httpx.post(f"{url}/v1/completions", json=PLAIN, timeout=10)).status_code == 504
            streamed = httpx.post(f"{url}/v1/completions", json={**PLAIN, "stream": True}, timeout=10)
            assert collect(streamed).status_code == 504
            clear_faults(sim.url)
            # A backend that is gone: connections refused.
            sim.kill()
            statuses = {collect(httpx.post(f"{url}/v1/completions", json=PLAIN, timeout=10)).status_code}
            statuses.add(collect(httpx.get(f"{url}/v1/models", timeout=10)).status_code)
            poll_until(
                lambda: collect(httpx.get(f"{url}/readyz", timeout=5)).status_code == 503, 10, "not ready"
            )
            statuses.add(collect(httpx.post(f"{url}/v1/completions", json=PLAIN, timeout=10)).status_code)
            chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            statuses.add(collect(httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=10)).status_code)
            collect(httpx.get(f"{url}/admin/state", headers=admin_headers, timeout=5), admin_bodies)
            assert statuses <= {502, 503}, statuses
            assert 502 in statuses
            log = kvgate.output()
    finally:
        sim.stop()
    assert any(
        "cannot connect to the backend" in body or "cannot reach the backend" in body for body in bodies
    )
    port = re.compile(rf"\b{sim.port}\b")
    for text in bodies:
        assert address not in text, text
        assert not port.search(text), text
        assert BACKEND_PASSWORD not in text, text
        assert BACKEND_USER not in text, text
    for text in admin_bodies:
        assert BACKEND_PASSWORD not in text
        assert BACKEND_USER not in text
    assert BACKEND_PASSWORD not in log
    assert f"{BACKEND_USER}:" not in log


# -- the admin API and other sites -------------------------------------------------------------


def test_a_page_of_another_site_cannot_reload_kvgate(sim: SimProcess, tmp_path: Path) -> None:
    """No admin token on a loopback bind (the default): the admin API is open to this machine,
    but what a page in a browser can send (a form, a simple fetch, a rebound host name) is
    refused; a script or an operator's curl with X-Kvgate-Admin is served."""
    with kvgate_process(sim.url, tmp_path / "kvgate.log", admin_token=None) as kvgate:
        reload_url = f"{kvgate.url}/admin/reload"
        own_origin = kvgate.url
        form = {"content-type": "application/x-www-form-urlencoded"}

        def reload(**headers: str) -> tuple[int, str | None]:
            response = httpx.post(reload_url, content=b"a=1", headers={**form, **headers}, timeout=10)
            code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
            return response.status_code, code

        # What a cross-site form or a no-cors fetch sends: no custom header.
        assert reload() == (403, "admin_header_required")
        assert reload(origin="https://evil.example") == (403, "cross_site")
        assert reload(origin="null") == (403, "cross_site")
        # A custom header forces a CORS preflight, which kvgate never grants; and should a
        # browser send it anyway, its Origin or Fetch Metadata give it away.
        intent = {"x-kvgate-admin": "1"}
        assert reload(**intent, origin="https://evil.example") == (403, "cross_site")
        assert reload(**intent, **{"sec-fetch-site": "cross-site"}) == (403, "cross_site")
        assert reload(**intent, **{"sec-fetch-site": "same-site"}) == (403, "cross_site")
        # DNS rebinding: the page's own name, now resolving to 127.0.0.1, is same-origin.
        rebound = f"evil.example:{kvgate.port}"
        assert reload(**intent, host=rebound, origin=f"http://{rebound}") == (403, "admin_host_not_loopback")
        assert admin(kvgate.url, host=rebound) == 403
        # kvgate's own pages, and clients that are not browsers.
        assert reload(**intent) == (200, None)
        assert reload(**intent, origin=own_origin, **{"sec-fetch-site": "same-origin"}) == (200, None)
        assert reload(**intent, host=f"localhost:{kvgate.port}") == (200, None)
        assert admin(kvgate.url, **{"sec-fetch-site": "same-origin"}) == 200
        assert admin(kvgate.url, **{"sec-fetch-site": "cross-site"}) == 403


def test_with_an_admin_token_other_sites_are_refused_too(sim: SimProcess, tmp_path: Path) -> None:
    with kvgate_process(sim.url, tmp_path / "kvgate.log") as kvgate:
        token = kvgate.admin_headers()
        reload_url = f"{kvgate.url}/admin/reload"
        assert httpx.post(reload_url, headers=token, timeout=10).status_code == 200
        assert httpx.post(reload_url, timeout=10).status_code == 401
        evil = httpx.post(reload_url, headers={**token, "origin": "https://evil.example"}, timeout=10)
        assert (evil.status_code, evil.json()["error"]["code"]) == (403, "cross_site")
        # With a token, the host name does not matter (the token is what a page cannot know).
        assert admin(kvgate.url, host="kvgate.internal", **token) == 200

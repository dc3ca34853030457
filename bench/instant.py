"""An instant OpenAI-style streaming server, to measure the bench itself and to test it.

It answers `/v1/completions` and `/v1/chat/completions` with server-sent events shaped like
vLLM's (one chunk per token, `token_ids` when asked, a usage chunk, `[DONE]`), writing as many
tokens as the request forces (the bench's `vllm_xargs.kvgate_bench_output_tokens`, or
`min_tokens` + 1 when an EOS `logit_bias` is given, at most `max_tokens`; else `max_tokens`) at
a fixed pace, and no model at all. It also serves `/v1/models`, `/tokenize`
(one token per whitespace-separated word, no BOS) and a `/metrics` page with vLLM's names for
running requests, KV usage, preemptions and generated tokens.

Requests can steer it, for tests: `X-Fake-Status` answers that status at once (with
`Retry-After: 1` and `retry-after-ms: 1000` for 429 and 503), `X-Fake-Token-Interval-Ms` and
`X-Fake-First-Token-Ms` change the pace.

Run it on its own with `python -m bench.instant --port P` (what `bench.selfcheck` does, so the
server does not share an event loop with the client it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from bench.payload import OUTPUT_TOKENS_FIELD

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MODEL = "instant"
DEFAULT_MAX_MODEL_LEN = 1_000_000
# A token id that is never an EOS, for the fake's token_ids.
FAKE_TOKEN_ID = 1000


@dataclass(slots=True)
class InstantBackend:
    """The ASGI app. Counters are plain attributes: one event loop serves it."""

    model: str = DEFAULT_MODEL
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    token_interval_s: float = 0.0
    first_token_s: float = 0.0
    running: int = 0
    generated_tokens: int = 0
    requests_seen: int = 0
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    keep_headers: int = 1000

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] == "GET" and path == "/v1/models":
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": [{"id": self.model, "object": "model", "max_model_len": self.max_model_len}],
                },
            )
        elif scope["method"] == "GET" and path == "/metrics":
            await _text(send, 200, self.metrics_text())
        elif scope["method"] == "POST" and path == "/tokenize":
            body = json.loads(await _read_body(receive))
            text = body.get("prompt") or " ".join(str(m.get("content", "")) for m in body.get("messages", ()))
            await _json(send, 200, {"count": len(str(text).split())})
        elif scope["method"] == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(scope, receive, send, chat=path.endswith("chat/completions"))
        else:
            await _json(send, 404, {"error": {"message": f"no route {path}"}})

    def metrics_text(self) -> str:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} 0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {min(1.0, self.running / 100)}\n"
            "# TYPE vllm:num_preemptions counter\n"
            f"vllm:num_preemptions_total{labels} 0\n"
            "# TYPE vllm:generation_tokens counter\n"
            f"vllm:generation_tokens_total{labels} {self.generated_tokens}\n"
        )

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests_seen += 1
        if len(self.headers_seen) < self.keep_headers:
            self.headers_seen.append(headers)
        body = json.loads(await _read_body(receive))
        status = int(headers.get("x-fake-status", "200"))
        if status != 200:
            extra = [(b"retry-after", b"1"), (b"retry-after-ms", b"1000")] if status in (429, 503) else []
            await _json(send, status, {"error": {"message": "fake refusal"}}, extra)
            return
        interval = float(headers.get("x-fake-token-interval-ms", self.token_interval_s * 1000))
        first = float(headers.get("x-fake-first-token-ms", self.first_token_s * 1000))
        tokens = int(body.get("max_tokens") or 16)
        forced = (body.get("vllm_xargs") or {}).get(OUTPUT_TOKENS_FIELD)
        if forced is not None and (isinstance(forced, bool) or not isinstance(forced, int) or forced < 1):
            # As the testbed's logits processor refuses it (the bench's probe relies on this).
            message = f"vllm_xargs.{OUTPUT_TOKENS_FIELD} must be an integer >= 1, got {forced!r}"
            await _json(send, 400, {"error": {"message": message}}, [])
            return
        if forced is not None:
            tokens = min(tokens, forced)
        elif body.get("logit_bias") and "min_tokens" in body:
            tokens = min(tokens, int(body["min_tokens"]) + 1)
        with_ids = bool(body.get("return_token_ids"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        self.running += 1
        gone = asyncio.Event()
        # Like vLLM, stop generating when the client goes away (it gave up at its deadline).
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        try:
            if first > 0:
                await asyncio.sleep(first / 1000)
            for i in range(tokens):
                if i and interval > 0:
                    await asyncio.sleep(interval / 1000)
                if gone.is_set():
                    return
                last = i == tokens - 1
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if last else None}
                if chat:
                    choice["delta"] = {"content": "" if last else " tok"}
                else:
                    choice["text"] = "" if last else " tok"
                if with_ids:
                    choice["token_ids"] = [FAKE_TOKEN_ID]
                self.generated_tokens += 1
                await _event(send, {"object": "chunk", "choices": [choice]})
            await _event(
                send,
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(str(body.get("prompt", "")).split()),
                        "completion_tokens": tokens,
                    },
                },
            )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            self.running -= 1
            watcher.cancel()


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _event(send: Send, payload: dict[str, Any]) -> None:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _json(
    send: Send, status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(extra or [])],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def _text(send: Send, status: int, text: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; version=0.0.4")],
        }
    )
    await send({"type": "http.response.body", "body": text.encode()})


def _uvicorn_config(app: InstantBackend, **extra: Any) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        lifespan="off",
        ws="none",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
        backlog=4096,
        **extra,
    )


@contextlib.asynccontextmanager
async def serving(app: InstantBackend) -> AsyncIterator[str]:
    """Serve `app` on a free local port inside the current event loop; yields its base URL."""
    import uvicorn

    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted connections of sockets
    # that say they are TCP, and without it small writes wait out delayed ACKs (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(_uvicorn_config(app))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def wait_until_up(base_url: str, timeout_s: float = 20.0, alive: Callable[[], bool] = lambda: True) -> None:
    """Block until `base_url` answers /v1/models (used after spawning a server process);
    RuntimeError when `alive()` says the server process has died, or after `timeout_s`."""
    import httpx

    give_up_at = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise RuntimeError(f"the server for {base_url} exited")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > give_up_at:
            raise RuntimeError(f"{base_url} did not come up")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m bench.instant",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=0.0)
    parser.add_argument("--first-token-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    app = InstantBackend(
        token_interval_s=args.token_interval_ms / 1000,
        first_token_s=args.first_token_ms / 1000,
        keep_headers=0,
    )
    # A full collection would stall every open stream at once (see bench.runner.quiet_gc).
    gc.freeze()
    gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 1_000_000_000)
    uvicorn.Server(_uvicorn_config(app, host="127.0.0.1", port=args.port)).run()


if __name__ == "__main__":
    main()

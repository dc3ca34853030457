"""An instant OpenAI-compatible backend that looks like vLLM to kvgate (benchmark fake).

    .venv/bin/python tests/benchmarks/instant_backend.py --port 8301 [--root MODEL_DIR]

It answers at once, with no model: `POST /v1/chat/completions` and `/v1/completions`, plain
JSON or streamed as server-sent events (one event per token, a usage event when
`stream_options.include_usage` asks, `[DONE]`), each answer `min(max_tokens, 8)` tokens long;
`GET /v1/models` with `max_model_len` and `root` (so kvgate finds a real tokenizer), and a
`/metrics` page with vLLM's names, including `vllm:cache_config_info`, so that kvgate has a
block budget: a pool large enough that every request fits, always idle.

It is a bare asyncio protocol around httptools' parser rather than an ASGI app: the point of
it is to cost as little as possible, so that what a benchmark measures through kvgate is
kvgate. Keep-alive and pipelining work; chunked request bodies are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, cast

import httptools

DEFAULT_MODEL = "instant"
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_BLOCK_SIZE = 16
# 1M tokens of KV cache: the budget never limits a benchmark.
DEFAULT_NUM_BLOCKS = 65536
ANSWER_TOKENS = 8


@dataclass(frozen=True, slots=True)
class BackendConfig:
    model: str = DEFAULT_MODEL
    root: str | None = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = DEFAULT_NUM_BLOCKS


def metrics_text(config: BackendConfig) -> str:
    """An idle vLLM 0.32's /metrics, reduced to what kvgate reads."""
    labels = f'engine="0",model_name="{config.model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} 0.0\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{config.block_size}",engine="0",'
        f'kv_cache_size_tokens="{config.block_size * config.num_blocks}",'
        f'num_gpu_blocks="{config.num_blocks}"}} 1.0\n'
    )


def models_payload(config: BackendConfig) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": config.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": config.root or config.model,
                "parent": None,
                "max_model_len": config.max_model_len,
            }
        ],
    }


def _response(status: int, reason: str, content_type: bytes, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: ".encode()
        + content_type
        + f"\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    )
    return head + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(path: str, body: bytes, model: str) -> bytes:
    """The whole HTTP response to one generation request."""
    try:
        request = json.loads(body)
        if not isinstance(request, dict):
            raise ValueError("not an object")
    except ValueError:
        error = {"error": {"message": "bad JSON", "type": "BadRequestError", "param": None, "code": 400}}
        return _response(400, "Bad Request", b"application/json", json.dumps(error).encode())
    chat = path == "/v1/chat/completions"
    max_tokens = request.get("max_tokens") or request.get("max_completion_tokens") or ANSWER_TOKENS
    tokens = min(int(max_tokens), ANSWER_TOKENS)
    usage = {"prompt_tokens": 1, "total_tokens": 1 + tokens, "completion_tokens": tokens}
    created = int(time.time())
    if not request.get("stream"):
        text = " tok" * tokens
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        payload = {
            "id": "cmpl-instant",
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
        return _response(200, "OK", b"application/json", json.dumps(payload, separators=(",", ":")).encode())
    parts = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    ]
    kind = "chat.completion.chunk" if chat else "text_completion"
    for i in range(tokens):
        last = i == tokens - 1
        delta: dict[str, Any] = (
            {"index": 0, "delta": {"content": " tok"}, "finish_reason": "length" if last else None}
            if chat
            else {"index": 0, "text": " tok", "finish_reason": "length" if last else None}
        )
        event = {"id": "cmpl-instant", "object": kind, "created": created, "model": model, "choices": [delta]}
        parts.append(_chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"))
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        event = {"id": "cmpl-instant", "object": kind, "created": created, "model": model, "choices": []}
        event["usage"] = usage
        parts.append(_chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"))
    parts.append(_chunk(b"data: [DONE]\n\n"))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


class _Connection(asyncio.Protocol):
    """One client connection; httptools calls the `on_*` methods while parsing."""

    def __init__(self, config: BackendConfig, models: bytes, metrics: bytes) -> None:
        self._config = config
        self._models = models
        self._metrics = metrics
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.write(_response(400, "Bad Request", b"text/plain", b"malformed request"))
            self._transport.close()

    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        assert transport is not None
        path = httptools.parse_url(self._url).path.decode("latin-1")
        method = self._parser.get_method()
        if method == b"POST" and path in ("/v1/chat/completions", "/v1/completions"):
            data = answer(path, b"".join(self._body), self._config.model)
        elif method == b"GET" and path == "/v1/models":
            data = self._models
        elif method == b"GET" and path == "/metrics":
            data = self._metrics
        elif method == b"GET" and path == "/health":
            data = _response(200, "OK", b"application/json", b"{}")
        else:
            data = _response(404, "Not Found", b"application/json", b'{"error":{"message":"no route"}}')
        transport.write(data)
        if not self._parser.should_keep_alive():
            transport.close()


async def serve(config: BackendConfig, host: str, port: int) -> asyncio.Server:
    """Start serving on the running loop; returns the server (close it to stop)."""
    models = _response(200, "OK", b"application/json", json.dumps(models_payload(config)).encode())
    metrics = _response(200, "OK", b"text/plain; version=0.0.4; charset=utf-8", metrics_text(config).encode())
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(config, models, metrics), host, port, backlog=4096)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    parser.add_argument("--root", help="what /v1/models reports as the model's folder (the tokenizer)")
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    args = parser.parse_args(argv)
    config = BackendConfig(model=args.model, root=args.root, max_model_len=args.max_model_len)

    async def run() -> None:
        server = await serve(config, args.host, args.port)
        async with server:
            await server.serve_forever()

    try:
        import uvloop

        uvloop.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

"""kvgate's OpenAPI document, including the generation endpoints' request bodies.

The generation routes are plain ASGI apps that read the raw body (the proxy's hot path: no
model validation, the bytes are forwarded untouched), so FastAPI cannot see their bodies. The
models below exist for the document only: they describe what kvgate itself checks (types and
bounds of the fields it reads to count a request's KV blocks) and allow every other field,
which goes to the backend as sent. Every answer kvgate can give is listed, errors in OpenAI's
shape, so that a client generator or a fuzzer built from the document knows them all.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from gateway.client_hints import EXPECTED_OUTPUT_HEADER, MAX_EXPECTED_OUTPUT_TOKENS

_REF = "#/components/schemas/{model}"
_STRING: dict[str, Any] = {"type": "string"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(BaseModel):
    """OpenAI's error shape; every refusal kvgate makes has it."""

    error: ErrorDetail


class _Generation(BaseModel):
    """Fields kvgate reads; any other is passed to the backend untouched."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(
        None, description="A model the backend serves (404 otherwise); default: its first"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Output cap per sequence, at most max_model_len; a sequence also stops at the context "
            "(vLLM >= 0.32; earlier ones refuse prompt + cap > max_model_len). Completions: 16 if absent"
        ),
    )
    min_tokens: int | None = Field(
        None, ge=0, description="Output floor per sequence (<= the cap): reserved whatever kvgate has learned"
    )
    ignore_eos: bool | None = Field(None, description="Run every sequence to its cap: the cap is reserved")
    n: int | None = Field(
        None,
        ge=1,
        description="Sequences per prompt; they share full prompt blocks only with prefix caching and no prompt logprobs",
    )
    best_of: int | None = Field(None, ge=1, description="Counted only for vLLM < 0.32 (0.32 ignores it)")
    stream: bool | None = Field(None, description="Answer as server-sent events")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Takes precedence over max_tokens")


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, texts, token ids, or lists of token ids (one sequence set per prompt)"
    )


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorBody")}}},
    }


_RETRY_HEADERS = {
    "retry-after": {"description": "Seconds to wait before retrying", "schema": {"type": "string"}},
    "retry-after-ms": {"description": "The same, in milliseconds", "schema": {"type": "string"}},
    "x-should-retry": {"description": "true: a retry may succeed", "schema": {"type": "string"}},
}

# Refusals of kvgate's own and answers relayed from the backend, for each kind of endpoint.
GENERATION_ERRORS: dict[str, dict[str, Any]] = {
    "400": _error(
        "Invalid request: bad JSON or fields, a malformed X-Kvgate header, context too long, "
        "larger than the KV pool"
    ),
    "403": _error(
        "Raising priority (X-Kvgate-Priority high, a negative priority) without the priority token"
    ),
    "404": _error("Unknown model"),
    "408": _error("Request body not received within body_timeout_s"),
    "413": _error("Request body larger than max_body_bytes"),
    "429": {**_error("Shed: queue full or deadline out of reach"), "headers": _RETRY_HEADERS},
    "502": _error("The backend failed or broke the connection"),
    "503": {**_error("No backend budget known, backend down, or shutting down"), "headers": _RETRY_HEADERS},
    "504": _error("The backend did not answer in time"),
}
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Admin token missing or wrong"},
    403: {
        "model": ErrorBody,
        "description": "Refused as cross-site, addressed to a non-loopback host without a token, "
        "or a reload without X-Kvgate-Admin",
    },
    404: {"model": ErrorBody, "description": "Admin API off on this bind"},
}
BACKEND_ERRORS: dict[int | str, dict[str, Any]] = {
    502: {"model": ErrorBody, "description": "The backend cannot be reached"},
    504: {"model": ErrorBody, "description": "The backend did not answer in time"},
}


# One server-sent event with the fields the HTML specification gives it.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}


def _generation_operation(summary: str, body_model: type[BaseModel]) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=body_model.__name__)}}},
        },
        "parameters": [
            {"name": name, "in": "header", "required": False, "schema": schema, "description": text}
            for name, schema, text in (
                ("x-kvgate-priority", _STRING, "high, normal (default) or low"),
                ("x-kvgate-deadline-ms", _STRING, "Milliseconds the client waits for the whole answer"),
                ("x-kvgate-ttft-ms", _STRING, "Milliseconds the client waits for the first token"),
                (
                    EXPECTED_OUTPUT_HEADER,
                    {"type": "integer", "minimum": 1, "maximum": MAX_EXPECTED_OUTPUT_TOKENS},
                    "Output tokens per sequence the client expects: reserved instead of kvgate's "
                    "learned length, never below min_tokens (the cap with ignore_eos), never above "
                    "max_tokens or the context; an answer that outgrows it still completes",
                ),
            )
        ],
        "responses": {
            "200": {
                "description": "The backend's answer, relayed byte for byte",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    # One event of the stream, as OpenAPI models server-sent events (on 3.0
                    # and 3.1 the schema of a text/event-stream stands for each event): the
                    # backend's chunks, as JSON in `data`, then `data: [DONE]`.
                    "text/event-stream": {"schema": SSE_EVENT},
                },
            },
            **GENERATION_ERRORS,
        },
    }


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for the routes it knows, plus the generation endpoints."""
    document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorBody, ChatCompletionRequest, CompletionRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    paths = document.setdefault("paths", {})
    paths["/v1/chat/completions"] = {"post": _generation_operation("Chat completion", ChatCompletionRequest)}
    paths["/v1/completions"] = {"post": _generation_operation("Completion", CompletionRequest)}
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve `openapi_document` at the app's openapi_url, built on first use and kept."""
    built: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not built:
            built.append(openapi_document(app))
        return built[0]

    # FastAPI's documented way to extend its schema: replace the app's `openapi` method.
    app.openapi = openapi  # type: ignore[method-assign]

"""The OpenAI surface of the emulator, pure: request bodies in, vLLM-shaped JSON out.

Validation follows vLLM 0.32's OpenAI server where a gateway can observe it (checked against
the testbed): an unknown model is 404; `max_tokens` must be in [1, max_model_len]; a prompt
longer than `max_model_len` is 400 with `param` "input_tokens"; a prompt plus `max_tokens`
beyond `max_model_len` is accepted and generation stops at `max_model_len` ("length").
Completions default to 16 output tokens (OpenAI's default), chat to the rest of the context.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

Prompt tokens come from `estimator.tokens.TokenCounter`: exact with the model's tokenizer,
approximate without one. This module does no I/O; the server runs the counter in a thread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from estimator.tokens import PromptCount, RequestBodyError, Route, TokenCounter
from sim.lengths import OUTPUT_TOKENS_FIELD

# OpenAI's default for /v1/completions, which vLLM keeps.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
SYSTEM_FINGERPRINT = "vllm-0.32.0-kvgate-sim"

# The text of generated tokens: the model is random, so any words do. EOS renders as "".
_WORDS = (" the", " KV", " cache", " holds", " blocks", " of", " tokens", " and", " a", " queue")


class ApiError(Exception):
    """An error answer in OpenAI's JSON shape, with vLLM's `type` names."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return _ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated chat or completions request, reduced to what the engine needs."""

    route: Route
    prompt_tokens: tuple[int, ...]
    # Content identity per prompt, for the engine's prefix cache.
    prompt_keys: tuple[str, ...]
    n: int
    # The client's `max_tokens` (None if absent) and the effective cap per prompt.
    max_tokens_param: int | None
    max_tokens: tuple[int, ...]
    min_tokens: int
    ignore_eos: bool
    eos_bias: float | None
    # The bench's private `vllm_xargs` length (see sim.lengths), None without it.
    forced_length: int | None
    stream: bool
    include_usage: bool

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_tokens) * self.n

    def sequence_prompt(self, index: int) -> int:
        """Which prompt choice `index` answers (vLLM numbers choices prompt-major)."""
        return index // self.n


def count_prompts(counter: TokenCounter, route: Route, body: Mapping[str, Any]) -> PromptCount:
    try:
        return counter.count(route, body)
    except RequestBodyError as exc:
        raise ApiError(400, exc.message, param=exc.param) from exc


def _int_param(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return value


def _bool_param(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean", param=key)
    return value


def check_model(body: Mapping[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {model_name}.", param="model"
        )


def parse_generation_request(
    route: Route,
    body: Mapping[str, Any],
    prompts: PromptCount,
    *,
    max_model_len: int,
    eos_token_id: int,
) -> GenerationRequest:
    """Validate sampling parameters against the counted prompts. Raises ApiError."""
    stream = _bool_param(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, Mapping):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        if not stream:
            raise ApiError(
                400, "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        include_usage = _bool_param(stream_options, "include_usage", False)

    n = _int_param(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.", param="n")

    max_tokens = _int_param(body, "max_tokens")
    if route is Route.CHAT:
        max_completion = _int_param(body, "max_completion_tokens")
        if max_completion is not None:
            max_tokens = max_completion
    if max_tokens is not None:
        if max_tokens < 1:
            raise ApiError(
                400,
                f"max_tokens must be at least 1, got {max_tokens}. "
                f"(parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )
        if max_tokens > max_model_len:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens. "
                f"(parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )

    min_tokens = _int_param(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(
            400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.", param="min_tokens"
        )
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    ignore_eos = _bool_param(body, "ignore_eos", False)
    eos_bias = _eos_bias(body, eos_token_id)
    forced_length = _forced_length(body)

    default_cap = COMPLETIONS_DEFAULT_MAX_TOKENS if route is Route.COMPLETIONS else None
    requested = max_tokens if max_tokens is not None else default_cap
    caps: list[int] = []
    for count in prompts.per_prompt:
        if count > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt contains {count} input tokens, which exceeds this limit even without any "
                f"output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={count})",
                param="input_tokens",
            )
        room = max_model_len - count
        cap = room if requested is None else min(room, requested)
        if cap < 1:
            raise ApiError(
                400,
                f"max_tokens must be at least 1, got {cap}. (parameter=max_tokens, value={cap})",
                param="max_tokens",
            )
        caps.append(cap)

    return GenerationRequest(
        route=route,
        prompt_tokens=prompts.per_prompt,
        prompt_keys=_prompt_keys(route, body, len(prompts.per_prompt)),
        n=n,
        max_tokens_param=max_tokens,
        max_tokens=tuple(caps),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        eos_bias=eos_bias,
        forced_length=forced_length,
        stream=stream,
        include_usage=include_usage,
    )


def _eos_bias(body: Mapping[str, Any], eos_token_id: int) -> float | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ApiError(400, "'logit_bias' must be an object of token id to bias", param="logit_bias")
    value = bias.get(str(eos_token_id))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, "logit_bias values must be numbers", param="logit_bias")
    return float(value)


def _forced_length(body: Mapping[str, Any]) -> int | None:
    """`vllm_xargs.kvgate_bench_output_tokens`, validated as the testbed's processor does."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return None
    if not isinstance(xargs, Mapping):
        raise ApiError(400, "'vllm_xargs' must be an object", param="vllm_xargs")
    if OUTPUT_TOKENS_FIELD not in xargs:
        return None
    value = xargs[OUTPUT_TOKENS_FIELD]
    if isinstance(value, bool):
        value = int(value)  # vLLM's request model reads JSON true as 1, false as 0
    if not isinstance(value, int) or value < 1:
        raise ApiError(
            400,
            f"vllm_xargs.{OUTPUT_TOKENS_FIELD} must be an integer >= 1, got {value!r}",
            param=None,  # the processor's ValueError reaches the client without a param
        )
    return value


def _prompt_keys(route: Route, body: Mapping[str, Any], count: int) -> tuple[str, ...]:
    """A digest per prompt, so that identical prompts share prefix-cache blocks."""
    if route is Route.CHAT:
        parts: list[Any] = [[body.get("messages"), body.get("tools"), body.get("chat_template_kwargs")]]
    else:
        prompt = body.get("prompt")
        is_single = isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
        )
        parts = [prompt] if is_single or not isinstance(prompt, list) else list(prompt)
    if len(parts) != count:
        parts = (parts * count)[:count]
    return tuple(
        hashlib.blake2b(json.dumps(part, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()
        for part in parts
    )


def token_text(num_output: int, is_eos: bool) -> str:
    return "" if is_eos else _WORDS[num_output % len(_WORDS)]


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str | None
    completion_tokens: int


def full_response(
    route: Route,
    response_id: str,
    created: int,
    model: str,
    choices: list[ChoiceResult],
    prompt_tokens: int,
) -> dict[str, Any]:
    """The non-streaming body, shaped like vLLM's."""
    completion_tokens = sum(c.completion_tokens for c in choices)
    if route is Route.CHAT:
        body_choices: list[dict[str, Any]] = [
            {
                "index": c.index,
                "message": {
                    "role": "assistant",
                    "content": c.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": None,
            }
            for c in choices
        ]
        obj = "chat.completion"
    else:
        body_choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            for c in choices
        ]
        obj = "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": body_choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage_json(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
    }


class ChunkEncoder:
    """SSE frames for one streaming response, with the constant JSON prefix built once.

    Every frame is `data: {json}\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. Chat streams
    open each choice with a `{"role": "assistant", "content": ""}` delta, as vLLM does.
    """

    DONE = b"data: [DONE]\n\n"

    def __init__(self, route: Route, response_id: str, created: int, model: str) -> None:
        self._route = route
        obj = "chat.completion.chunk" if route is Route.CHAT else "text_completion"
        self._head = (
            f'data: {{"id":{json.dumps(response_id)},"object":"{obj}","created":{created},'
            f'"model":{json.dumps(model)},"choices":'
        )

    def role(self, index: int) -> bytes:
        choice = (
            f'[{{"index":{index},"delta":{{"role":"assistant","content":""}},'
            '"logprobs":null,"finish_reason":null}]'
        )
        return f"{self._head}{choice}}}\n\n".encode()

    def token(self, index: int, text: str, finish_reason: str | None) -> bytes:
        finish = "null" if finish_reason is None else f'"{finish_reason}"'
        if self._route is Route.CHAT:
            choice = (
                f'[{{"index":{index},"delta":{{"content":{json.dumps(text)}}},'
                f'"logprobs":null,"finish_reason":{finish},"stop_reason":null,"token_ids":null}}]'
            )
        else:
            choice = (
                f'[{{"index":{index},"text":{json.dumps(text)},"logprobs":null,'
                f'"finish_reason":{finish},"stop_reason":null,"prompt_token_ids":null,'
                '"token_ids":null}]'
            )
        return f"{self._head}{choice}}}\n\n".encode()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = json.dumps(
            {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            },
            separators=(",", ":"),
        )
        return (f'{self._head}[],"usage":{usage},"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n').encode()

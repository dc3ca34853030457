"""A request's demand on the KV cache: its prompt, its output cap, and the blocks they take.

`Demand` is a value: the service builds one per request from the body, the exact prompt count
and the output length it expects, and the admission policy weighs it against the budget.

The rules here mirror the backend's own (vLLM 0.32's OpenAI server, `vllm/entrypoints/openai`
and `vllm/sampling_params.py`): a body kvgate refuses is one vLLM refuses, and what a request
reserves is never below what vLLM will allocate for it. The fields read here are validated
with vLLM's own field types (pydantic's lax mode: `"8"`, `8.0` and `true` are integers, `"yes"`
is true), so that kvgate reads the same values vLLM acts on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import TypeAdapter, ValidationError

from estimator.kv import KVCacheLayout, blocks_for_tokens, request_blocks
from estimator.tokens import PromptCount, RequestBodyError, Route

# vLLM's CompletionRequest.max_tokens default (a null max_tokens means it too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The first vLLM whose output cap is an upper bound clamped to the context (prompt + max_tokens
# may exceed it); earlier ones refuse such a request. See `ContextRule`.
CLAMPING_SINCE = (0, 32)


class ContextRule(StrEnum):
    """How the backend weighs prompt + max_tokens against the model's context."""

    # vLLM >= 0.32: `max_tokens` is an upper bound. A sequence stops at the context; refused
    # are only a prompt of max_model_len tokens or more and a max_tokens beyond max_model_len.
    CLAMP = "clamp"
    # Earlier vLLM (and the assumption for them): prompt + max_tokens beyond max_model_len is
    # refused with 400.
    STRICT = "strict"

    @classmethod
    def for_version(cls, version: str | None) -> ContextRule:
        """The rule of a vLLM reporting `version` (its `/version`); an unknown or unparsable
        version gets the current rule: refusing what the backend would serve is the worse
        mistake (a body it refuses costs it nothing)."""
        parsed = _release(version)
        if parsed is None or parsed >= CLAMPING_SINCE:
            return cls.CLAMP
        return cls.STRICT


def _release(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True, slots=True)
class ServingRules:
    """The backend facts a demand depends on, learned at discovery and from /metrics.

    `prefix_caching`: vLLM's prefix cache is on (`vllm:cache_config_info`); only then do the
    parallel samples of one prompt share its full blocks. Unknown counts as off.
    `honours_best_of`: the backend runs `best_of` sequences per prompt (vLLM before the V1
    engine; assumed for every version before 0.32); vLLM 0.32's protocol has no such field
    and ignores it.
    """

    max_model_len: int
    context: ContextRule = ContextRule.CLAMP
    prefix_caching: bool = False
    honours_best_of: bool = False

    @classmethod
    def for_version(cls, version: str | None, max_model_len: int, *, prefix_caching: bool) -> ServingRules:
        """The rules of a backend reporting `version`. Unknown, it gets the current context
        rule but its `best_of` is counted: over-reserving is the safe mistake there."""
        release = _release(version)
        return cls(
            max_model_len=max_model_len,
            context=ContextRule.for_version(version),
            prefix_caching=prefix_caching,
            honours_best_of=release is None or release < CLAMPING_SINCE,
        )


class ContextLengthError(RequestBodyError):
    """The body does not fit the model's context as the backend checks it (HTTP 400,
    `context_length_exceeded`)."""


@dataclass(frozen=True, slots=True)
class BlockCost:
    """How many pool blocks a sequence of a given length holds at its peak.

    With no layout it is plain paged attention, ceil(tokens / block_size); with a layout it
    follows the model's KV groups (sliding windows stop growing at the window).
    """

    block_size: int
    layout: KVCacheLayout | None = None

    def blocks(self, tokens: int) -> int:
        if self.layout is not None and self.layout.block_size == self.block_size:
            return request_blocks(self.layout, tokens)
        return blocks_for_tokens(tokens, self.block_size)

    def shared_prefix_blocks(self, prompt_tokens: int) -> int:
        """Full prompt blocks that parallel samples of one prompt share through vLLM's prefix
        cache. vLLM looks up at most prompt - 1 tokens (the last one is recomputed for its
        logits: `max_cache_hit_length` in v1/core/kv_cache_manager.py), so a prompt that ends
        on a block boundary shares one block less; the rest is held per sequence."""
        if self.layout is not None and self.layout.is_hybrid:
            return 0  # sliding-window groups drop prefix blocks: do not count on sharing them
        return max(0, prompt_tokens - 1) // self.block_size


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request will hold in the KV cache.

    Token counts are per sequence. A completions body may carry several prompts and each prompt
    may be sampled `n` times; vLLM runs every (prompt, sample) pair as its own sequence. A
    sequence never grows past `max_model_len` tokens (vLLM stops it at the context), so a long
    prompt's sequences stop sooner than `max_output_tokens`, the cap of the shortest prompt.
    `shares_prefix`: the samples of one prompt share its full blocks (prefix caching on and
    read by this request). `floor_output_tokens`: what every sequence is certain to produce
    (`min_tokens`, or the cap with `ignore_eos`), <= the expected output.
    """

    prompt_tokens: tuple[int, ...]
    max_output_tokens: int  # the most any sequence may produce (max_tokens, or what fits)
    expected_output_tokens: int  # what the gateway reserves per sequence, <= max_output_tokens
    samples_per_prompt: int
    cost: BlockCost
    shares_prefix: bool = False
    max_model_len: int | None = None
    floor_output_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("a demand needs at least one prompt")
        if not 0 <= self.expected_output_tokens <= self.max_output_tokens:
            raise ValueError("expected output must lie between 0 and the output cap")
        if not 0 <= self.floor_output_tokens <= self.expected_output_tokens:
            raise ValueError("the output floor must lie between 0 and the expected output")
        if self.samples_per_prompt < 1:
            raise ValueError("a demand needs at least one sample per prompt")

    @property
    def sequences(self) -> int:
        return len(self.prompt_tokens) * self.samples_per_prompt

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    def blocks_at(self, output_tokens: int) -> int:
        """Blocks held when every sequence has `output_tokens` output tokens (or has reached
        the context)."""
        total = 0
        for prompt in self.prompt_tokens:
            tokens = prompt + output_tokens
            if self.max_model_len is not None:
                tokens = min(tokens, max(prompt, self.max_model_len))
            shared = (
                self.cost.shared_prefix_blocks(prompt)
                if self.shares_prefix and self.samples_per_prompt > 1
                else 0
            )
            per_sequence = self.cost.blocks(tokens) - shared
            total += shared + self.samples_per_prompt * per_sequence
        return total

    @property
    def prompt_blocks(self) -> int:
        """Blocks held right after prefill."""
        return self.blocks_at(0)

    @property
    def reserved_blocks(self) -> int:
        """Blocks the gateway reserves: prompt plus the expected output."""
        return self.blocks_at(self.expected_output_tokens)

    @property
    def floor_blocks(self) -> int:
        """Blocks the request is certain to come to hold: prompt plus the output floor."""
        return self.blocks_at(self.floor_output_tokens)

    @property
    def max_blocks(self) -> int:
        """Blocks held if every sequence runs to its cap."""
        return self.blocks_at(self.max_output_tokens)


# -- the fields, typed as vLLM 0.32's CompletionRequest / ChatCompletionRequest type them -----

_INT = TypeAdapter(int)
_OPTIONAL_INT = TypeAdapter(int | None)
_BOOL = TypeAdapter(bool)
_OPTIONAL_BOOL = TypeAdapter(bool | None)
_MISSING = object()


def _field(body: Mapping[str, Any], key: str, adapter: TypeAdapter[Any], default: Any) -> Any:
    value = body.get(key, _MISSING)
    if value is _MISSING:
        return default
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        kind = "a boolean" if adapter in (_BOOL, _OPTIONAL_BOOL) else "an integer"
        raise RequestBodyError(f"'{key}' must be {kind}, got {value!r}", key) from exc


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """What the body says about its output, per sequence, once validated.

    `cap`: the most tokens a sequence may produce (the shortest prompt's; longer prompts stop
    at the context first). `floor`: what every sequence is guaranteed to produce: `min_tokens`
    (vLLM holds back EOS, stop tokens and stop strings until then), or the cap with
    `ignore_eos`.
    """

    cap: int
    floor: int


def requested_output(route: Route, body: Mapping[str, Any]) -> tuple[int | None, str]:
    """The client's output cap and the field it came from: chat's `max_completion_tokens`
    takes precedence over `max_tokens`; completions default to 16 tokens (vLLM's default,
    also for a null); chat without either runs to the context."""
    if route is Route.CHAT:
        cap = _field(body, "max_completion_tokens", _OPTIONAL_INT, None)
        if cap is not None:
            return cap, "max_completion_tokens"
        return _field(body, "max_tokens", _OPTIONAL_INT, None), "max_tokens"
    cap = _field(body, "max_tokens", _OPTIONAL_INT, None)
    return (COMPLETIONS_DEFAULT_MAX_TOKENS if cap is None else cap), "max_tokens"


def output_limits(
    route: Route, body: Mapping[str, Any], prompt: PromptCount, rules: ServingRules
) -> OutputLimits:
    """Validate the output fields as the backend does and say what they bound.

    Raises ContextLengthError when the prompt or the cap does not fit the context as
    `rules.context` checks it, RequestBodyError for any other value the backend refuses.
    An estimated prompt count (no tokenizer) may be off either way: nothing is refused on its
    account (the backend, which counts exactly, decides), and it bounds the output at most
    to one token short of the context.
    """
    limit = rules.max_model_len
    requested, param = requested_output(route, body)
    min_tokens = _field(body, "min_tokens", _INT, 0)
    ignore_eos = _field(body, "ignore_eos", _BOOL, False)
    echo = _field(body, "echo", _OPTIONAL_BOOL if route is Route.COMPLETIONS else _BOOL, False)
    prompt_param = "messages" if route is Route.CHAT else "prompt"
    longest, shortest = prompt.longest, min(prompt.per_prompt, default=0)
    if not prompt.exact:
        longest, shortest = min(longest, limit - 1), min(shortest, limit - 1)

    if rules.context is ContextRule.CLAMP and requested is not None and requested > limit:
        # TokenizeParams: checked before the prompt is even tokenized.
        raise ContextLengthError(
            f"{param}={requested} cannot be greater than this model's maximum context length "
            f"({limit} tokens)",
            param,
        )
    if longest >= limit:
        raise ContextLengthError(
            f"this model's maximum context length is {limit} tokens; the prompt has {longest}, "
            "which leaves nothing for the answer",
            prompt_param,
        )
    if (
        rules.context is ContextRule.STRICT
        and prompt.exact
        and requested is not None
        and longest + requested > limit
    ):
        raise ContextLengthError(
            f"this model's maximum context length is {limit} tokens; the prompt has {longest} "
            f"and {param} asks for {requested} more ({longest + requested} in all)",
            param,
        )
    # Each prompt's cap is min(requested, what is left of its context); the tightest is the
    # longest prompt's, and it is what vLLM checks max_tokens >= 1 and min_tokens against.
    tightest = limit - longest if requested is None else min(requested, limit - longest)
    widest = limit - shortest if requested is None else min(requested, limit - shortest)
    if route is Route.COMPLETIONS and echo and requested == 0:
        tightest = widest = 1  # echo without generation: vLLM still samples one token
    if tightest < 1:
        raise RequestBodyError(f"{param} must be at least 1, got {tightest}", param)
    if min_tokens < 0:
        raise RequestBodyError(f"min_tokens must be at least 0, got {min_tokens}", "min_tokens")
    if min_tokens > (tightest if prompt.exact else widest if requested is None else requested):
        raise RequestBodyError(
            f"min_tokens ({min_tokens}) must not exceed the output cap ({tightest} tokens: "
            f"{param}, or what is left of the context)",
            "min_tokens",
        )
    return OutputLimits(cap=widest, floor=widest if ignore_eos else min(min_tokens, widest))


def output_cap(route: Route, body: Mapping[str, Any], prompt: PromptCount, rules: ServingRules) -> int:
    """The most output tokens a sequence of this request may produce (see `output_limits`)."""
    return output_limits(route, body, prompt, rules).cap


def samples_per_prompt(body: Mapping[str, Any], rules: ServingRules | None = None) -> int:
    """Sequences vLLM runs per prompt: `n` (vLLM's V1 engine runs each as its own request),
    or `best_of` when larger on a backend that honours it."""
    n = _field(body, "n", _OPTIONAL_INT, 1)
    n = 1 if n is None else n
    if n < 1:
        raise RequestBodyError(f"'n' must be at least 1, got {n}", "n")
    if rules is None or rules.honours_best_of:
        best_of = _field(body, "best_of", _OPTIONAL_INT, None)
        if best_of is not None and best_of < 1:
            raise RequestBodyError(f"'best_of' must be at least 1, got {best_of}", "best_of")
        n = max(n, best_of or 1)
    return int(n)


def reads_prefix_cache(route: Route, body: Mapping[str, Any]) -> bool:
    """Whether vLLM lets this request's sequences read the prefix cache.

    A request with prompt logprobs skips it (`SamplingParams.skip_reading_prefix_cache`: cached
    blocks would leave prompt positions without logits). `echo` asks for them implicitly:
    completions with `logprobs` set, chat always (its `top_logprobs` is never null).
    """
    if body.get("prompt_logprobs") is not None:
        return False
    if route is Route.CHAT:
        return not _field(body, "echo", _BOOL, False)
    if _field(body, "echo", _OPTIONAL_BOOL, False):
        return body.get("logprobs") is None
    return True


def demand_of(
    route: Route,
    body: Mapping[str, Any],
    prompt: PromptCount,
    *,
    cost: BlockCost,
    rules: ServingRules,
    expected_output_tokens: int,
    limits: OutputLimits | None = None,
) -> Demand:
    """Build a request's `Demand`. The reservation per sequence is `expected_output_tokens`
    lifted to the request's guaranteed floor and capped at its cap."""
    if limits is None:
        limits = output_limits(route, body, prompt, rules)
    expected = min(max(expected_output_tokens, limits.floor, 0), limits.cap)
    return Demand(
        prompt_tokens=prompt.per_prompt,
        max_output_tokens=limits.cap,
        expected_output_tokens=expected,
        samples_per_prompt=samples_per_prompt(body, rules),
        cost=cost,
        shares_prefix=rules.prefix_caching and reads_prefix_cache(route, body),
        max_model_len=rules.max_model_len,
        floor_output_tokens=min(max(limits.floor, 0), expected),
    )

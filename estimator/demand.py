"""A request's demand on the KV cache: its prompt, its output cap, and the blocks they take.

`Demand` is a value: the service builds one per request from the body, the exact prompt count
and the output length it expects, and the admission policy weighs it against the budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from estimator.kv import KVCacheLayout, blocks_for_tokens, request_blocks
from estimator.tokens import PromptCount, RequestBodyError, Route


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
        cache; the partial last block is copied per sequence."""
        if self.layout is not None and self.layout.is_hybrid:
            return 0  # sliding-window groups drop prefix blocks: do not count on sharing them
        return prompt_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request will hold in the KV cache.

    Token counts are per sequence. A completions body may carry several prompts and each prompt
    may be sampled `n` times; vLLM runs every (prompt, sample) pair as its own sequence.
    """

    prompt_tokens: tuple[int, ...]
    max_output_tokens: int  # the client's cap per sequence (max_tokens, or what fits)
    expected_output_tokens: int  # what the gateway reserves per sequence, <= max_output_tokens
    samples_per_prompt: int
    cost: BlockCost

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("a demand needs at least one prompt")
        if not 0 <= self.expected_output_tokens <= self.max_output_tokens:
            raise ValueError("expected output must lie between 0 and the output cap")
        if self.samples_per_prompt < 1:
            raise ValueError("a demand needs at least one sample per prompt")

    @property
    def sequences(self) -> int:
        return len(self.prompt_tokens) * self.samples_per_prompt

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    def blocks_at(self, output_tokens: int) -> int:
        """Blocks held when every sequence has `output_tokens` output tokens."""
        total = 0
        for prompt in self.prompt_tokens:
            shared = self.cost.shared_prefix_blocks(prompt) if self.samples_per_prompt > 1 else 0
            per_sequence = self.cost.blocks(prompt + output_tokens) - shared
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
    def max_blocks(self) -> int:
        """Blocks held if every sequence runs to its cap."""
        return self.blocks_at(self.max_output_tokens)


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestBodyError(f"'{key}' must be an integer", key)
    if value < 1:
        raise RequestBodyError(f"'{key}' must be at least 1, got {value}", key)
    return value


def output_cap(route: Route, body: Mapping[str, Any], longest_prompt: int, max_model_len: int) -> int:
    """The most output tokens a sequence of this request may produce.

    `max_completion_tokens` (chat) takes precedence over `max_tokens`; without either vLLM lets a
    sequence run to the context limit. A cap that does not fit beside the prompt is refused, as
    vLLM refuses it.
    """
    cap = _positive_int(body, "max_completion_tokens") if route is Route.CHAT else None
    if cap is None:
        cap = _positive_int(body, "max_tokens")
    room = max_model_len - longest_prompt
    if room < 1:
        raise RequestBodyError(
            f"the prompt has {longest_prompt} tokens but the model's context is {max_model_len} "
            "tokens: nothing is left for the answer",
            "messages" if route is Route.CHAT else "prompt",
        )
    if cap is None:
        return room
    if cap > room:
        raise RequestBodyError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{longest_prompt} and max_tokens asks for {cap} more ({longest_prompt + cap} in all)",
            "max_tokens",
        )
    return cap


def samples_per_prompt(body: Mapping[str, Any]) -> int:
    """Sequences vLLM runs per prompt: `n`, or `best_of` when larger (each keeps its own KV)."""
    n = _positive_int(body, "n") or 1
    best_of = _positive_int(body, "best_of") or 1
    return max(n, best_of)


def demand_of(
    route: Route,
    body: Mapping[str, Any],
    prompt: PromptCount,
    *,
    cost: BlockCost,
    max_model_len: int,
    expected_output_tokens: int,
) -> Demand:
    """Build a request's `Demand`; `expected_output_tokens` is capped at the request's own cap."""
    cap = output_cap(route, body, prompt.longest, max_model_len)
    return Demand(
        prompt_tokens=prompt.per_prompt,
        max_output_tokens=cap,
        expected_output_tokens=max(0, min(expected_output_tokens, cap)),
        samples_per_prompt=samples_per_prompt(body),
        cost=cost,
    )

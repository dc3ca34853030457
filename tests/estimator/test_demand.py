"""Demand: output caps and floors as vLLM validates them, samples, blocks with and without
shared prompt prefixes.

The expected refusals and caps are those of vLLM 0.32 (checked against the testbed by
tests/gateway/test_gw_vllm_validation.py); the strict rule is the one of earlier versions.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.demand import (
    BlockCost,
    ContextLengthError,
    ContextRule,
    Demand,
    OutputLimits,
    ServingRules,
    demand_of,
    output_limits,
    reads_prefix_cache,
    samples_per_prompt,
)
from estimator.kv import blocks_for_tokens
from estimator.tokens import PromptCount, RequestBodyError, Route

COST = BlockCost(block_size=16)
CLAMP = ServingRules(max_model_len=1024)
STRICT = ServingRules(max_model_len=1024, context=ContextRule.STRICT, honours_best_of=True)


def prompts(*counts: int) -> PromptCount:
    return PromptCount(per_prompt=counts, exact=True)


@pytest.mark.parametrize(
    ("route", "body", "prompt", "expected"),
    [
        (Route.COMPLETIONS, {"max_tokens": 10}, (100,), OutputLimits(10, 0)),
        (Route.COMPLETIONS, {}, (100,), OutputLimits(16, 0)),  # vLLM's completions default
        (Route.COMPLETIONS, {"max_tokens": None}, (100,), OutputLimits(16, 0)),  # so is a null
        (Route.CHAT, {}, (100,), OutputLimits(924, 0)),  # chat: whatever fits in the context
        (Route.CHAT, {"max_completion_tokens": 5, "max_tokens": 50}, (10,), OutputLimits(5, 0)),
        (Route.CHAT, {"max_completion_tokens": None, "max_tokens": 50}, (10,), OutputLimits(50, 0)),
        (Route.COMPLETIONS, {"max_tokens": 924}, (100,), OutputLimits(924, 0)),  # fills the context
        # Beyond the context: served, and the sequence stops there.
        (Route.COMPLETIONS, {"max_tokens": 400}, (900,), OutputLimits(124, 0)),
        (Route.COMPLETIONS, {"max_tokens": 1024}, (1,), OutputLimits(1023, 0)),
        (Route.COMPLETIONS, {"max_tokens": 1}, (1023,), OutputLimits(1, 0)),
        # Several prompts: the cap is the shortest prompt's; longer ones stop at the context.
        (Route.COMPLETIONS, {"max_tokens": 100}, (10, 1000), OutputLimits(100, 0)),
        # Floors: min_tokens, and the cap itself with ignore_eos.
        (Route.COMPLETIONS, {"max_tokens": 30, "min_tokens": 24}, (1000,), OutputLimits(24, 24)),
        (Route.COMPLETIONS, {"max_tokens": 50, "min_tokens": 20}, (10,), OutputLimits(50, 20)),
        (Route.COMPLETIONS, {"max_tokens": 50, "ignore_eos": True}, (10,), OutputLimits(50, 50)),
        (Route.COMPLETIONS, {"max_tokens": 400, "ignore_eos": True}, (900,), OutputLimits(124, 124)),
        (Route.CHAT, {"ignore_eos": True}, (24,), OutputLimits(1000, 1000)),
        (Route.COMPLETIONS, {"min_tokens": 16}, (10,), OutputLimits(16, 16)),
        # Echo without generation still samples one token.
        (Route.COMPLETIONS, {"max_tokens": 0, "echo": True}, (1023,), OutputLimits(1, 0)),
        # vLLM's field types are lax, and kvgate reads what vLLM reads.
        (Route.COMPLETIONS, {"max_tokens": "12"}, (10,), OutputLimits(12, 0)),
        (Route.COMPLETIONS, {"max_tokens": 2.0}, (10,), OutputLimits(2, 0)),
        (Route.COMPLETIONS, {"max_tokens": True}, (10,), OutputLimits(1, 0)),
        (Route.COMPLETIONS, {"max_tokens": 9, "ignore_eos": "yes"}, (10,), OutputLimits(9, 9)),
        (Route.COMPLETIONS, {"max_tokens": 9, "ignore_eos": "false"}, (10,), OutputLimits(9, 0)),
        (Route.COMPLETIONS, {"max_tokens": 9, "min_tokens": "3"}, (10,), OutputLimits(9, 3)),
    ],
)
def test_output_limits(
    route: Route, body: dict[str, Any], prompt: tuple[int, ...], expected: OutputLimits
) -> None:
    assert output_limits(route, body, prompts(*prompt), CLAMP) == expected


@pytest.mark.parametrize(
    ("route", "body", "prompt", "param", "context"),
    [
        (Route.COMPLETIONS, {"max_tokens": 0}, (10,), "max_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": -3}, (10,), "max_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": "twelve"}, (10,), "max_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": 1.5}, (10,), "max_tokens", False),
        (Route.CHAT, {"max_completion_tokens": 0, "max_tokens": 5}, (10,), "max_completion_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": 1025}, (10,), "max_tokens", True),  # > max_model_len
        (Route.CHAT, {"max_completion_tokens": 1025}, (10,), "max_completion_tokens", True),
        (Route.CHAT, {"max_tokens": 2000}, (10,), "max_tokens", True),
        (Route.COMPLETIONS, {}, (1024,), "prompt", True),  # the prompt alone fills the context
        (Route.CHAT, {}, (1024,), "messages", True),
        (Route.COMPLETIONS, {"max_tokens": 1}, (10, 1024), "prompt", True),
        (Route.COMPLETIONS, {"max_tokens": 0, "echo": True}, (1024,), "prompt", True),
        (Route.COMPLETIONS, {"max_tokens": 5, "min_tokens": 6}, (10,), "min_tokens", False),
        (Route.COMPLETIONS, {"min_tokens": 17}, (10,), "min_tokens", False),  # default cap 16
        (Route.COMPLETIONS, {"max_tokens": 30, "min_tokens": 25}, (1000,), "min_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": 30, "min_tokens": 25}, (10, 1000), "min_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": 5, "min_tokens": -1}, (10,), "min_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": 5, "min_tokens": None}, (10,), "min_tokens", False),
        (Route.COMPLETIONS, {"max_tokens": 5, "ignore_eos": None}, (10,), "ignore_eos", False),
        (Route.COMPLETIONS, {"max_tokens": 5, "ignore_eos": "perhaps"}, (10,), "ignore_eos", False),
    ],
)
def test_output_limit_refusals(
    route: Route, body: dict[str, Any], prompt: tuple[int, ...], param: str, context: bool
) -> None:
    with pytest.raises(RequestBodyError) as error:
        output_limits(route, body, prompts(*prompt), CLAMP)
    assert error.value.param == param
    assert isinstance(error.value, ContextLengthError) is context


@pytest.mark.parametrize(
    ("body", "counts", "expected"),
    [
        ({"max_tokens": 30}, (1500,), OutputLimits(1, 0)),  # an estimate past the context
        ({"max_tokens": 30, "min_tokens": 20}, (1010,), OutputLimits(14, 14)),
        ({"max_tokens": 30, "min_tokens": 20, "ignore_eos": True}, (10, 2000), OutputLimits(30, 30)),
        ({}, (1100,), OutputLimits(1, 0)),
    ],
)
def test_an_estimated_prompt_refuses_nothing_on_its_own_account(
    body: dict[str, Any], counts: tuple[int, ...], expected: OutputLimits
) -> None:
    # Counted without a tokenizer the prompt may be shorter than it seems: vLLM decides.
    estimate = PromptCount(per_prompt=counts, exact=False)
    assert output_limits(Route.COMPLETIONS, body, estimate, CLAMP) == expected
    assert output_limits(Route.COMPLETIONS, body, estimate, STRICT) == expected
    # A cap beyond the context does not depend on the prompt: refused all the same.
    with pytest.raises(ContextLengthError):
        output_limits(Route.COMPLETIONS, {"max_tokens": 1025}, estimate, CLAMP)


@pytest.mark.parametrize(
    ("body", "prompt", "expected"),
    [
        ({"max_tokens": 924}, 100, 924),
        ({"max_tokens": 10}, 100, 10),
        ({}, 100, 16),
    ],
)
def test_strict_rule_caps(body: dict[str, Any], prompt: int, expected: int) -> None:
    assert output_limits(Route.COMPLETIONS, body, prompts(prompt), STRICT).cap == expected


@pytest.mark.parametrize(
    ("body", "prompt"), [({"max_tokens": 925}, 100), ({"max_tokens": 400}, 900), ({}, 1020)]
)
def test_strict_rule_refuses_what_does_not_fit(body: dict[str, Any], prompt: int) -> None:
    with pytest.raises(ContextLengthError):
        output_limits(Route.COMPLETIONS, body, prompts(prompt), STRICT)


@pytest.mark.parametrize(
    ("version", "rule"),
    [
        ("0.32.0", ContextRule.CLAMP),
        ("0.33.1rc1.dev4+g1234", ContextRule.CLAMP),
        ("1.0.0", ContextRule.CLAMP),
        ("0.31.9", ContextRule.STRICT),
        ("0.11.0", ContextRule.STRICT),
        ("v0.8.5.post1", ContextRule.STRICT),
        (None, ContextRule.CLAMP),  # unknown: the current rule
        ("dev", ContextRule.CLAMP),
    ],
)
def test_context_rule_follows_the_backend_version(version: str | None, rule: ContextRule) -> None:
    assert ContextRule.for_version(version) is rule
    rules = ServingRules.for_version(version, 1024, prefix_caching=True)
    # best_of is counted unless the backend is known to ignore it.
    assert rules.honours_best_of is (rule is ContextRule.STRICT or version in (None, "dev"))


@pytest.mark.parametrize(
    ("body", "rules", "expected"),
    [
        ({}, CLAMP, 1),
        ({"n": 3}, CLAMP, 3),
        ({"n": "3"}, CLAMP, 3),
        ({"n": None}, CLAMP, 1),
        ({"n": 2, "best_of": 5}, CLAMP, 2),  # vLLM 0.32 has no best_of: it runs n
        ({"n": 2, "best_of": 5}, STRICT, 5),  # earlier ones ran best_of sequences
        ({"best_of": 1, "n": 4}, STRICT, 4),
    ],
)
def test_samples_per_prompt(body: dict[str, Any], rules: ServingRules, expected: int) -> None:
    assert samples_per_prompt(body, rules) == expected


@pytest.mark.parametrize("body", [{"n": 0}, {"n": -2}, {"n": "many"}, {"n": 1.5}])
def test_samples_per_prompt_refusals(body: dict[str, Any]) -> None:
    with pytest.raises(RequestBodyError) as error:
        samples_per_prompt(body, CLAMP)
    assert error.value.param == "n"


@pytest.mark.parametrize(
    ("route", "body", "reads"),
    [
        (Route.COMPLETIONS, {}, True),
        (Route.COMPLETIONS, {"logprobs": 2}, True),
        (Route.COMPLETIONS, {"echo": True}, True),
        (Route.COMPLETIONS, {"echo": True, "logprobs": 0}, False),  # echo + logprobs: prompt logprobs
        (Route.COMPLETIONS, {"prompt_logprobs": 0}, False),
        (Route.COMPLETIONS, {"prompt_logprobs": 1}, False),
        (Route.CHAT, {}, True),
        (Route.CHAT, {"echo": True}, False),  # chat's echo asks for prompt logprobs (top_logprobs)
        (Route.CHAT, {"prompt_logprobs": 0}, False),
        (Route.CHAT, {"logprobs": True, "top_logprobs": 2}, True),
    ],
)
def test_reads_prefix_cache(route: Route, body: dict[str, Any], reads: bool) -> None:
    assert reads_prefix_cache(route, body) is reads


def test_parallel_samples_share_full_prompt_blocks() -> None:
    # 40-token prompt = 2 full blocks shared + a partial block copied per sample.
    demand = Demand(
        prompt_tokens=(40,),
        max_output_tokens=20,
        expected_output_tokens=20,
        samples_per_prompt=3,
        cost=COST,
        shares_prefix=True,
    )
    per_sample = blocks_for_tokens(60, 16) - 2
    assert demand.reserved_blocks == 2 + 3 * per_sample
    assert demand.sequences == 3


def test_a_prompt_on_a_block_boundary_shares_one_block_less() -> None:
    # vLLM looks up prompt - 1 tokens in the cache: of a 32-token prompt only block 1 is shared.
    assert COST.shared_prefix_blocks(32) == 1
    assert COST.shared_prefix_blocks(33) == 2
    assert COST.shared_prefix_blocks(1) == 0
    demand = Demand((32,), 16, 16, samples_per_prompt=2, cost=COST, shares_prefix=True)
    assert demand.reserved_blocks == 1 + 2 * (3 - 1)


def test_without_sharing_every_sample_holds_its_prompt() -> None:
    shared = Demand((40,), 20, 20, samples_per_prompt=3, cost=COST, shares_prefix=True)
    alone = Demand((40,), 20, 20, samples_per_prompt=3, cost=COST, shares_prefix=False)
    assert alone.reserved_blocks == 3 * blocks_for_tokens(60, 16)
    assert alone.reserved_blocks - shared.reserved_blocks == 2 * 2


@pytest.mark.parametrize(
    ("route", "body", "caching", "shares"),
    [
        (Route.COMPLETIONS, {"n": 2}, True, True),
        (Route.COMPLETIONS, {"n": 2}, False, False),  # prefix caching off on the backend
        (Route.COMPLETIONS, {"n": 2, "prompt_logprobs": 1}, True, False),
        (Route.COMPLETIONS, {"n": 2, "echo": True, "logprobs": 1}, True, False),
        (Route.CHAT, {"n": 2, "echo": True}, True, False),
    ],
)
def test_demand_shares_prefix_only_as_vllm_does(
    route: Route, body: dict[str, Any], caching: bool, shares: bool
) -> None:
    rules = ServingRules(max_model_len=1024, prefix_caching=caching)
    demand = demand_of(
        route, {"max_tokens": 8, **body}, prompts(40), cost=COST, rules=rules, expected_output_tokens=8
    )
    assert demand.shares_prefix is shares
    # 48 tokens: 3 blocks a sequence, of which the first 2 are shared when they can be.
    assert demand.reserved_blocks == (2 + 2 * 1 if shares else 2 * 3)


def test_several_prompts_each_take_their_own_blocks() -> None:
    demand = demand_of(
        Route.COMPLETIONS,
        {"max_tokens": 8},
        prompts(10, 30),
        cost=COST,
        rules=CLAMP,
        expected_output_tokens=4,
    )
    assert demand.prompt_blocks == blocks_for_tokens(10, 16) + blocks_for_tokens(30, 16)
    assert demand.reserved_blocks == blocks_for_tokens(14, 16) + blocks_for_tokens(34, 16)
    assert demand.max_blocks == blocks_for_tokens(18, 16) + blocks_for_tokens(38, 16)


def test_a_long_prompt_stops_at_the_context() -> None:
    # 10 + 100 and 1000 + 24 (the context), not 1000 + 100.
    demand = demand_of(
        Route.COMPLETIONS,
        {"max_tokens": 100, "ignore_eos": True},
        prompts(10, 1000),
        cost=COST,
        rules=CLAMP,
        expected_output_tokens=0,
    )
    assert (
        demand.reserved_blocks
        == demand.max_blocks
        == blocks_for_tokens(110, 16) + blocks_for_tokens(1024, 16)
    )


def test_expected_output_is_capped_by_the_request() -> None:
    demand = demand_of(
        Route.CHAT, {"max_tokens": 5}, prompts(10), cost=COST, rules=CLAMP, expected_output_tokens=500
    )
    assert demand.expected_output_tokens == 5


@pytest.mark.parametrize(
    ("body", "predicted", "expected"),
    [
        ({"max_tokens": 100, "min_tokens": 40}, 10, 40),  # the floor lifts a short prediction
        ({"max_tokens": 100, "min_tokens": 40}, 70, 70),  # and leaves a longer one alone
        ({"max_tokens": 100, "ignore_eos": True}, 10, 100),  # ignore_eos: the cap
        ({"max_tokens": 100}, 10, 10),
    ],
)
def test_expected_output_is_never_below_the_guaranteed_floor(
    body: dict[str, Any], predicted: int, expected: int
) -> None:
    demand = demand_of(
        Route.COMPLETIONS, body, prompts(10), cost=COST, rules=CLAMP, expected_output_tokens=predicted
    )
    assert demand.expected_output_tokens == expected


@given(
    prompt_lengths=st.lists(st.integers(1, 1023), min_size=1, max_size=4),
    max_tokens=st.one_of(st.none(), st.integers(-2, 1100)),
    min_tokens=st.integers(-1, 1100),
    ignore_eos=st.booleans(),
    predicted=st.integers(0, 1100),
    n=st.integers(1, 4),
    caching=st.booleans(),
)
def test_reservation_covers_every_guaranteed_token(
    prompt_lengths: list[int],
    max_tokens: int | None,
    min_tokens: int,
    ignore_eos: bool,
    predicted: int,
    n: int,
    caching: bool,
) -> None:
    # Whatever is accepted reserves at least prompt + floor for every sequence, never more
    # than the context holds, and never more than the cap.
    body: dict[str, Any] = {"min_tokens": min_tokens, "ignore_eos": ignore_eos, "n": n}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    rules = ServingRules(max_model_len=1024, prefix_caching=caching)
    count = prompts(*prompt_lengths)
    try:
        limits = output_limits(Route.COMPLETIONS, body, count, rules)
    except RequestBodyError:
        return
    demand = demand_of(
        Route.COMPLETIONS,
        body,
        count,
        cost=COST,
        rules=rules,
        expected_output_tokens=predicted,
        limits=limits,
    )
    floor = limits.cap if ignore_eos else min_tokens
    unshared = sum(blocks_for_tokens(min(p + floor, 1024), 16) for p in prompt_lengths)
    shared_at_most = sum(COST.shared_prefix_blocks(p) * (n - 1) for p in prompt_lengths) if caching else 0
    assert demand.reserved_blocks >= n * unshared - shared_at_most
    assert demand.max_blocks <= n * sum(blocks_for_tokens(1024, 16) for _ in prompt_lengths)
    assert floor <= demand.expected_output_tokens <= limits.cap
    assert demand.floor_output_tokens == floor  # what the budget counts as certain to be held
    assert demand.floor_blocks <= demand.reserved_blocks


@given(
    prompts_=st.lists(st.integers(1, 900), min_size=1, max_size=4),
    cap=st.integers(1, 100),
    expected=st.integers(0, 100),
    samples=st.integers(1, 4),
    block_size=st.sampled_from([1, 8, 16, 32]),
    shares=st.booleans(),
)
def test_blocks_ordered_prompt_reserved_max(
    prompts_: list[int], cap: int, expected: int, samples: int, block_size: int, shares: bool
) -> None:
    demand = Demand(
        prompt_tokens=tuple(prompts_),
        max_output_tokens=cap,
        expected_output_tokens=min(expected, cap),
        samples_per_prompt=samples,
        cost=BlockCost(block_size),
        shares_prefix=shares,
    )
    assert demand.prompt_blocks <= demand.reserved_blocks <= demand.max_blocks
    # Never less than what the longest sequence alone needs.
    assert demand.max_blocks >= blocks_for_tokens(max(prompts_) + cap, block_size)

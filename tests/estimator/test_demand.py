"""Demand: output caps, samples, blocks with and without shared prompt prefixes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.demand import BlockCost, Demand, demand_of, output_cap, samples_per_prompt
from estimator.kv import blocks_for_tokens
from estimator.tokens import PromptCount, RequestBodyError, Route

COST = BlockCost(block_size=16)


@pytest.mark.parametrize(
    ("route", "body", "prompt", "expected"),
    [
        (Route.COMPLETIONS, {"max_tokens": 10}, 100, 10),
        (Route.COMPLETIONS, {}, 100, 924),  # no cap: whatever fits in the context
        (Route.CHAT, {"max_completion_tokens": 5, "max_tokens": 50}, 10, 5),
        (Route.CHAT, {"max_tokens": 50}, 10, 50),
        (Route.COMPLETIONS, {"max_tokens": 924}, 100, 924),  # exactly fills the context
    ],
)
def test_output_cap(route: Route, body: dict[str, Any], prompt: int, expected: int) -> None:
    assert output_cap(route, body, prompt, max_model_len=1024) == expected


@pytest.mark.parametrize(
    ("body", "prompt", "param"),
    [
        ({"max_tokens": 0}, 10, "max_tokens"),
        ({"max_tokens": -3}, 10, "max_tokens"),
        ({"max_tokens": "12"}, 10, "max_tokens"),
        ({"max_tokens": 1.5}, 10, "max_tokens"),
        ({"max_tokens": True}, 10, "max_tokens"),
        ({"max_tokens": 925}, 100, "max_tokens"),  # one past the context
        ({}, 1024, "prompt"),  # the prompt alone fills the context
    ],
)
def test_output_cap_refusals(body: dict[str, Any], prompt: int, param: str) -> None:
    with pytest.raises(RequestBodyError) as error:
        output_cap(Route.COMPLETIONS, body, prompt, max_model_len=1024)
    assert error.value.param == param


@pytest.mark.parametrize(
    ("body", "expected"), [({}, 1), ({"n": 3}, 3), ({"n": 2, "best_of": 5}, 5), ({"best_of": 1, "n": 4}, 4)]
)
def test_samples_per_prompt(body: dict[str, Any], expected: int) -> None:
    assert samples_per_prompt(body) == expected


def test_parallel_samples_share_full_prompt_blocks() -> None:
    # 40-token prompt = 2 full blocks shared + a partial block copied per sample.
    demand = Demand(
        prompt_tokens=(40,), max_output_tokens=20, expected_output_tokens=20, samples_per_prompt=3, cost=COST
    )
    per_sample = blocks_for_tokens(60, 16) - 2
    assert demand.reserved_blocks == 2 + 3 * per_sample
    assert demand.sequences == 3


def test_several_prompts_each_take_their_own_blocks() -> None:
    demand = demand_of(
        Route.COMPLETIONS,
        {"max_tokens": 8},
        PromptCount(per_prompt=(10, 30), exact=True),
        cost=COST,
        max_model_len=1024,
        expected_output_tokens=4,
    )
    assert demand.prompt_blocks == blocks_for_tokens(10, 16) + blocks_for_tokens(30, 16)
    assert demand.reserved_blocks == blocks_for_tokens(14, 16) + blocks_for_tokens(34, 16)
    assert demand.max_blocks == blocks_for_tokens(18, 16) + blocks_for_tokens(38, 16)


def test_expected_output_is_capped_by_the_request() -> None:
    demand = demand_of(
        Route.CHAT,
        {"max_tokens": 5},
        PromptCount((10,), True),
        cost=COST,
        max_model_len=1024,
        expected_output_tokens=500,
    )
    assert demand.expected_output_tokens == 5


@given(
    prompts=st.lists(st.integers(1, 900), min_size=1, max_size=4),
    cap=st.integers(1, 100),
    expected=st.integers(0, 100),
    samples=st.integers(1, 4),
    block_size=st.sampled_from([1, 8, 16, 32]),
)
def test_blocks_ordered_prompt_reserved_max(
    prompts: list[int], cap: int, expected: int, samples: int, block_size: int
) -> None:
    demand = Demand(
        prompt_tokens=tuple(prompts),
        max_output_tokens=cap,
        expected_output_tokens=min(expected, cap),
        samples_per_prompt=samples,
        cost=BlockCost(block_size),
    )
    assert demand.prompt_blocks <= demand.reserved_blocks <= demand.max_blocks
    # Never less than what the longest sequence alone needs.
    assert demand.max_blocks >= blocks_for_tokens(max(prompts) + cap, block_size)

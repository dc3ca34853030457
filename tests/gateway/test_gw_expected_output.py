"""The output length a client tells (X-Kvgate-Expected-Output-Tokens) and the reservation it
makes: it replaces the learned length, within what the body guarantees and allows."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.demand import BlockCost, Demand, ServingRules, demand_of, output_limits
from estimator.kv import blocks_for_tokens
from estimator.tokens import PromptCount, RequestBodyError, Route
from gateway.output_model import (
    TOLD_MAX_OUTGROWN_SHARE,
    TOLD_MIN_SAMPLES,
    TOLD_WINDOW,
    OutputKey,
    OutputLengthModel,
    OutputPrediction,
    PredictionSource,
    output_reservation,
)

KEY = OutputKey("m", "completions")
BLOCK = 16
COST = BlockCost(block_size=BLOCK)
RULES = ServingRules(max_model_len=1024)


def learned(*lengths: int) -> OutputLengthModel:
    """A model that has learned `lengths` (at least min_samples of them: it predicts)."""
    model = OutputLengthModel(quantile=0.9, min_samples=3, window=10)
    for tokens in lengths:
        model.observe(KEY, tokens)
    return model


@pytest.mark.parametrize(
    ("model", "cap", "floor", "told", "expected"),
    [
        # Told: what the client said, below or above what was learned.
        (learned(100, 100, 100), 500, 0, 8, OutputPrediction(8, PredictionSource.CLIENT, 0, None)),
        (learned(10, 10, 10), 500, 0, 300, OutputPrediction(300, PredictionSource.CLIENT, 0, None)),
        # Told a cold model: the cap is not what it reserves.
        (learned(), 500, 0, 8, OutputPrediction(8, PredictionSource.CLIENT, 0, None)),
        # Capped by the request's cap (max_tokens, or what the context leaves).
        (learned(), 50, 0, 300, OutputPrediction(50, PredictionSource.CLIENT, 0, None)),
        # Never below what the request guarantees (min_tokens; with ignore_eos the floor is the cap).
        (learned(), 500, 40, 8, OutputPrediction(40, PredictionSource.FLOOR, 0, None)),
        (learned(), 64, 64, 8, OutputPrediction(64, PredictionSource.FLOOR, 0, None)),
        (learned(), 500, 40, 40, OutputPrediction(40, PredictionSource.CLIENT, 0, None)),
        # Not told: the model's prediction, as before.
        (learned(100, 100, 100), 500, 0, None, OutputPrediction(100, PredictionSource.LEARNED, 3, KEY)),
        (learned(100, 100, 100), 500, 120, None, OutputPrediction(120, PredictionSource.FLOOR, 3, None)),
        (learned(), 500, 0, None, OutputPrediction(500, PredictionSource.COLD, 0, None)),
    ],
)
def test_output_reservation(
    model: OutputLengthModel, cap: int, floor: int, told: int | None, expected: OutputPrediction
) -> None:
    assert output_reservation(model, KEY, cap=cap, floor=floor, told=told) == expected


def told_demand(route: Route, body: dict[str, Any], prompt: tuple[int, ...], told: int | None) -> Demand:
    """The demand of a request that told `told`, in front of a model that has learned
    100-token answers (the path of `Router.prepare`)."""
    count = PromptCount(per_prompt=prompt, exact=True)
    limits = output_limits(route, body, count, RULES)
    model = learned(100, 100, 100)
    prediction = output_reservation(model, KEY, cap=limits.cap, floor=limits.floor, told=told)
    return demand_of(
        route, body, count, cost=COST, rules=RULES, expected_output_tokens=prediction.tokens, limits=limits
    )


@pytest.mark.parametrize(
    ("route", "body", "prompt", "told", "expected"),
    [
        # 40 prompt tokens and 8 told: 3 blocks, where the learned 100 take 9.
        (Route.COMPLETIONS, {"max_tokens": 500}, (40,), 8, (8, 3)),
        (Route.COMPLETIONS, {"max_tokens": 500}, (40,), None, (100, 9)),
        (Route.CHAT, {}, (40,), 8, (8, 3)),
        # Per sequence: n samples and several prompts each reserve what was told.
        (Route.COMPLETIONS, {"max_tokens": 500, "n": 3}, (40,), 8, (8, 9)),
        (Route.COMPLETIONS, {"max_tokens": 500}, (40, 72), 8, (8, 3 + 5)),
        # Capped by max_tokens, and each sequence by the context (1,000 + 24, not + 100).
        (Route.COMPLETIONS, {"max_tokens": 20}, (40,), 100, (20, 4)),
        (Route.COMPLETIONS, {"max_tokens": 100}, (1000,), 100, (24, 64)),
        (Route.CHAT, {}, (1000,), 900, (24, 64)),
        # Floored by what vLLM is bound to produce: min_tokens, or the cap with ignore_eos.
        (Route.COMPLETIONS, {"max_tokens": 500, "min_tokens": 60}, (40,), 8, (60, 7)),
        (Route.COMPLETIONS, {"max_tokens": 60, "ignore_eos": True}, (40,), 8, (60, 7)),
        (Route.CHAT, {"max_completion_tokens": 60, "min_tokens": 60}, (40,), 8, (60, 7)),
    ],
)
def test_the_demand_of_a_told_length(
    route: Route, body: dict[str, Any], prompt: tuple[int, ...], told: int | None, expected: tuple[int, int]
) -> None:
    demand = told_demand(route, body, prompt, told)
    assert (demand.expected_output_tokens, demand.reserved_blocks) == expected


@given(
    prompt_lengths=st.lists(st.integers(1, 1023), min_size=1, max_size=4),
    max_tokens=st.one_of(st.none(), st.integers(1, 1024)),
    min_tokens=st.integers(0, 1024),
    ignore_eos=st.booleans(),
    n=st.integers(1, 4),
    told=st.integers(1, 10_000_000),
    route=st.sampled_from(Route),
)
def test_a_told_length_never_reserves_less_than_vllm_allocates(
    prompt_lengths: list[int],
    max_tokens: int | None,
    min_tokens: int,
    ignore_eos: bool,
    n: int,
    told: int,
    route: Route,
) -> None:
    # Whatever a client tells, the reservation holds every token vLLM is bound to produce
    # (prompt + floor per sequence), and no more than the body and the context allow.
    if route is Route.CHAT:
        prompt_lengths = prompt_lengths[:1]
    body: dict[str, Any] = {"min_tokens": min_tokens, "ignore_eos": ignore_eos, "n": n}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    prompt = tuple(prompt_lengths)
    try:
        limits = output_limits(route, body, PromptCount(per_prompt=prompt, exact=True), RULES)
    except RequestBodyError:
        return
    demand = told_demand(route, body, prompt, told)
    assert demand.expected_output_tokens == max(limits.floor, min(told, limits.cap))
    guaranteed = n * sum(blocks_for_tokens(min(p + limits.floor, 1024), BLOCK) for p in prompt_lengths)
    assert demand.reserved_blocks >= guaranteed
    assert demand.reserved_blocks == demand.blocks_at(demand.expected_output_tokens) <= demand.max_blocks


def test_told_lengths_that_answers_keep_outgrowing_stop_lowering_reservations() -> None:
    model = learned(100, 100, 100)  # predicts 100
    # Honest so far: told 8 is reserved as told.
    for _ in range(TOLD_MIN_SAMPLES):
        model.observe_told(KEY, 8, 8)
    assert output_reservation(model, KEY, cap=500, floor=0, told=8).tokens == 8
    # Told answers that ran far past what was told, beyond the tolerated share: a told length
    # no longer lowers the reservation below the learned one, but may still raise it.
    for _ in range(TOLD_WINDOW):
        model.observe_told(KEY, 8, 300)
    assert not model.trusts_told(KEY)
    assert output_reservation(model, KEY, cap=500, floor=0, told=8) == model.predict(KEY, 500)
    assert output_reservation(model, KEY, cap=500, floor=0, told=400).tokens == 400
    # Other keys keep their own record; honesty wins trust back as the window turns over.
    assert model.trusts_told(OutputKey("other", "completions"))
    for _ in range(TOLD_WINDOW):
        model.observe_told(KEY, 300, 300)
    assert output_reservation(model, KEY, cap=500, floor=0, told=8).tokens == 8


@pytest.mark.parametrize("outgrown", [0, 1, 2])
def test_a_few_answers_past_what_was_told_keep_the_trust(outgrown: int) -> None:
    model = learned(100, 100, 100)
    for index in range(10):
        model.observe_told(KEY, 50, 60 if index < outgrown else 50)
    assert model.trusts_told(KEY) is (outgrown <= TOLD_MAX_OUTGROWN_SHARE * 10)

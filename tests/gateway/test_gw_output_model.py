"""The output-length model: cold start at the cap, learned quantiles, key fallbacks, windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.output_model import (
    OutputKey,
    OutputLengthModel,
    OutputPrediction,
    PredictionSource,
    quantile_from_buckets,
)

CHAT = OutputKey("m", "chat")


def model(**overrides: int | float) -> OutputLengthModel:
    params: dict[str, int | float] = {"quantile": 0.9, "min_samples": 5, "window": 10}
    params.update(overrides)
    return OutputLengthModel(
        quantile=float(params["quantile"]),
        min_samples=int(params["min_samples"]),
        window=int(params["window"]),
    )


def test_cold_model_reserves_the_cap() -> None:
    prediction = model().predict(CHAT, cap=512)
    assert (prediction.tokens, prediction.source, prediction.samples) == (512, PredictionSource.COLD, 0)


def test_learned_quantile_is_capped_by_the_request() -> None:
    m = model()
    for tokens in (10, 20, 30, 40, 50, 60, 70, 80, 90, 100):
        m.observe(CHAT, tokens)
    prediction = m.predict(CHAT, cap=512)
    assert (prediction.tokens, prediction.source, prediction.samples) == (90, PredictionSource.LEARNED, 10)
    assert m.predict(CHAT, cap=25).tokens == 25


@pytest.mark.parametrize(("quantile", "expected"), [(0.1, 10), (0.5, 50), (0.91, 100), (1.0, 100)])
def test_nearest_rank_quantile(quantile: float, expected: int) -> None:
    m = model(quantile=quantile)
    for tokens in range(10, 101, 10):
        m.observe(CHAT, tokens)
    assert m.predict(CHAT, cap=1000).tokens == expected


def test_window_forgets_old_lengths() -> None:
    m = model(window=5, min_samples=5, quantile=1.0)
    for tokens in (500, 1, 1, 1, 1):
        m.observe(CHAT, tokens)
    assert m.predict(CHAT, cap=1000).tokens == 500
    m.observe(CHAT, 2)  # pushes 500 out
    assert m.predict(CHAT, cap=1000).tokens == 2


def test_specific_keys_fall_back_on_their_parents() -> None:
    m = model(min_samples=3)
    tenant = OutputKey("m", "chat", tenant="acme")
    for _ in range(3):
        m.observe(OutputKey("m", "completions"), 7)
    # The tenant and the chat route have no samples: the model-wide key answers.
    prediction = m.predict(tenant, cap=100)
    assert (prediction.tokens, prediction.key) == (7, OutputKey("m", ""))
    for _ in range(3):
        m.observe(tenant, 40)
    assert m.predict(tenant, cap=100).key == tenant
    assert m.predict(OutputKey("m", "chat", tenant="other"), cap=100).key == CHAT


def test_key_count_is_bounded() -> None:
    m = OutputLengthModel(quantile=0.5, min_samples=1, window=4, max_keys=3)
    for tenant in "abcdef":
        m.observe(OutputKey("m", "chat", tenant), 1)
    assert len(m.describe()) == 3


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError, match="quantile"):
        model(quantile=0.0)
    with pytest.raises(ValueError, match="min_samples"):
        model(min_samples=20, window=10)
    with pytest.raises(ValueError, match="negative"):
        model().observe(CHAT, -1)


@given(
    st.lists(st.integers(0, 10_000), min_size=1, max_size=80), st.floats(0.01, 1.0), st.integers(1, 20_000)
)
def test_prediction_is_an_observed_value_within_the_cap(
    lengths: list[int], quantile: float, cap: int
) -> None:
    m = OutputLengthModel(quantile=quantile, min_samples=1, window=50)
    for tokens in lengths:
        m.observe(CHAT, tokens)
    tokens = m.predict(CHAT, cap).tokens
    assert tokens <= cap
    assert tokens == cap or tokens in lengths[-50:]


BUSY = ((1.0, 235.0), (2.0, 246.0), (5.0, 250.0), (50.0, 303.0), (500.0, 311.0), (float("inf"), 311.0))


@pytest.mark.parametrize(
    ("buckets", "quantile", "min_samples", "expected"),
    [
        pytest.param(BUSY, 0.9, 20, (50, 311), id="rounded-up-to-its-bucket"),
        pytest.param(BUSY, 0.5, 20, (1, 311), id="median"),
        pytest.param(BUSY, 1.0, 20, (500, 311), id="all-of-them"),
        pytest.param(BUSY, 0.9, 312, None, id="too-few-observations"),
        pytest.param(((10.0, 1.0), (float("inf"), 10.0)), 0.9, 5, None, id="beyond-the-last-bound"),
        pytest.param((), 0.9, 1, None, id="no-histogram"),
    ],
)
def test_quantile_from_buckets(
    buckets: tuple[tuple[float, float], ...],
    quantile: float,
    min_samples: int,
    expected: tuple[int, int] | None,
) -> None:
    assert quantile_from_buckets(buckets, quantile, min_samples) == expected


def test_the_backend_histogram_stands_in_until_the_model_has_its_own_samples() -> None:
    m = model(min_samples=3)
    m.observe_backend(((10.0, 2.0), (100.0, 9.0), (float("inf"), 10.0)))
    prediction = m.predict(CHAT, cap=512)
    assert (prediction.tokens, prediction.source, prediction.samples) == (100, PredictionSource.BACKEND, 10)
    assert m.predict(CHAT, cap=40).tokens == 40  # still capped by the request
    for tokens in (7, 8, 9):
        m.observe(CHAT, tokens)
    learned = m.predict(CHAT, cap=512)
    assert (learned.tokens, learned.source) == (9, PredictionSource.LEARNED)
    # Another route has none of its own yet: the backend's figure again.
    assert m.predict(OutputKey("other", "chat"), cap=512).source is PredictionSource.BACKEND


def test_a_histogram_that_no_longer_says_enough_leaves_the_cap() -> None:
    m = model(min_samples=3)
    m.observe_backend(((10.0, 2.0), (100.0, 9.0), (float("inf"), 10.0)))
    m.observe_backend(())  # vLLM restarted, or stopped exporting it
    prediction = m.predict(CHAT, cap=512)
    assert (prediction.tokens, prediction.source) == (512, PredictionSource.COLD)


def test_typical_is_the_median_behind_a_learned_reservation_and_nothing_when_cold() -> None:
    m = model(min_samples=5, window=10)
    cold = m.predict(CHAT, cap=512)
    assert m.typical(cold, CHAT, 512) == 0  # the cap says nothing of when an answer ends
    for tokens in (10, 20, 30, 40, 400):
        m.observe(CHAT, tokens)
    learned = m.predict(CHAT, cap=512)
    assert (learned.source, learned.tokens) == (PredictionSource.LEARNED, 400)  # the p90 reserves
    assert m.typical(learned, CHAT, 512) == 30  # the median predicts the end
    assert m.typical(learned, CHAT, 25) == 25  # within the cap
    # A coarser key's prediction is answered from that key's window.
    tenant = OutputKey("m", "chat", "t")
    assert m.typical(m.predict(tenant, cap=512), tenant, 512) == 30
    # Told and floor lengths are known: they are their own typical length.
    told = OutputPrediction(7, PredictionSource.CLIENT, 0, None)
    assert m.typical(told, CHAT, 512) == 7
    assert m.typical(OutputPrediction(64, PredictionSource.FLOOR, 0, None), CHAT, 512) == 64


def test_typical_from_the_backend_histogram_is_its_median() -> None:
    m = model(min_samples=5)
    # 10 answers: 6 of at most 10 tokens, 3 more of at most 100, 1 of at most 500.
    m.observe_backend(((10.0, 6.0), (100.0, 9.0), (500.0, 10.0), (float("inf"), 10.0)))
    prior = m.predict(CHAT, cap=512)
    assert (prior.source, prior.tokens) == (PredictionSource.BACKEND, 100)
    assert m.typical(prior, CHAT, 512) == 10

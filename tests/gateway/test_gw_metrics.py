"""The gateway's metrics registry: every event series of a backend exists at 0 from
`add_backend` on, with exactly the label values kvgate can emit, and nothing else.

The exposition is read back with prometheus_client's own text parser, as Prometheus would
read it.
"""

from __future__ import annotations

from conftest import gateway_over_sim
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission import Decision, DecisionKind, Priority, Reason
from gateway.errors import UnavailableError
from gateway.metrics import SHED_CODES, GatewayMetrics
from gateway.outcomes import Outcome, outcome_of_refusal

# Series labelled by `backend` alone: counters (as `_total`) and histograms (as `_count`).
BACKEND_ONLY_COUNTERS = {
    "kvgate_output_reservation_exceeded_total",
    "kvgate_backend_preemptions_total",
    "kvgate_backend_scrape_failures_total",
}
BACKEND_ONLY_HISTOGRAMS = {
    "kvgate_queue_wait_prediction_error_seconds",
    "kvgate_request_estimated_blocks",
    "kvgate_output_prediction_error_tokens",
    "kvgate_time_to_first_byte_seconds",
}
# Reasons of admitting or waiting, never of a refusal.
NOT_REFUSALS = {Reason.FITS, Reason.NO_ROOM}


Key = tuple[str, frozenset[tuple[str, str]]]


def key(name: str, **labels: str) -> Key:
    return (name, frozenset(labels.items()))


def samples(registry: CollectorRegistry) -> dict[Key, float]:
    """(series name, labels) -> value, without the `_created` timestamps."""
    found: dict[Key, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def label_values(found: dict[Key, float], name: str, label: str, backend: str) -> set[str]:
    values = set()
    for (series, labels), _ in found.items():
        labelled = dict(labels)
        if series == name and labelled.get("backend") == backend:
            values.add(labelled[label])
    return values


def backends_of(found: dict[Key, float]) -> set[str]:
    return {dict(labels)["backend"] for _, labels in found if "backend" in dict(labels)}


def test_a_new_backend_exports_every_known_series_at_zero() -> None:
    metrics = GatewayMetrics(CollectorRegistry(auto_describe=True))
    before = samples(metrics.registry)
    assert not backends_of(before), "no backend series before add_backend"
    metrics.add_backend("vllm-a:8000")
    found = samples(metrics.registry)

    outcomes = {o.value for o in Outcome}
    assert label_values(found, "kvgate_requests_total", "outcome", "vllm-a:8000") == outcomes
    shed_codes = {code for codes in SHED_CODES.values() for code in codes}
    assert label_values(found, "kvgate_shed_total", "code", "vllm-a:8000") == shed_codes
    priorities = {p.value for p in Priority}
    assert label_values(found, "kvgate_admitted_total", "priority", "vllm-a:8000") == priorities
    assert label_values(found, "kvgate_queue_wait_seconds_count", "priority", "vllm-a:8000") == priorities
    for name in BACKEND_ONLY_COUNTERS:
        assert found[key(name, backend="vllm-a:8000")] == 0.0, name
    for name in BACKEND_ONLY_HISTOGRAMS:
        assert found[key(f"{name}_count", backend="vllm-a:8000")] == 0.0, name
        buckets = [key for key in found if key[0] == f"{name}_bucket"]
        assert buckets
        assert all(dict(labels)["backend"] == "vllm-a:8000" for _, labels in buckets)

    added = {key: value for key, value in found.items() if key not in before}
    assert added, "add_backend exported nothing"
    assert all(value == 0.0 for value in added.values()), {k: v for k, v in added.items() if v}
    assert backends_of(found) == {"vllm-a:8000"}
    # The process-wide series are untouched.
    assert {key for key in found if "backend" not in dict(key[1])} == set(before)


def test_adding_a_backend_again_changes_nothing_and_keeps_its_counts() -> None:
    metrics = GatewayMetrics(CollectorRegistry(auto_describe=True))
    metrics.add_backend("a")
    metrics.outcome("a", Outcome.SHED_QUEUE_FULL, Reason.QUEUE_FULL.value)
    metrics.preemptions.labels("a").inc(3)
    once = samples(metrics.registry)
    metrics.add_backend("a")
    assert samples(metrics.registry) == once
    assert once[key("kvgate_shed_total", backend="a", code="queue_full")] == 1.0
    assert once[key("kvgate_shed_total", backend="a", code="deadline_expired")] == 0.0
    assert once[key("kvgate_requests_total", backend="a", outcome="shed_queue_full")] == 1.0
    assert once[key("kvgate_requests_total", backend="a", outcome="completed")] == 0.0
    assert once[key("kvgate_backend_preemptions_total", backend="a")] == 3.0


def test_each_backend_has_its_own_series_and_a_removed_one_leaves_no_trace() -> None:
    metrics = GatewayMetrics(CollectorRegistry(auto_describe=True))
    metrics.add_backend("a")
    only_a = samples(metrics.registry)
    metrics.add_backend("b")
    metrics.first_byte.labels("b").observe(0.2)
    both = samples(metrics.registry)
    assert backends_of(both) == {"a", "b"}
    renamed = {(name, frozenset((k, "b" if k == "backend" else v) for k, v in ls)) for name, ls in only_a}
    assert renamed <= set(both), "b has the same series as a"

    metrics.remove_backend("a")
    after = samples(metrics.registry)
    assert backends_of(after) == {"b"}
    assert after[key("kvgate_time_to_first_byte_seconds_count", backend="b")] == 1.0
    metrics.remove_backend("a")  # idempotent
    # Back again, it starts from zero: its earlier counts are gone with its series.
    metrics.add_backend("a")
    assert {k: v for k, v in samples(metrics.registry).items() if ("backend", "a") in k[1]} == {
        k: v for k, v in only_a.items() if ("backend", "a") in k[1]
    }


def test_the_shed_codes_are_those_each_shed_outcome_is_sent_with() -> None:
    """SHED_CODES holds, for each shed outcome, the reason of every policy refusal that ends
    in it (gateway.router names the error's code after the reason), and for unavailable the
    code of a 503 raised before the policy is asked; no other code."""
    assert set(SHED_CODES) == {outcome for outcome in Outcome if outcome.shed}
    expected: dict[Outcome, set[str]] = {outcome: set() for outcome in SHED_CODES}
    for reason in Reason:
        if reason in NOT_REFUSALS:
            continue
        outcome = outcome_of_refusal(Decision(DecisionKind.SHED, reason))
        if outcome.shed:
            expected[outcome].add(reason.value)
    assert UnavailableError.default_code is not None
    expected[Outcome.SHED_UNAVAILABLE].add(UnavailableError.default_code)
    assert {outcome: set(codes) for outcome, codes in SHED_CODES.items()} == expected
    all_codes = [code for codes in SHED_CODES.values() for code in codes]
    assert len(all_codes) == len(set(all_codes)), "a code belongs to one outcome"


async def test_the_app_exports_its_backend_s_series_before_any_request() -> None:
    async with gateway_over_sim() as harness:
        text = (await harness.client.get("/metrics")).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    name = harness.gateway.backend.name
    for family, label, values in (
        ("kvgate_requests", "outcome", {o.value for o in Outcome}),
        ("kvgate_shed", "code", {c for codes in SHED_CODES.values() for c in codes}),
        ("kvgate_admitted", "priority", {p.value for p in Priority}),
    ):
        totals = [s for s in families[family].samples if s.name.endswith("_total")]
        assert {s.labels[label] for s in totals if s.labels["backend"] == name} == values, family
        assert all(s.value == 0.0 for s in totals), family
    preemptions = [s for s in families["kvgate_backend_preemptions"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in preemptions] == [({"backend": name}, 0.0)]

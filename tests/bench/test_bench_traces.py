"""The trace samples shipped in bench/traces/: what NOTICE says they are, and loadable."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import workload as wl

REPO = Path(__file__).resolve().parent.parent.parent
TRACES = REPO / "bench" / "traces"
# Beside the checkout, as on the developers' machines and in CI.
SHARED = REPO.parent / "shared" / "traces"
SAMPLES = {
    "AzureLLMInferenceTrace_code_600.csv": "AzureLLMInferenceTrace_code.csv",
    "mooncake_synthetic_trace_600.jsonl": "mooncake_synthetic_trace.jsonl",
}


def test_every_shipped_trace_is_named_in_the_notice_with_its_licence() -> None:
    notice = (REPO / "NOTICE").read_text()
    assert sorted(path.name for path in TRACES.iterdir()) == sorted(SAMPLES)
    for name in SAMPLES:
        assert f"bench/traces/{name}" in notice
    assert "CC-BY-4.0" in notice
    assert "Apache License 2.0" in notice


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_shipped_samples_hold_600_requests(name: str) -> None:
    work = wl.load_trace(TRACES / name)
    assert len(work) == 600
    assert all(r.prompt_tokens > 0 and r.output_tokens > 0 for r in work.requests)


@pytest.mark.parametrize(("name", "full"), sorted(SAMPLES.items()))
def test_shipped_samples_are_the_first_rows_of_the_public_traces(name: str, full: str) -> None:
    source = SHARED / full
    if not source.exists():
        pytest.skip(f"{source} not present")
    shipped = (TRACES / name).read_bytes()
    assert source.read_bytes().startswith(shipped)

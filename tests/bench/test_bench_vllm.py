"""`kvgate bench` against the real vLLM testbed: its numbers are honest.

A small run (8 requests, short prompts and outputs, no preemption possible in a 2,048-token
pool) must show: every forced output length exact and ended by EOS (not by max_tokens), every
prompt exactly as long as asked, and the client's own count of generated tokens equal to the
delta of vLLM's `generation_tokens_total`. The testbed is shared: a run during which someone
else's requests moved the counters (seen in the prompt-token counter) is repeated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.cli import main

VLLM_URL_ENV = "KVGATE_TEST_VLLM_URL"
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
ATTEMPTS = 3

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_target() -> str:
    url = os.environ.get(VLLM_URL_ENV)
    if not url:
        pytest.skip(f"{VLLM_URL_ENV} is not set")
    return url.rstrip("/")


def test_small_bench_counts_match_the_backend(vllm_target: str, tmp_path: Path) -> None:
    for attempt in range(ATTEMPTS):
        out = tmp_path / f"run{attempt}"
        code = main(
            [
                "bench",
                "--target",
                vllm_target,
                "--trace",
                str(FIXTURES / "azure_code_head.csv"),
                "-n",
                "8",
                # prompts 1-149 tokens, outputs 16-54 tokens: a few hundred KV tokens in all
                "--ctx-scale",
                "0.02",
                "--gen-scale",
                "2",
                "--rate",
                "4",
                "--deadline",
                "30",
                "--sample-period",
                "0.2",
                "--out",
                str(out),
            ]
        )
        assert code == 0
        target = json.loads((out / "summary.json").read_text())["targets"][0]
        if target["backend_prompt_tokens"] == target["client_prompt_tokens"]:
            break  # nobody else used the testbed meanwhile
    else:
        pytest.fail("the testbed was busy with other requests during every attempt")

    records = [json.loads(line) for line in (out / "requests-0.jsonl").read_text().splitlines()]
    assert target["ok"] == target["sent"] == 8
    assert target["preemptions"] == 0
    # forced lengths: exactly as asked, ended by EOS rather than by the max_tokens cap
    assert target["forced_length_exact"] == 8
    assert all(r["finish_reason"] == "stop" for r in records)
    assert [r["output_tokens"] for r in records] == [r["output_tokens_wanted"] for r in records]
    # the client's own count (token ids received) agrees with the usage chunk
    assert all(r["streamed_tokens"] == r["usage_completion_tokens"] for r in records)
    assert target["prompt_length_exact"] == 8
    # honest numbers: what the client counted is what the engine generated
    assert target["client_output_tokens"] == target["backend_generation_tokens"]
    assert target["client_output_tokens"] == sum(r["output_tokens_wanted"] for r in records)
    assert target["backend_tokens_wasted"] == 0


def test_a_ttft_client_waits_and_its_goodput_counts_only_timely_first_tokens(
    vllm_target: str, tmp_path: Path
) -> None:
    """The first-token-deadline kind on real vLLM: no deadline, every answer read to its end;
    first-token goodput is the output tokens of finished requests whose first token came within
    the objective, per second of offered time (recomputed here from the records)."""
    out = tmp_path / "ttft"
    code = main(
        [
            "bench", "--target", vllm_target, "--trace", str(FIXTURES / "azure_code_head.csv"),
            "-n", "6", "--ctx-scale", "0.02", "--gen-scale", "2", "--rate", "4",
            "--clients", "ttft", "--ttft-slo", "0.5", "--sample-period", "0.2", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    target = summary["targets"][0]
    assert summary["settings"]["headers_deadline_s"] is None
    assert summary["settings"]["headers_ttft_s"] == 0.5
    records = [json.loads(line) for line in (out / "requests-0.jsonl").read_text().splitlines()]
    assert not any(r["gave_up"] for r in records)
    assert target["ok"] == target["sent"] == 6
    timely = [r for r in records if r["ttft_s"] is not None and r["ttft_s"] <= 0.5]
    assert target["goodput_slo_requests"] == len(timely)
    assert target["goodput_slo_tokens_per_s"] == pytest.approx(
        sum(r["output_tokens"] for r in timely) / target["offered_s"]
    )

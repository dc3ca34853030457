"""`make demo`'s load is measured on the real vLLM testbed: the rate search its bursts are sized by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deploy_files import load_script

pytestmark = pytest.mark.vllm


def test_the_demo_measures_a_rate_vllm_sustains(vllm_url: str, tmp_path: Path) -> None:
    # Bursts of 6 short requests, which the 2,048-token pool holds all at once, and a 30 s
    # deadline that they meet at 1, 2 and 4 per second: the search doubles until its last try
    # and stops at a rate that passed (no rate failed, so it is not bounded), and 1x is 0.8 of
    # it.
    module = load_script("demo_rate")
    args = module.parse_args(
        [
            "--vllm", vllm_url, "--requests", "prompt=uniform:20:40,output=uniform:4:8",
            "-n", "6", "--max-tokens", "16", "--deadline", "30", "--start-rate", "1",
            "--max-doublings", "2", "--bisections", "0", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    search = module.measure(args)
    assert [step.rate for step in search.steps] == [1.0, 2.0, 4.0]
    assert [step.finished_share for step in search.steps] == [1.0, 1.0, 1.0]
    assert search.sustained == 4.0
    assert not search.bounded
    assert search.one_x == pytest.approx(3.2)
    for rate in ("1", "2", "4"):
        [target] = json.loads((tmp_path / f"rate-{rate}" / "summary.json").read_text())["targets"]
        assert target["target"].rstrip("/") == vllm_url
        assert (target["sent"], target["ok"]) == (6, 6)


def test_a_deadline_no_rate_meets_is_said_plainly(
    vllm_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 200 output tokens cannot come within a millisecond: nothing passes, and the demo stops
    # with that said rather than bursting at a rate nobody measured.
    code = load_script("demo_rate").main(
        [
            "--vllm", vllm_url, "--requests", "prompt=20,output=200", "-n", "2", "--max-tokens", "256",
            "--deadline", "0.001", "--start-rate", "1", "--max-doublings", "1", "--bisections", "0",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert "1x=" not in captured.out
    assert "no rate tried was sustained" in captured.err

"""`make demo`'s load is measured on the real vLLM testbed: the rate search its bursts are sized by."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "demo_rate.py"
VLLM_URL_ENV = "KVGATE_TEST_VLLM_URL"

pytestmark = pytest.mark.vllm


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_rate", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vllm_target() -> str:
    url = os.environ.get(VLLM_URL_ENV)
    if not url:
        pytest.skip(f"{VLLM_URL_ENV} is not set")
    return url.rstrip("/")


def test_the_demo_measures_a_rate_vllm_sustains(vllm_target: str, tmp_path: Path) -> None:
    # Small bursts of short requests, a deadline that a rate of one per second always meets and
    # a burst of 6 at a thousand per second, a few tens of milliseconds of engine time each,
    # never misses (the 2,048-token pool holds them all at once): the search stops at a rate
    # that passed, and 1x is 0.8 of it.
    module = load()
    args = module.parse_args(
        [
            "--vllm", vllm_target, "--requests", "prompt=uniform:20:40,output=uniform:4:8",
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
        assert target["target"].rstrip("/") == vllm_target
        assert (target["sent"], target["ok"]) == (6, 6)


def test_a_deadline_no_rate_meets_is_said_plainly(
    vllm_target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 200 output tokens cannot come within a millisecond: nothing passes, and the demo stops
    # with that said rather than bursting at a rate nobody measured.
    code = load().main(
        [
            "--vllm", vllm_target, "--requests", "prompt=20,output=200", "-n", "2", "--max-tokens", "256",
            "--deadline", "0.001", "--start-rate", "1", "--max-doublings", "1", "--bisections", "0",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert "1x=" not in captured.out
    assert "no rate tried was sustained" in captured.err

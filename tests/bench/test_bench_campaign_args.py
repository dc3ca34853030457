"""tests/benchmarks/campaign.py refuses contradictory arguments before it starts a testbed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CAMPAIGN = REPO / "tests" / "benchmarks" / "campaign.py"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--clients", "deadline,patient"], "choose from deadline, ttft, both"),
        (["--rates", "1x,3x"], "measure it (--find-1x) or give --one-x"),
        (["--find-1x", "--one-x", "5"], "--find-1x measures 1x"),
    ],
)
def test_contradictions_are_refused_before_anything_starts(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(CAMPAIGN), *flags, "--port", "9", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert not out.exists()

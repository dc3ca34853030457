"""tests/benchmarks/fleet.py refuses contradictory arguments before it starts an engine, and
the testbed pins each engine of a fleet to the core it is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "benchmarks" / "fleet.py"
sys.path.insert(0, str(REPO / "tests" / "testbed"))
import testbed  # noqa: E402


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rates", "1x,3x"], "measure it (--find-1x) or give --one-x"),
        (["--find-1x", "--one-x", "5"], "--find-1x measures 1x"),
        (["--targets", "cache_aware,least_load", "--rates", "2"], "'least_load' is none of"),
        (["--traces", "nowhere.jsonl", "--rates", "2"], "no trace at nowhere.jsonl"),
        (["--one-x", "azure=3", "--traces", "mooncake", "--rates", "1x"], "measure it"),
    ],
)
def test_contradictions_are_refused_before_anything_starts(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(HARNESS), *flags, "--port", "9", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not out.exists()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="pinning needs two cores")
def test_each_engine_is_pinned_to_its_own_core() -> None:
    last = (os.cpu_count() or 1) - 1
    default = testbed.server_command(Path("venv"), Path("model"), 1, [])
    first = testbed.server_command(Path("venv"), Path("model"), 1, [], core=0)
    assert default[:3] == ["taskset", "-c", str(last)]
    assert first[:3] == ["taskset", "-c", "0"]
    # vLLM's compute threads follow the process's core, not the last one.
    assert testbed.server_env(0)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert testbed.server_env()["VLLM_CPU_OMP_THREADS_BIND"] == str(last)
    with pytest.raises(ValueError, match="does not exist"):
        testbed.server_command(Path("venv"), Path("model"), 1, [], core=last + 1)

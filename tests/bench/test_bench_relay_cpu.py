"""tests/benchmarks/relay_cpu.py runs end to end at a small scale: kvgate in front of the
emulator, every token the emulator generated counted at the client, CPU figures measured;
beside it the byte pipe reference, measured the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RELAY_CPU = REPO / "tests" / "benchmarks" / "relay_cpu.py"
STREAMS = 20
TOKENS_PER_STREAM = 15


def test_relay_cpu_benchmark_counts_every_token_and_measures_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable, str(RELAY_CPU),
            "--streams", str(STREAMS),
            "--tokens-per-stream", str(TOKENS_PER_STREAM),
            "--step-ms", "10",
            "--idle-s", "0",
            "--direct",
            "--reference", "pipe",
            "--no-pin",  # a CI machine may have one core
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    relayed, piped, direct = report["runs"]
    expected = STREAMS * TOKENS_PER_STREAM
    for run in (relayed, piped, direct):
        assert run["errors"] == 0, run["first_errors"]
        assert run["tokens_counted"] == run["tokens_generated"] == expected
        assert run["exact"] is True
        assert run["whole"]["tokens"] == expected
        assert run["whole"]["cpu_s"]["emulator"] > 0
    assert (relayed["target"], piped["target"], direct["target"]) == ("kvgate", "pipe", "emulator")
    assert piped["whole"]["us_per_token"]["relay"] > 0
    assert "kvgate" not in piped["whole"]["cpu_s"]
    assert report["summary"]["pipe"]["whole_us_per_token"] == piped["whole"]["us_per_token"]["relay"]
    assert relayed["whole"]["us_per_token"]["kvgate"] > 0
    assert "kvgate" not in direct["whole"]["cpu_s"]
    assert report["summary"]["kvgate"]["whole_us_per_token"] == relayed["whole"]["us_per_token"]["kvgate"]

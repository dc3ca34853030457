"""The short soak (about a minute) of tests/faults/soak.py: a real `kvgate serve` in front of
the emulator, mixed streaming and non-streaming traffic with faults switched every two
seconds. After the warm-up: resident memory grows less than 20 MB, open descriptors and
asyncio tasks do not grow, the ledger and the queue end empty, every request is answered and
counted once. The long run is the same script: `python tests/faults/soak.py --duration 1800`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from soak import SoakConfig, run_soak, summary


def test_a_short_soak_holds_steady(tmp_path: Path) -> None:
    config = SoakConfig(duration_s=60.0, concurrency=16, phase_s=2.0, max_rss_growth_mb=20.0)
    report = asyncio.run(run_soak(config, tmp_path, progress=False))
    print(summary(report))
    assert report.passed, summary(report)
    # Every kind of answer the faults provoke showed up, so the error paths were exercised.
    for result in ("200", "stream_done", "stream_error_event", "502", "503", "504", "hung_up"):
        assert report.results.get(result, 0) > 0, f"no {result} in {report.results}"

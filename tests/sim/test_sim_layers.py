"""The emulator's functional core stays free of I/O frameworks (STYLE.md, convention 1)."""

from __future__ import annotations

import subprocess
import sys

import httpx

from sim.config import SimConfig
from sim.faults import Faults
from sim.testing import running_sim_process

PURE_MODULES = ("sim.engine", "sim.lengths", "sim.faults", "sim.api", "sim.config")
FORBIDDEN = ("fastapi", "starlette", "httpx", "uvicorn", "prometheus_client", "asyncio", "redis")


def test_pure_modules_import_no_io_framework() -> None:
    # A fresh interpreter, so that nothing imported by the test run itself can hide a leak.
    code = (
        "import sys\n"
        f"import {', '.join(PURE_MODULES)}\n"
        f"print(sorted(m for m in {FORBIDDEN!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_child_process_emulator_gets_the_same_config(fast_config: SimConfig) -> None:
    config = SimConfig(engine=fast_config.engine, faults=Faults(omit_cache_config_info=True))
    with running_sim_process(config) as url:
        state = httpx.get(f"{url}/sim/state").json()
        metrics = httpx.get(f"{url}/metrics").text
        faults = httpx.get(f"{url}/sim/faults").json()
    assert state["step_cost"] == {"base_s": 0.001, "per_token_s": 0.0, "per_seq_s": 0.0, "per_request_s": 0.0}
    assert faults["omit_cache_config_info"] is True
    assert "vllm:cache_config_info" not in metrics

"""The functional core imports no web framework, HTTP client, store, metrics library or asyncio.

Each module is imported in a fresh interpreter and the loaded modules are inspected, so a
transitive import counts too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("fastapi", "starlette", "httpx", "redis", "prometheus_client", "asyncio", "uvicorn", "anyio")
PURE_GATEWAY_MODULES = (
    "gateway.admission",
    "gateway.body_pace",
    "gateway.capacity",
    "gateway.client_hints",
    "gateway.credentials",
    "gateway.errors",
    "gateway.ledger",
    "gateway.outcomes",
    "gateway.output_model",
    "gateway.pace",
    "gateway.recent",
    "gateway.reserve",
    "gateway.routing",
    "gateway.rates",
    "gateway.shared_reading",
    "gateway.shared_view",
    "gateway.sse",
    "gateway.vllm_metrics",
)
ESTIMATOR_MODULES = tuple(
    f"estimator.{path.stem}" for path in sorted((REPO / "estimator").glob("*.py")) if path.stem != "__init__"
)

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))
"""


@pytest.mark.parametrize("module", PURE_GATEWAY_MODULES + ESTIMATOR_MODULES)
def test_core_module_imports_nothing_from_the_shell(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
        timeout=60,
    )
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert not loaded & set(FORBIDDEN), f"{module} pulls in {sorted(loaded & set(FORBIDDEN))}"

"""The bench's pure modules stay pure: no network, no event loop, no rendering."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PURE = ("workload", "prompts", "payload", "promtext", "records", "report", "sse", "peers", "loads")
SHELL_ONLY = {
    "asyncio",
    "httpx",
    "h11",
    "threading",
    "uvicorn",
    "fastapi",
    "starlette",
    "rich",
    "matplotlib",
    "socket",
    "subprocess",
    "bench.runner",
    "bench.cli",
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_io(module: str) -> None:
    imported = _imports(BENCH / f"{module}.py")
    offending = {name for name in imported if name in SHELL_ONLY or name.split(".")[0] in SHELL_ONLY}
    assert not offending

"""Every command of the base install (`pip install .`, no extras) works, or says before it
starts what to install.

The test environment has every extra, so the check runs in a fresh interpreter in which the
modules that only the extras bring are made unimportable: those of the distributions that the
`bench` and `test` extras pull in and the base dependencies do not (read from pyproject.toml
and the installed packages' metadata, so a new extra is covered without editing this file).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str], extras: tuple[str, ...] = ("",)) -> set[str]:
    """The distributions that `requirements` (for one of `extras`) install, transitively, as far
    as the installed packages' metadata says."""
    seen: set[str] = set()
    stack = [(Requirement(text), extras) for text in requirements]
    while stack:
        requirement, wanted = stack.pop()
        if requirement.marker is not None and not any(
            requirement.marker.evaluate({"extra": extra}) for extra in wanted
        ):
            continue
        name = _normal(requirement.name)
        if name == "kvgate" or name in seen:
            continue
        seen.add(name)
        try:
            needs = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue
        stack += [(Requirement(text), ("", *requirement.extras)) for text in needs]
    return seen


def extras_only_modules() -> list[str]:
    base = _closure(PYPROJECT["project"]["dependencies"])
    extra_requirements = [
        text for name in ("bench", "test") for text in PYPROJECT["project"]["optional-dependencies"][name]
    ]
    extra = _closure(extra_requirements) - base
    return sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if module.isidentifier()
        and {_normal(dist) for dist in dists} & extra
        and not {_normal(dist) for dist in dists} & base
    )


PROBE = r"""
import contextlib, io, json, sys, tempfile
from pathlib import Path

blocked = set(json.loads(sys.argv[1]))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the base install)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
from gateway.cli import main

results = {}

def run(label, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results[label] = {"code": code, "err": err.getvalue()}

for command in ("estimate", "serve", "sim", "bench"):
    run(command + " --help", [command, "--help"])
run("estimate", ["estimate", "tests/fixtures/configs/llama-3.1-8b.json", "--max-model-len", "8192"])
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "out"
    run("bench", ["bench", "--target", "http://127.0.0.1:9", "--synthetic", "n=2", "--out", str(out)])
    results["bench"]["wrote"] = out.exists()

# What `kvgate serve` and `kvgate sim` load once their arguments are parsed, short of listening.
from gateway.app import create_app
from gateway.lifecycle import serve
from gateway.logs import configure_logging
from gateway.settings import Settings
create_app(Settings(backend_url="http://127.0.0.1:9"))
import uvicorn
from sim.config import SimConfig
from sim.server import create_sim_app
create_sim_app(SimConfig())
# transformers (tokenizers only; kvgate never needs PyTorch) must not greet a newcomer with
# "PyTorch was not found. Models won't be available": `kvgate` silences that advice.
err = io.StringIO()
with contextlib.redirect_stderr(err):
    import transformers
results["transformers"] = err.getvalue()
results["loaded"] = sorted(name for name in sys.modules if name.split(".")[0] in blocked)
print(json.dumps(results))
"""


def test_the_extras_bring_modules_that_the_probe_blocks() -> None:
    # Without this the probe below would pass for want of anything to block.
    assert "matplotlib" in extras_only_modules()
    assert "pytest" in extras_only_modules()


def test_every_command_of_the_base_install_works_or_names_what_to_install() -> None:
    blocked = extras_only_modules()
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(blocked)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    for command in ("estimate", "serve", "sim", "bench"):
        assert results[f"{command} --help"]["code"] == 0, results[f"{command} --help"]
    assert results["estimate"] == {"code": 0, "err": ""}
    bench = results["bench"]
    assert bench["code"] == 2
    assert "from the `bench` extra" in bench["err"]
    assert "pip install" in bench["err"]
    assert not bench["wrote"], "kvgate bench must refuse before it writes anything"
    assert "PyTorch" not in results["transformers"]
    assert results["loaded"] == []

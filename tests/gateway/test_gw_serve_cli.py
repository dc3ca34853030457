"""`kvgate serve`: flags to settings, every invalid setting reported, and a real process."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import bound_socket

from gateway.cli import build_parser, main
from gateway.serve_cli import UsageError, overrides_from
from sim.config import SimConfig
from sim.testing import running_sim

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_flags_and_assignments_become_overrides() -> None:
    args = parse(
        "--backend",
        "http://b:1",
        "--port",
        "9000",
        "--set",
        "output_quantile=0.8",
        "--set",
        "early-shed=false",
    )
    overrides = overrides_from(args)
    assert overrides["backend_url"] == "http://b:1"
    assert overrides["port"] == 9000
    assert overrides["output_quantile"] == "0.8"
    assert overrides["early_shed"] == "false"
    assert overrides["model"] is None  # absent flags are None and override nothing
    with pytest.raises(UsageError):
        overrides_from(parse("--set", "no-equals-sign"))


def test_invalid_settings_are_all_reported_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["serve", "--port", "70000", "--set", "output_quantile=3", "--set", "nonsense=1"])
    assert code == 2
    err = capsys.readouterr().err
    for name in ("backend_url", "port", "output_quantile", "nonsense"):
        assert name in err
    missing = main(["serve", "--backend", "http://b:1", "--config", str(tmp_path / "absent.toml")])
    assert missing == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_kvgate_serve_process_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    config = tmp_path / "kvgate.toml"
    config.write_text('metrics_poll_interval_s = 0.05\nlog_level = "warning"\n')
    with running_sim(SimConfig()) as backend:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--backend",
                backend,
                "--port",
                str(port),
                "--config",
                str(config),
            ],
            cwd=REPO,
            env={**os.environ, "KVGATE_ADMIN_TOKEN": "t0ken"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "kvgate serve did not become ready"
                time.sleep(0.05)
            body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
            # The environment's admin token is in force.
            assert httpx.get(f"{url}/admin/state", timeout=5).status_code == 401
            state = httpx.get(
                f"{url}/admin/state", headers={"authorization": "Bearer t0ken"}, timeout=5
            ).json()
            assert state["settings"]["metrics_poll_interval_s"] == 0.05  # from the config file
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            if process.stdout:
                process.stdout.close()

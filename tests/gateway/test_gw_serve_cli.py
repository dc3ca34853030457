"""`kvgate serve`: flags to settings, every invalid setting reported, and a real process."""

from __future__ import annotations

import argparse
import os
import resource
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


DESCRIPTOR_PROBE = """
import resource, sys
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from gateway.lifecycle import client_connection_limit
from gateway.settings import Settings
limit = client_connection_limit(Settings(backend_url="http://127.0.0.1:9", max_connections=50))
print(limit, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize(
    ("soft", "hard", "expected"),
    [
        # The soft limit is raised to fit 4,096 client + 50 backend connections + headroom.
        (256, 8192, (4096, 4096 + 50 + 64)),
        # Even the hard limit is too low: the bound on client connections comes down instead.
        (256, 1024, (1024 - 50 - 64, 1024)),
    ],
)
def test_client_connections_are_bounded_below_the_descriptor_limit(
    soft: int, hard: int, expected: tuple[int, int]
) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this process may not raise its descriptor limit to {hard}")
    result = subprocess.run(
        [sys.executable, "-c", DESCRIPTOR_PROBE, str(soft), str(hard)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
        timeout=60,
    )
    assert tuple(int(v) for v in result.stdout.split()) == expected

"""Shared fixtures: the real vLLM testbed and the tiny model beside it, a TLS certificate.

`make test` starts one vLLM before pytest and passes its URL in KVGATE_TEST_VLLM_URL; running
pytest by hand without it starts a testbed for the session (about 100 s) and stops it after.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

sys.path.insert(0, str(Path(__file__).parent / "testbed"))
import testbed
from redis_server import RedisServer, running_redis

# The machine is shared with vLLM engines and benchmarks: how fast examples are generated says
# nothing about the code under test, so slow generation is no failure (and no example has a
# deadline: performance is measured by benchmarks, not asserted).
hypothesis_settings.register_profile(
    "shared-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("shared-machine")

VLLM_URL_ENV = "KVGATE_TEST_VLLM_URL"
REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real vLLM serving the tiny model (no trailing slash)."""
    port = int(os.environ.get("KVGATE_TEST_VLLM_PORT", "8021"))
    with testbed.serving(VLLM_URL_ENV, tmp_path_factory.mktemp("vllm"), [], port) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model's folder (config, tokenizer, chat template), built by the testbed install."""
    path = testbed.model_dir()
    if not (path / ".built").exists():
        testbed.install()
    return path


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subject = ["-subj", "/CN=kvgate-test", "-addext", "subjectAltName=IP:127.0.0.1"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *subject, *files],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.fixture(scope="session")
def redis_service() -> Iterator[RedisServer]:
    """One real redis-server for the session; tests keep apart by key prefix (`redis_prefix`)."""
    with running_redis() as server:
        yield server


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of this test's own in the session's Redis."""
    return f"t{uuid.uuid4().hex[:12]}"

"""Shared fixtures: the real vLLM testbed and the tiny model beside it, a TLS certificate.

`make test` starts one vLLM before pytest and passes its URL in KVGATE_TEST_VLLM_URL; running
pytest by hand without it starts a testbed for the session (about 100 s) and stops it after.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "testbed"))
import testbed

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

"""The fleet harness's SGLang path for real: sglang-router in front of the real vLLM testbed.

tests/benchmarks/fleet.py runs a few Mooncake requests through the SGLang model gateway
(`cache_aware`) in front of the session's testbed, and its accounting must hold: the tokens
vLLM's counters say it generated and read are those the clients received and the answers'
usage reported, every forced length reached the engine through the router, and the one engine
carried every token. Beside it, what the router does with the fields the bench relies on:
completions pass whole, chat is rebuilt without vLLM's own fields. The testbed is shared (other clients may use it meanwhile): a
run whose engine counters moved by more than it sent is made again.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from bench.payload import OUTPUT_TOKENS_FIELD

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "benchmarks" / "fleet.py"
MODEL = "tiny-llama"
ATTEMPTS = 3
TIMEOUT_S = 120.0


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_harness", HARNESS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port_pair() -> int:
    """A port whose successor is free too (the router's Prometheus exporter takes it)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port + 1)) != 0 and port < 65535:
                return port
    raise RuntimeError("no free pair of ports")


def run_harness(vllm_url: str, out: Path) -> dict[str, Any]:
    command = [
        sys.executable, str(HARNESS), "--engines", vllm_url, "--targets", "cache_aware",
        "--traces", "mooncake", "-n", "6", "--rates", "4", "--ctx-scale", "0.01", "--gen-scale", "0.05",
        # Nothing gives up: every answer is read to its end, so the counts must match exactly.
        "--deadline", "120", "--gateway-port", str(free_port_pair()), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "fleet.json").read_text())
    return result


def test_the_harness_accounts_for_every_token_through_sglang(vllm_url: str, tmp_path: Path) -> None:
    for attempt in range(ATTEMPTS):
        result = run_harness(vllm_url, tmp_path / f"attempt-{attempt}")
        [run] = result["runs"]
        if not run["engines_shared"]:
            break
    else:
        pytest.fail(f"another client used the testbed during each of {ATTEMPTS} runs")
    assert run["target"] == "sglang cache_aware"
    assert (run["sent"], run["ok"], run["refused_429"], run["refused_503"]) == (6, 6, 0, 0)
    [engine] = run["engines"]
    assert engine["engine"] == vllm_url
    assert run["accounting_gap"] == 0
    assert engine["generation_tokens"] == run["client_output_tokens"] == run["useful_tokens"] > 0
    assert engine["prompt_tokens"] == run["client_prompt_tokens"] > 0
    assert run["generation_shares"] == [1.0]
    assert 0.0 <= run["prefix_hit_rate"] <= 1.0
    assert run["ttft_p50_s"] is not None
    summary = json.loads(
        (tmp_path / f"attempt-{attempt}" / "mooncake-rate4-cache_aware-r1" / "summary.json").read_text()
    )
    # Every length forced through the private field reached the engine through the router.
    assert summary["targets"][0]["forced_length_exact"] == 6


@pytest.fixture
def router(vllm_url: str, tmp_path: Path) -> Iterator[str]:
    harness = load_harness()
    port = free_port_pair()
    process = harness.start_sglang("round_robin", [vllm_url], port, tmp_path / "router.log", [], None)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        harness.testbed.stop_process(process.pid)
        process.wait(timeout=30)


def test_sglang_relays_completions_whole_but_rebuilds_chat_without_vllm_fields(router: str) -> None:
    forced = {"vllm_xargs": {OUTPUT_TOKENS_FIELD: 5}, "max_tokens": 20, "return_token_ids": True}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        completion = client.post(f"{router}/v1/completions", json={"model": MODEL, "prompt": "KV", **forced})
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 5
        assert len(completion.json()["choices"][0]["token_ids"]) == 5

        # Chat requests are parsed into SGLang's own schema and sent on without the fields it
        # does not know: no forced length (the random model runs to max_tokens), no token ids.
        # Hence the harness drives /v1/completions, where the bench's forcing reaches vLLM.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is a KV cache?"}], **forced}
        answer = client.post(f"{router}/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 20
        assert answer.json()["choices"][0]["token_ids"] is None

        chunks = 0
        usage = None
        body = {**chat, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", f"{router}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                chunks += sum(1 for choice in chunk["choices"] if choice.get("delta", {}).get("content"))
        assert usage is not None
        assert usage["completion_tokens"] == 6
        assert 0 < chunks <= 6

        # The router names the model "unknown" (it asks the workers SGLang's own routes), which is
        # why the harness takes the model, its context and tokenizer from the engine.
        models = client.get(f"{router}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["unknown"]

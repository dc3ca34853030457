"""`kvgate estimate` on the command line: output, bad input, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main as kvgate

LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def llama_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    return path


def test_table_shows_naive_and_real_bytes(llama_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["estimate", str(llama_config)]) == 0
    out = capsys.readouterr().out
    assert "524,288 B  (512.0 KiB)" in out  # 2 x 32 layers x 4096 x 2 bytes: every head keeps K and V
    assert "131,072 B  (128.0 KiB)" in out  # 8 KV heads (GQA)


def test_json_request_blocks(llama_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", str(llama_config), "--prompt-tokens", "1000", "--max-tokens", "200", "--json"]
    assert kvgate(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["request_blocks"] == 75  # ceil(1200 / 16)
    assert result["kv_bytes_per_token"] == 131072


def test_request_file_counted_with_tokenizer(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 50}))
    assert (
        kvgate(["estimate", str(tiny_model_dir), "--request", str(body), "--block-size", "32", "--json"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert (
        result["prompt_tokens"] == 16
    )  # as vLLM reports it for this body (tests/estimator/test_tokens_vllm.py)
    assert result["max_output_tokens"] == 50
    assert result["request_blocks"] == 3  # ceil(66 / 32)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "hidden_size": 64}, "num_attention_heads"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4}, "hidden_size"),
        ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 64}, "head_dim"),
        ({"num_hidden_layers": "two", "num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, config: dict[str, object], field: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "estimate", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert field in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "content",
    ["not json", "[1, 2]", '{"messages": "nope"}', '{"prompt": 7}'],
)
def test_bad_request_file_is_an_error_not_a_traceback(
    llama_config: Path, tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_text(content)
    assert kvgate(["estimate", str(llama_config), "--request", str(body)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate estimate: error:")


@pytest.mark.parametrize(
    "args",
    [
        ["--prompt-tokens", "131072"],
        ["--prompt-tokens", "100", "--max-tokens", "0"],
        ["--prompt-tokens", "-1"],
        ["--gpu-memory-gib", "8"],  # 8 GiB cannot hold 8B parameters in bf16
        ["--tp", "0"],
        ["--pp", "64"],
        ["--kv-cache-dtype", "fp4_magic"],
    ],
)
def test_impossible_requests_are_refused(
    llama_config: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert kvgate(["estimate", str(llama_config), *args]) == 2
    assert "error:" in capsys.readouterr().err


def test_missing_model_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["estimate", "no-such-org/no-such-model"]) == 2
    assert "never downloads" in capsys.readouterr().err


CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"


@pytest.mark.parametrize(
    ("fixture", "bytes_per_token", "groups"),
    [
        # the arithmetic is in test_kv_models.py's BYTES_PER_TOKEN
        ("qwen2.5-vl-7b-instruct", 57344, ["full"]),
        ("qwen2.5-vl-7b-instruct-resaved", 57344, ["full"]),
        ("qwen3-vl-8b-instruct", 147456, ["full"]),
        ("llama-4-scout-17b-16e-instruct", 196608, ["chunked", "chunked", "chunked", "full"]),
        ("gemma-3-27b-it", 573440, ["sliding"] * 6 + ["full"]),
        ("mistral-small-3.1-24b-instruct-2503", 163840, ["full"]),
    ],
)
def test_multimodal_configs_are_estimated(
    fixture: str, bytes_per_token: int, groups: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(CONFIGS / f"{fixture}.json")
    assert kvgate(["estimate", path, "--gpu-memory-gib", "80", "--tp", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_bytes_per_token"] * 4 == bytes_per_token  # tp 4 splits 4 or more KV heads
    assert sorted(result["kv_groups"]) == sorted(groups)
    assert result["num_blocks"] > 0
    assert kvgate(["estimate", path, "--prompt-tokens", "1000", "--max-tokens", "200"]) == 0
    assert "request blocks" in capsys.readouterr().out


def test_gemma3_it_context_comes_from_transformers_default(capsys: pytest.CaptureFixture[str]) -> None:
    # The published text_config has no max_position_embeddings; Gemma3TextConfig says 131072,
    # and vLLM does not scale Gemma 3's by its rope factor. A 100000-token request then fits:
    # full group ceil(101000 / 16) = 6313 + 6 sliding groups x (ceil((1023 + 2048) / 16) + 1) = 193
    path = str(CONFIGS / "gemma-3-27b-it.json")
    assert kvgate(["estimate", path, "--prompt-tokens", "100000", "--max-tokens", "1000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["max_model_len"] == 131072
    assert result["request_blocks"] == 6313 + 6 * 193


def test_llama4_table_names_the_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["estimate", str(CONFIGS / "llama-4-scout-17b-16e-instruct.json")]) == 0
    assert "chunked, chunked, chunked, full (attention chunk 8192)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text_config", "path"),
    [
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}, "text_config.hidden_size"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4}, "text_config.hidden_size"),
        ({"num_hidden_layers": 2, "hidden_size": 64}, "text_config.num_attention_heads"),
        ({"num_attention_heads": 4, "hidden_size": 64}, "text_config.num_hidden_layers"),
    ],
)
def test_text_config_missing_a_field_is_one_line_and_exit_2(
    tmp_path: Path, text_config: dict[str, object], path: str
) -> None:
    # A vision tower with every field does not stand in for the text model's.
    config = {
        "model_type": "qwen3_vl",
        "text_config": text_config,
        "vision_config": {"depth": 27, "hidden_size": 1152, "num_attention_heads": 16},
        "torch_dtype": "bfloat16",
    }
    file = tmp_path / "config.json"
    file.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "estimate", str(file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert path in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr

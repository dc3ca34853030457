"""Finding a model's config and turning it into the KV-group layout vLLM's pool follows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from estimator.kv import ConfigError, blocks_for_tokens, request_blocks
from estimator.modelconfig import ModelNotFoundError, load_layout

CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"


def model_folder(tmp_path: Path, fixture: str) -> Path:
    folder = tmp_path / fixture
    folder.mkdir()
    shutil.copy(CONFIGS / f"{fixture}.json", folder / "config.json")
    return folder


def test_testbed_model_is_one_full_attention_group(tiny_model_dir: Path) -> None:
    # The testbed's tiny Llama: every layer full attention, so a request holds the plain
    # ceiling of blocks: 1000 tokens in 32-token blocks = 32.
    layout = load_layout(str(tiny_model_dir), block_size=32)
    assert [group.kind.value for group in layout.groups] == ["full"]
    assert request_blocks(layout, 1000) == blocks_for_tokens(1000, 32) == 32


@pytest.mark.parametrize(
    ("fixture", "tokens", "expected"),
    [
        # Gemma-3-27b-it (text_config): 7 groups each take block ids from the shared pool. 1000
        # tokens in 16-token blocks: full ceil(1000 / 16) = 63; each sliding group (window 1024)
        # min(ceil(min(1023 + 2048, 1000) / 16) + 1, 63) = 63: 7 x 63 = 441, not 63
        ("gemma-3-27b-it", 1000, 7 * 63),
        # 100000 tokens: 6250 + 6 x (ceil(3071 / 16) + 1 = 193)
        ("gemma-3-27b-it", 100_000, 6250 + 6 * 193),
        # Llama 4 Scout: 4 groups; 1000 tokens: 4 x 63; 100000: 6250 + 3 x ceil(10240 / 16)
        ("llama-4-scout-17b-16e-instruct", 1000, 4 * 63),
        ("llama-4-scout-17b-16e-instruct", 100_000, 6250 + 3 * 640),
        # Qwen2.5-VL and Mistral 3.1: one full group, the plain ceiling
        ("qwen2.5-vl-7b-instruct", 100_000, 6250),
        ("mistral-small-3.1-24b-instruct-2503", 100_000, 6250),
    ],
)
def test_multimodal_model_folder_gives_its_pool_blocks(
    tmp_path: Path, fixture: str, tokens: int, expected: int
) -> None:
    layout = load_layout(str(model_folder(tmp_path, fixture)), block_size=16)
    assert request_blocks(layout, tokens) == expected


def test_missing_and_unusable_configs_are_told_apart(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load_layout(str(tmp_path / "nowhere"), block_size=16)
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": {}}))
    with pytest.raises(ConfigError) as caught:
        load_layout(str(folder), block_size=16)
    assert "text_config.num_hidden_layers" in str(caught.value)

"""Media bounds read from real model configs (tests/fixtures/configs), per estimator/media.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from estimator.media import (
    LLAMA4_DEFAULT_MAX_PATCHES,
    MEDIA_MARKUP_TOKENS,
    QWEN2_VL_DEFAULT_MAX_PIXELS,
    MediaProfile,
    Modality,
)


def _load(fixtures_dir: Path, name: str) -> dict[str, Any]:
    path = fixtures_dir / "configs" / name
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


@pytest.mark.parametrize(
    "name",
    ["tiny-llama.json", "llama-3.1-8b.json", "qwen3-8b.json", "mistral-small-24b.json", "deepseek-v3.json"],
)
def test_text_only_configs_take_no_media(fixtures_dir: Path, name: str) -> None:
    profile = MediaProfile.from_config(_load(fixtures_dir, name))
    assert profile.known
    assert not profile.multimodal
    assert all(profile.rule(modality) is None for modality in Modality)


def test_qwen2_5_vl_bounds_images_by_max_pixels(fixtures_dir: Path) -> None:
    config = _load(fixtures_dir, "multimodal/qwen2.5-vl-7b-instruct.json")
    processor = _load(fixtures_dir, "multimodal/qwen2.5-vl-7b-instruct.preprocessor_config.json")
    profile = MediaProfile.from_config(config, processor)
    image = profile.rule(Modality.IMAGE)
    assert image is not None
    # vLLM's get_max_image_tokens: max_pixels // (patch 14 * merge 2)^2 = 16384 merged patches.
    assert image.tokens_per_item == 12_845_056 // 784 + MEDIA_MARKUP_TOKENS == 16_392
    assert image.placeholder_token_id == 151_655
    video = profile.rule(Modality.VIDEO)
    assert video is not None
    assert video.tokens_per_item is None
    assert video.placeholder_token_id == 151_656
    assert profile.rule(Modality.AUDIO) is None
    # Without the processor config: the image processor's own default max_pixels.
    default = MediaProfile.from_config(config).rule(Modality.IMAGE)
    assert default is not None
    assert default.tokens_per_item == QWEN2_VL_DEFAULT_MAX_PIXELS // 784 + MEDIA_MARKUP_TOKENS
    # A smaller max_pixels (size.longest_edge spelling) lowers the bound.
    small = MediaProfile.from_config(config, {"size": {"longest_edge": 784 * 256}}).rule(Modality.IMAGE)
    assert small is not None
    assert small.tokens_per_item == 256 + MEDIA_MARKUP_TOKENS


def test_gemma3_counts_its_fixed_tokens_per_image(fixtures_dir: Path) -> None:
    config = _load(fixtures_dir, "gemma-3-27b.json")
    image = MediaProfile.from_config(config).rule(Modality.IMAGE)
    assert image is not None
    assert image.tokens_per_item == 256 + MEDIA_MARKUP_TOKENS
    # Pan-and-scan adds up to pan_and_scan_max_num_crops crops of 256 tokens each.
    scanned = MediaProfile.from_config(config, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 4})
    rule = scanned.rule(Modality.IMAGE)
    assert rule is not None
    assert rule.tokens_per_item == 5 * (256 + MEDIA_MARKUP_TOKENS)
    assert MediaProfile.from_config(config).rule(Modality.AUDIO) is None


def test_llama4_counts_tiles_and_the_global_view(fixtures_dir: Path) -> None:
    config = _load(fixtures_dir, "multimodal/llama-4-scout-17b-16e-instruct.json")
    image = MediaProfile.from_config(config).rule(Modality.IMAGE)
    assert image is not None
    # (336 // 14)^2 patches per tile, pixel shuffle 0.5 keeps a quarter: 144 tokens per tile.
    tiles = LLAMA4_DEFAULT_MAX_PATCHES + 1
    assert image.tokens_per_item == tiles * (144 + 1) + MEDIA_MARKUP_TOKENS
    assert image.placeholder_token_id == 200_092


def test_mistral3_counts_rows_of_patches_and_breaks(fixtures_dir: Path) -> None:
    config = _load(fixtures_dir, "multimodal/mistral-small-3.1-24b-instruct.json")
    image = MediaProfile.from_config(config).rule(Modality.IMAGE)
    assert image is not None
    # 1540 // (14 * 2) = 55 rows of 55 image tokens and one break each.
    assert image.tokens_per_item == 55 * 56 + MEDIA_MARKUP_TOKENS
    assert image.placeholder_token_id == 10


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"hidden_size": 1024}},
        {"architectures": ["SomethingForConditionalGeneration"], "model_type": "something"},
    ],
)
def test_unrecognised_towers_reserve_the_rest_of_the_context(config: dict[str, Any]) -> None:
    profile = MediaProfile.from_config(config)
    assert profile.multimodal
    image = profile.rule(Modality.IMAGE)
    assert image is not None
    assert image.tokens_per_item is None


def test_audio_towers_take_audio_bounded_by_the_context() -> None:
    profile = MediaProfile.from_config(
        {"architectures": ["Qwen2AudioForConditionalGeneration"], "audio_config": {"d_model": 1280}}
    )
    audio = profile.rule(Modality.AUDIO)
    assert audio is not None
    assert audio.tokens_per_item is None
    assert profile.rule(Modality.IMAGE) is None


def test_without_a_config_every_modality_is_taken() -> None:
    profile = MediaProfile.unknown()
    assert all(profile.rule(modality) is not None for modality in Modality)

"""Media bounds read from real model configs (tests/fixtures/configs), per estimator/media.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from estimator.media import (
    GEMMA3_CROP_TEXT_TOKENS,
    LLAMA4_DEFAULT_MAX_PATCHES,
    MEDIA_MARKUP_TOKENS,
    QWEN2_VL_DEFAULT_MAX_PIXELS,
    MediaProfile,
    Modality,
    VisionGrid,
    image_size,
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
    assert rule.tokens_per_item == 5 * (256 + MEDIA_MARKUP_TOKENS) + GEMMA3_CROP_TEXT_TOKENS
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


def test_qwen2_vl_image_tokens_match_vllms_processor(fixtures_dir: Path) -> None:
    # Golden counts from vLLM 0.32's own image loading and transformers' Qwen2-VL processor
    # (tests/fixtures/vllm/make_qwen2vl_image_tokens.py): PNG, GIF, WebP and JPEG data URLs,
    # tiny, huge, 1:67, and JPEGs whose EXIF orientation turns them a quarter.
    golden = json.loads((fixtures_dir / "vllm" / "qwen2vl_image_tokens.json").read_text())
    config = _load(fixtures_dir, "multimodal/qwen2.5-vl-7b-instruct.json")
    for name, size in golden["processors"].items():
        rule = MediaProfile.from_config(config, size).rule(Modality.IMAGE)
        assert rule is not None
        assert rule.tokens_per_item is not None
        assert rule.grid == VisionGrid(golden["factor"], size["min_pixels"], size["max_pixels"])
        for case in golden["cases"]:
            expected = case["tokens"][name]
            found = image_size(case["url"])
            assert found is not None, case["format"]
            width, height, may_rotate = found
            assert (width, height) == (case["width"], case["height"])
            assert may_rotate == isinstance(case["extra"], int)
            exact = rule.exact_tokens(case["url"])
            if exact is not None:
                assert exact == expected, (name, case["format"], width, height)
            else:
                # Only an EXIF-turned image whose turn changes its count falls back to the bound.
                assert may_rotate
            assert rule.tokens_per_item >= expected


@pytest.mark.parametrize(
    "url",
    [
        "https://example.invalid/a.png",
        "data:image/png,rawbytes",
        "data:image/png;base64,not base64!",
        "data:image/png;base64,",
        "data:image/bmp;base64,Qk0eAAAAAAAAABoAAAAMAAAAAQABAAEAGAAAAP8A",
        "data:image/jpeg;base64,/9j/AAAA",
    ],
)
def test_image_sizes_that_cannot_be_read_are_none(url: str) -> None:
    assert image_size(url) is None


def test_the_bound_holds_at_the_widest_aspect_the_processor_takes() -> None:
    config = {
        "model_type": "qwen2_vl",
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2},
        "image_token_id": 1,
    }
    for max_pixels in (784 * 16, 784 * 64, 784 * 1280, 12_845_056):
        rule = MediaProfile.from_config(config, {"min_pixels": 3136, "max_pixels": max_pixels}).rule(
            Modality.IMAGE
        )
        assert rule is not None
        assert rule.grid is not None
        assert rule.tokens_per_item is not None
        for long_side in (200, 999, 2000, 5600, 20_000, 60_000):
            for short_side in (1, 5, long_side // 200, long_side // 3, long_side):
                for width, height in ((long_side, max(1, short_side)), (max(1, short_side), long_side)):
                    tokens = rule.grid.tokens(width, height)
                    if tokens is not None:
                        assert tokens <= rule.tokens_per_item, (max_pixels, width, height)

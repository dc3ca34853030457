"""What the served model does with images, audio and video in a chat body, in prompt tokens.

vLLM replaces the placeholder a chat template renders for each media item with as many tokens as
the model's processor makes of it, so a media part is never free. Without vLLM's processors (the
gateway never imports vLLM, and media are not fetched or decoded here) the counter reserves a
documented upper bound per item, read from the model folder's `config.json` (and its processor
config when present) at load time:

| family (config) | image tokens per item, at most | from |
|---|---|---|
| Qwen2-VL, Qwen2.5-VL, Qwen3-VL (`vision_config.spatial_merge_size`) | max_pixels // (patch_size * spatial_merge_size)^2 | vLLM's `Qwen2VLProcessingInfo.get_max_image_tokens`; max_pixels from the processor config (`max_pixels` or `size.longest_edge`) |
| Gemma 3 (`mm_tokens_per_image`) | (crops + 1) * (mm_tokens_per_image + markup) | `Gemma3ProcessingInfo.get_num_image_tokens`; crops = `pan_and_scan_max_num_crops` when pan-and-scan is on, else 0 |
| Llama 4 (`vision_config.pixel_shuffle_ratio`) | (max_patches + 1) * ((image_size // patch_size)^2 * ratio^2 + 1) + markup | `Mllama4ProcessingInfo.get_patch_per_chunk`, tiles plus the global view and tile separators |
| Mistral 3 / Pixtral (`spatial_merge_size` beside `vision_config`) | n * (n + 1), n = image_size // (patch_size * spatial_merge_size) | `Mistral3ProcessingInfo`: n rows of n image tokens and a break |

Every other modality or family the model takes (audio, video, an unknown vision tower) is bounded
by the rest of the context: the prompt is counted as the longest prompt the backend accepts.
A model whose config shows no vision or audio tower is text only, and vLLM refuses media for it
("... is not a multimodal model"), so the counter refuses them too, before queueing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# Tokens a template or processor adds around one item beyond its feature tokens (begin / end
# markers, newlines, tile separators): a small allowance on the high side.
MEDIA_MARKUP_TOKENS = 8
# Qwen2-VL's image processor default (`Qwen2VLImageProcessor.max_pixels`), used when the folder
# has no processor config of its own.
QWEN2_VL_DEFAULT_MAX_PIXELS = 12_845_056
# Llama 4's image processor default tile count (`Llama4ImageProcessor.max_patches`).
LLAMA4_DEFAULT_MAX_PATCHES = 16


class Modality(StrEnum):
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


@dataclass(frozen=True, slots=True)
class MediaRule:
    """How one modality counts for the served model.

    `tokens_per_item` is an upper bound on what the processor makes of one item, or None when no
    formula is known (the rest of the context is reserved). `placeholder_token_id` is the token the
    chat template renders for an item and vLLM replaces; it must not be counted twice."""

    tokens_per_item: int | None
    placeholder_token_id: int | None = None
    source: str = "no formula known: the rest of the context"


@dataclass(frozen=True, slots=True)
class MediaProfile:
    """The media a served model takes. `known` is False when no model config could be read: every
    modality is then taken and bounded by the rest of the context (vLLM decides)."""

    rules: Mapping[Modality, MediaRule] = field(default_factory=dict)
    known: bool = True

    @classmethod
    def text_only(cls) -> MediaProfile:
        return cls({}, known=True)

    @classmethod
    def unknown(cls) -> MediaProfile:
        return cls({}, known=False)

    def rule(self, modality: Modality) -> MediaRule | None:
        """The rule for `modality`, or None when the model does not take it."""
        if not self.known:
            return MediaRule(None)
        return self.rules.get(modality)

    @property
    def multimodal(self) -> bool:
        return not self.known or bool(self.rules)

    def describe(self) -> str:
        """One line for the log: what the model takes and at what bound per item."""
        if not self.known:
            return "no model config: every modality taken, each item bounded by the context"
        if not self.rules:
            return "text only: media parts are refused"
        return "; ".join(
            f"{modality}: {rule.tokens_per_item if rule.tokens_per_item is not None else 'rest of the context'}"
            f" tokens per item ({rule.source})"
            for modality, rule in self.rules.items()
        )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], processor: Mapping[str, Any] | None = None
    ) -> MediaProfile:
        """Read a model's `config.json` (and `preprocessor_config.json`, if any)."""
        processor = processor or {}
        vision = config.get("vision_config")
        audio = config.get("audio_config")
        architectures = config.get("architectures") or []
        model_type = str(config.get("model_type") or "")
        rules: dict[Modality, MediaRule] = {}
        if isinstance(vision, Mapping):
            image = _image_rule(config, vision, processor, model_type)
            rules[Modality.IMAGE] = image
            if model_type.startswith(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni")):
                rules[Modality.VIDEO] = MediaRule(None, _int(config.get("video_token_id")))
        if isinstance(audio, Mapping) or "audio" in model_type or "omni" in model_type:
            rules[Modality.AUDIO] = MediaRule(None, _int(config.get("audio_token_id")))
        if not rules and any(
            isinstance(name, str) and name.endswith("ForConditionalGeneration") for name in architectures
        ):
            # A multimodal architecture whose towers we do not recognise: take every modality and
            # bound it by the context rather than refuse what vLLM may serve.
            return cls.unknown()
        return cls(rules, known=True)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _positive(value: Any) -> int | None:
    number = _int(value)
    return number if number else None


def _image_rule(
    config: Mapping[str, Any], vision: Mapping[str, Any], processor: Mapping[str, Any], model_type: str
) -> MediaRule:
    patch = _positive(vision.get("patch_size"))
    merge = _positive(vision.get("spatial_merge_size"))
    if patch and merge:  # Qwen2-VL family
        size = processor.get("size")
        longest = size.get("longest_edge") if isinstance(size, Mapping) else None
        max_pixels = _positive(processor.get("max_pixels")) or _positive(longest)
        if max_pixels is None and model_type.startswith(("qwen2_vl", "qwen2_5_vl")):
            max_pixels = QWEN2_VL_DEFAULT_MAX_PIXELS
        if max_pixels is not None:
            return MediaRule(
                max_pixels // (patch * merge) ** 2 + MEDIA_MARKUP_TOKENS,
                _int(config.get("image_token_id")),
                f"max_pixels {max_pixels} // ({patch} * {merge})^2 + {MEDIA_MARKUP_TOKENS}",
            )
    per_image = _positive(config.get("mm_tokens_per_image"))
    if per_image:  # Gemma 3
        crops = 0
        if processor.get("do_pan_and_scan"):
            crops = _positive(processor.get("pan_and_scan_max_num_crops")) or 0
        return MediaRule(
            (crops + 1) * (per_image + MEDIA_MARKUP_TOKENS),
            _int(config.get("boi_token_index")),
            f"({crops} crops + 1) * (mm_tokens_per_image {per_image} + {MEDIA_MARKUP_TOKENS})",
        )
    image_size = _positive(vision.get("image_size"))
    ratio = vision.get("pixel_shuffle_ratio")
    if patch and image_size and isinstance(ratio, int | float) and 0 < ratio <= 1:  # Llama 4
        per_tile = (image_size // patch) ** 2 // round(1 / ratio**2)
        tiles = (_positive(processor.get("max_patches")) or LLAMA4_DEFAULT_MAX_PATCHES) + 1
        return MediaRule(
            tiles * (per_tile + 1) + MEDIA_MARKUP_TOKENS,
            _int(config.get("image_token_index")),
            f"{tiles} tiles * ({per_tile} + 1) + {MEDIA_MARKUP_TOKENS}",
        )
    outer_merge = _positive(config.get("spatial_merge_size"))
    if patch and image_size and outer_merge:  # Mistral 3 (Pixtral tower)
        side = image_size // (patch * outer_merge)
        return MediaRule(
            side * (side + 1) + MEDIA_MARKUP_TOKENS,
            _int(config.get("image_token_index")),
            f"{side} rows * ({side} + 1) + {MEDIA_MARKUP_TOKENS}",
        )
    return MediaRule(None, _int(config.get("image_token_id", config.get("image_token_index"))))

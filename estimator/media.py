"""What the served model does with images, audio and video in a chat body, in prompt tokens.

vLLM replaces the placeholder a chat template renders for each media item with as many tokens as
the model's processor makes of it, so a media part is never free. Without vLLM's processors (the
gateway never imports vLLM, and media are not fetched or decoded here) the counter reserves a
documented upper bound per item, read from the model folder's `config.json` (and its processor
config when present) at load time:

| family (config) | image tokens per item, at most | from |
|---|---|---|
| Qwen2-VL, Qwen2.5-VL, Qwen3-VL (`vision_config.spatial_merge_size`) | max(max_pixels // f^2, sqrt(200 * max_pixels) / f), f = patch_size * spatial_merge_size; exact for a data-URL image when the folder has its processor config | transformers' `smart_resize`, which vLLM's `Qwen2VLProcessingInfo` calls; max_pixels / min_pixels from the processor config (`max_pixels` or `size.longest_edge`) |
| Gemma 3 (`mm_tokens_per_image`) | (crops + 1) * (mm_tokens_per_image + markup), plus the crops' sentence | `Gemma3ProcessingInfo.get_num_image_tokens`; crops = `pan_and_scan_max_num_crops` when pan-and-scan is on, else 0 |
| Llama 4 (`vision_config.pixel_shuffle_ratio`) | (max_patches + 1) * ((image_size // patch_size)^2 * ratio^2 + 1) + markup | `Mllama4ProcessingInfo.get_patch_per_chunk`, tiles plus the global view and tile separators |
| Mistral 3 / Pixtral (`spatial_merge_size` beside `vision_config`) | n * (n + 1), n = image_size // (patch_size * spatial_merge_size) | `Mistral3ProcessingInfo`: n rows of n image tokens and a break |

Every other modality or family the model takes (audio, video, an unknown vision tower) is bounded
by the rest of the context: the prompt is counted as the longest prompt the backend accepts.
A model whose config shows no vision or audio tower is text only, and vLLM refuses media for it
("... is not a multimodal model"), so the counter refuses them too, before queueing.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
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
# Tokens of the sentence vLLM writes around Gemma 3's pan-and-scan crops (about 20 in Gemma's
# vocabulary), with room to spare.
GEMMA3_CROP_TEXT_TOKENS = 32
# Llama 4's image processor default tile count (`Llama4ImageProcessor.max_patches`).
LLAMA4_DEFAULT_MAX_PATCHES = 16


class Modality(StrEnum):
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


@dataclass(frozen=True, slots=True)
class VisionGrid:
    """Qwen2-VL's resize (transformers `smart_resize`, which vLLM calls): an image of a known size
    becomes exactly (h / factor) * (w / factor) tokens, factor = patch_size * spatial_merge_size."""

    factor: int
    min_pixels: int
    max_pixels: int

    def tokens(self, width: int, height: int) -> int | None:
        """Tokens of one image, or None when the processor would refuse it (aspect ratio > 200)."""
        if min(width, height) < 1 or max(width, height) / min(width, height) > 200:
            return None
        factor = self.factor
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return (h_bar // factor) * (w_bar // factor)


@dataclass(frozen=True, slots=True)
class MediaRule:
    """How one modality counts for the served model.

    `tokens_per_item` is an upper bound on what the processor makes of one item, or None when no
    formula is known (the rest of the context is reserved). `placeholder_token_id` is the token the
    chat template renders for an item and vLLM replaces; it must not be counted twice. With a
    `grid`, an image whose size can be read from the body (a data URL) counts exactly."""

    tokens_per_item: int | None
    placeholder_token_id: int | None = None
    source: str = "no formula known: the rest of the context"
    grid: VisionGrid | None = None

    def exact_tokens(self, url: str | None) -> int | None:
        """The item's exact token count when its size is in the body and a formula is known."""
        if self.grid is None or url is None:
            return None
        size = image_size(url)
        if size is None:
            return None
        width, height, may_rotate = size
        tokens = self.grid.tokens(width, height)
        if tokens is None or (may_rotate and self.grid.tokens(height, width) != tokens):
            return None  # EXIF may turn it a quarter (vLLM applies it): the bound holds instead
        return tokens


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
            min_pixels = _positive(processor.get("min_pixels"))
            if min_pixels is None and isinstance(size, Mapping):
                min_pixels = _positive(size.get("shortest_edge"))
            grid = None
            if processor and min_pixels is not None and processor.get("do_resize", True):
                # The folder's own processor config is at hand: data-URL images count exactly.
                grid = VisionGrid(patch * merge, min_pixels, max_pixels)
            factor = patch * merge
            # The resize keeps h * w within max_pixels, except that a side never goes below one
            # factor: a 1:200 image (the widest the processor takes) then gets up to
            # sqrt(200 * max_pixels) / factor tokens, more than max_pixels / factor^2 when
            # max_pixels is small.
            most = max(max_pixels // factor**2, math.isqrt(200 * max_pixels) // factor + 1)
            return MediaRule(
                most + MEDIA_MARKUP_TOKENS,
                _int(config.get("image_token_id")),
                f"max(max_pixels {max_pixels} // {factor}^2, sqrt(200 * max_pixels) / {factor})"
                f" + {MEDIA_MARKUP_TOKENS}",
                grid,
            )
    per_image = _positive(config.get("mm_tokens_per_image"))
    if per_image:  # Gemma 3
        crops = 0
        if processor.get("do_pan_and_scan"):
            crops = _positive(processor.get("pan_and_scan_max_num_crops")) or 0
        # With crops vLLM also writes "Here is the original image ... and here are some crops to
        # help you see better ...": GEMMA3_CROP_TEXT_TOKENS covers that sentence.
        return MediaRule(
            (crops + 1) * (per_image + MEDIA_MARKUP_TOKENS) + (GEMMA3_CROP_TEXT_TOKENS if crops else 0),
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


# ---------------------------------------------------------------- image sizes from data URLs

# Enough of a file's head to find its size in every format read here but JPEG, whose size
# marker may follow an embedded thumbnail: JPEG data is decoded up to this many bytes.
_IMAGE_HEAD_BYTES = 64
_JPEG_SCAN_BYTES = 1 << 20


def image_size(url: str) -> tuple[int, int, bool] | None:
    """(width, height, may_rotate) of a base64 data-URL image (PNG, GIF, WebP, JPEG), or None.

    `may_rotate` is True when the file carries EXIF data, whose orientation vLLM applies before
    resizing. Nothing but the header is decoded, except for JPEG (up to 1 MiB)."""
    if not url.startswith("data:image/"):
        return None
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        return None
    payload = payload.strip()
    try:
        head = _b64_prefix(payload, _IMAGE_HEAD_BYTES)
        if head.startswith(b"\xff\xd8"):
            return _jpeg_size(_b64_prefix(payload, _JPEG_SCAN_BYTES))
        if head.startswith(b"\x89PNG\r\n\x1a\n"):
            return _png_size(payload, head)
        if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
            width, height = struct.unpack("<HH", head[6:10])
            return width, height, False
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_size(head)
    except (binascii.Error, ValueError, struct.error):
        return None
    return None


def _b64_prefix(payload: str, size: int) -> bytes:
    chars = min(len(payload), (size + 2) // 3 * 4)
    chars -= chars % 4
    return base64.b64decode(payload[:chars], validate=True)


def _png_size(payload: str, head: bytes) -> tuple[int, int, bool] | None:
    if head[12:16] != b"IHDR" or len(head) < 24:
        return None
    width, height = struct.unpack(">II", head[16:24])
    # An eXIf chunk, if any, comes before the image data: look through the chunk headers.
    data = _b64_prefix(payload, _JPEG_SCAN_BYTES)
    offset, exif = 8, False
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if kind in (b"IDAT", b"IEND"):
            break
        exif = exif or kind == b"eXIf"
        offset += 12 + length
    else:
        exif = True  # the chunks run past what was read: assume the worst
    return width, height, exif


def _webp_size(head: bytes) -> tuple[int, int, bool] | None:
    kind = head[12:16]
    if kind == b"VP8 " and len(head) >= 30:
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF, False
    if kind == b"VP8L" and len(head) >= 25:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, False
    if kind == b"VP8X" and len(head) >= 30:
        flags = head[20]
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return width, height, bool(flags & 0x08)
    return None


_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(data: bytes) -> tuple[int, int, bool] | None:
    offset, exif = 2, False
    while offset + 4 <= len(data):
        if data[offset] != 0xFF:
            return None
        marker = data[offset + 1]
        if marker == 0xFF:  # fill byte
            offset += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            offset += 2
            continue
        (length,) = struct.unpack(">H", data[offset + 2 : offset + 4])
        if marker == 0xE1 and data[offset + 4 : offset + 10] == b"Exif\x00\x00":
            exif = True
        if marker in _JPEG_SOF and offset + 9 <= len(data):
            height, width = struct.unpack(">HH", data[offset + 5 : offset + 9])
            return width, height, exif
        offset += 2 + length
    return None

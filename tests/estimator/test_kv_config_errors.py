"""A config that lacks or mangles what the KV math needs fails with one line naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from estimator.kv import ConfigError, kv_cache_layout, model_shape

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def without(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in keys}


CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("empty config", {}, {}, "num_hidden_layers"),
    ("no layer count", without(LLAMA, "num_hidden_layers"), {}, "num_hidden_layers"),
    ("no head count", without(LLAMA, "num_attention_heads"), {}, "num_attention_heads"),
    (
        "GPT-2 names, no n_head",
        {"model_type": "gpt2", "n_layer": 12, "n_embd": 768},
        {},
        "num_attention_heads",
    ),
    ("layer count as text", {**LLAMA, "num_hidden_layers": "32"}, {}, "num_hidden_layers"),
    ("layer count zero", {**LLAMA, "num_hidden_layers": 0}, {}, "num_hidden_layers"),
    ("layer count boolean", {**LLAMA, "num_hidden_layers": True}, {}, "num_hidden_layers"),
    ("negative KV heads", {**LLAMA, "num_key_value_heads": -8}, {}, "num_key_value_heads"),
    ("no head_dim and no hidden size", without(LLAMA, "hidden_size"), {}, "hidden_size"),
    ("hidden size not a multiple of heads", {**LLAMA, "hidden_size": 4100}, {}, "head_dim"),
    ("MLA without the rotary part", without(DEEPSEEK, "qk_rope_head_dim"), {}, "qk_rope_head_dim"),
    ("negative window", {**LLAMA, "sliding_window": -1}, {}, "sliding_window"),
    ("layer_types too short", {**LLAMA, "layer_types": ["full_attention"] * 31}, {}, "layer_types"),
    ("unknown layer type", {**LLAMA, "layer_types": ["full_attention"] * 31 + ["cross"]}, {}, "layer_types"),
    ("no attention layer at all", {**LLAMA, "layer_types": ["mamba"] * 32}, {}, "layer_types"),
    (
        "text_config without heads",
        {"model_type": "gemma3", "text_config": without(LLAMA, "num_attention_heads")},
        {},
        "num_attention_heads",
    ),
    (
        "text_config without a layer count",
        {"model_type": "qwen3_vl", "text_config": without(LLAMA, "num_hidden_layers")},
        {},
        "num_hidden_layers",
    ),
    (
        "text_config without hidden size (the vision tower's does not stand in)",
        {
            "model_type": "qwen3_vl",
            "text_config": {**without(LLAMA, "hidden_size"), "head_dim": 128},
            "vision_config": {"depth": 27, "hidden_size": 1152},
            "hidden_size": 4096,
        },
        {},
        "hidden_size",
    ),
    ("text_config not an object", {"model_type": "llava", "text_config": "llama"}, {}, "text_config"),
    (
        "Llama 4 no_rope_layers too short",
        {
            "model_type": "llama4",
            "text_config": {**LLAMA, "model_type": "llama4_text", "no_rope_layers": [1, 1, 1, 0]},
        },
        {},
        "no_rope_layers",
    ),
    (
        "Llama 4 chunk size as text",
        {"model_type": "llama4", "text_config": {**LLAMA, "attention_chunk_size": "8k"}},
        {},
        "attention_chunk_size",
    ),
    ("unknown model dtype", {**LLAMA, "torch_dtype": "int4"}, {}, "dtype"),
    ("unknown --kv-cache-dtype", LLAMA, {"kv_cache_dtype": "fp4"}, "dtype"),
    ("unknown --dtype", LLAMA, {"dtype": "float64"}, "dtype"),
]


@pytest.mark.parametrize(
    ("config", "flags", "field"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_bad_config_names_the_field(config: dict[str, Any], flags: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        kv_cache_layout(model_shape(config), **flags)
    assert caught.value.field == field
    message = str(caught.value)
    assert field in message
    assert "\n" not in message


def test_the_good_configs_behind_the_table_are_accepted() -> None:
    # The cases above break one thing each; unbroken, both build a layout.
    assert kv_cache_layout(model_shape(LLAMA)).bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert kv_cache_layout(model_shape(DEEPSEEK)).bytes_per_token == 61 * 576 * 2


@pytest.mark.parametrize(
    ("config", "path"),
    [
        (
            {"model_type": "gemma3", "text_config": without(LLAMA, "num_attention_heads")},
            "text_config.num_attention_heads",
        ),
        ({"model_type": "mistral3", "text_config": without(LLAMA, "hidden_size")}, "text_config.hidden_size"),
        (
            {"model_type": "qwen3_vl", "text_config": {**LLAMA, "num_hidden_layers": 0}},
            "text_config.num_hidden_layers",
        ),
        (
            {"model_type": "gemma3", "text_config": {**LLAMA, "layer_types": ["full_attention"]}},
            "text_config.layer_types",
        ),
        ({"model_type": "gemma3", "text_config": {**LLAMA, "hidden_size": 4100}}, "text_config.head_dim"),
        (without(LLAMA, "hidden_size"), "'hidden_size'"),  # a flat config names the bare field
    ],
)
def test_a_text_config_error_names_the_nested_field(config: dict[str, Any], path: str) -> None:
    # The file nests the field under text_config, so that is where the message points.
    with pytest.raises(ConfigError) as caught:
        model_shape(config)
    assert path in str(caught.value)
    assert "\n" not in str(caught.value)

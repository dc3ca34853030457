"""KV bytes per token for real model configs, worked out by hand, and vLLM's block accounting.

Every expected number below is computed in the comment next to it from the config fixture
(tests/fixtures/configs, sources in SOURCES.md), not from the code under test. "acct" is what
vLLM's block accounting charges per token (`bytes_per_token`, padding layers included); "phys" is
the K/V one token occupies (`bytes_per_token_physical`). Both are per GPU.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from estimator.kv import (
    KVCacheLayout,
    LayerKind,
    blocks_for_tokens,
    capacity_plan,
    kv_cache_layout,
    model_shape,
    request_blocks,
)

CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
VLLM_FIXTURES = CONFIGS.parent / "vllm"


@cache
def config(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return loaded


def layout(name: str, **flags: Any) -> KVCacheLayout:
    return kv_cache_layout(model_shape(config(name)), **flags)


# (fixture, serving flags, acct, phys)
BYTES_PER_TOKEN: list[tuple[str, dict[str, Any], int, int]] = [
    # Llama-3.1-8B: 2 (K,V) x 32 layers x 8 KV heads x 128 x 2 B (bf16) = 131072
    ("llama-3.1-8b", {}, 131072, 131072),
    # --kv-cache-dtype fp8: 2 x 32 x 8 x 128 x 1 B = 65536
    ("llama-3.1-8b", {"kv_cache_dtype": "fp8"}, 65536, 65536),
    # --kv-cache-dtype fp8_e5m2: also 1 B per element = 65536
    ("llama-3.1-8b", {"kv_cache_dtype": "fp8_e5m2"}, 65536, 65536),
    # --dtype float32 with kv-cache-dtype auto: the cache follows the model dtype, 4 B = 262144
    ("llama-3.1-8b", {"dtype": "float32"}, 262144, 262144),
    # tp=2: 8 KV heads / 2 = 4 per GPU: 2 x 32 x 4 x 128 x 2 = 65536
    ("llama-3.1-8b", {"tp": 2}, 65536, 65536),
    # pp=3: 32 layers split 11/11/10 (remainder to the stages before the last);
    # the 11-layer stage bounds: 2 x 11 x 8 x 128 x 2 = 45056
    ("llama-3.1-8b", {"pp": 3}, 45056, 45056),
    # Llama-3.1-70B: 2 x 80 layers x 8 x 128 x 2 = 327680
    ("llama-3.1-70b", {}, 327680, 327680),
    # tp=4: 2 KV heads per GPU: 2 x 80 x 2 x 128 x 2 = 81920
    ("llama-3.1-70b", {"tp": 4}, 81920, 81920),
    # tp=8: 1 KV head per GPU: 2 x 80 x 1 x 128 x 2 = 40960
    ("llama-3.1-70b", {"tp": 8}, 40960, 40960),
    # tp=16 > 8 KV heads: vLLM replicates so each GPU still holds one: 40960 (not 20480)
    ("llama-3.1-70b", {"tp": 16}, 40960, 40960),
    # tp=8, pp=2: 40 layers per stage, 1 head: 2 x 40 x 1 x 128 x 2 = 20480
    ("llama-3.1-70b", {"tp": 8, "pp": 2}, 20480, 20480),
    # Qwen2.5-7B-Instruct: no head_dim, so 3584 / 28 heads = 128; use_sliding_window false:
    # 2 x 28 x 4 KV heads x 128 x 2 = 57344
    ("qwen2.5-7b-instruct", {}, 57344, 57344),
    # tp=8 > 4 KV heads: replicated to 1 per GPU: 2 x 28 x 1 x 128 x 2 = 14336
    ("qwen2.5-7b-instruct", {"tp": 8}, 14336, 14336),
    # Qwen3-0.6B: head_dim 128 from the config (1024 / 16 would be 64): 2 x 28 x 8 x 128 x 2 = 114688
    ("qwen3-0.6b", {}, 114688, 114688),
    # Qwen3-8B: 2 x 36 x 8 x 128 x 2 = 147456
    ("qwen3-8b", {}, 147456, 147456),
    # Qwen3-14B: 2 x 40 x 8 x 128 x 2 = 163840
    ("qwen3-14b", {}, 163840, 163840),
    # Qwen3-30B-A3B (MoE; experts do not touch the KV cache): 2 x 48 x 4 x 128 x 2 = 98304
    ("qwen3-30b-a3b", {}, 98304, 98304),
    # ... with --kv-cache-dtype fp8: 2 x 48 x 4 x 128 x 1 = 49152
    ("qwen3-30b-a3b", {"kv_cache_dtype": "fp8"}, 49152, 49152),
    # Qwen3-235B-A22B: 2 x 94 x 4 x 128 x 2 = 192512; tp=4 -> 1 head: 2 x 94 x 1 x 128 x 2 = 48128
    ("qwen3-235b-a22b", {}, 192512, 192512),
    ("qwen3-235b-a22b", {"tp": 4}, 48128, 48128),
    # Mistral-7B-v0.1: every layer slides (window 4096) but charges like full per token:
    # 2 x 32 x 8 x 128 x 2 = 131072
    ("mistral-7b-v0.1", {}, 131072, 131072),
    # Mixtral-8x7B (sliding_window null): 2 x 32 x 8 x (4096 / 32 = 128) x 2 = 131072
    ("mixtral-8x7b", {}, 131072, 131072),
    # Mistral-Small-24B: head_dim 128 from the config, not 5120 / 32 = 160:
    # 2 x 40 x 8 x 128 x 2 = 163840 (160 would give 204800)
    ("mistral-small-24b", {}, 163840, 163840),
    # Gemma-2-9B: config says float32, served in 16 bits; head_dim 256; 21 sliding + 21 full
    # layers form two groups of 21, no padding: 2 x 42 x 8 x 256 x 2 = 344064
    ("gemma-2-9b", {}, 344064, 344064),
    # Gemma-2-9B pp=2: stages of 21 layers; stage 0 holds 11 sliding (0, 2, .., 20) + 10 full,
    # so each GPU allocates 11 tensors per group: acct 2 groups x 11 x (2 x 8 x 256 x 2 = 8192)
    # = 180224, phys 21 x 8192 = 172032
    ("gemma-2-9b", {"pp": 2}, 180224, 172032),
    # Gemma-3-27B (text_config): 62 layers, every 6th full -> 10 full + 52 sliding; per layer
    # 2 x 16 x 128 x 2 = 8192. Groups of 10: 1 full + ceil(52 / 10) = 6 sliding, each padded to
    # 10 tensors: acct 7 x 10 x 8192 = 573440; phys 62 x 8192 = 507904
    ("gemma-3-27b", {}, 573440, 507904),
    # tp=2: 8 heads per GPU halves both: 286720 and 253952
    ("gemma-3-27b", {"tp": 2}, 286720, 253952),
    # DeepSeek-V2-Lite (MLA): one latent of 512 + 64 per layer, no factor 2: 27 x 576 x 2 = 31104
    ("deepseek-v2-lite", {}, 31104, 31104),
    # tp=2 leaves MLA unchanged (every rank holds the whole latent): 31104
    ("deepseek-v2-lite", {"tp": 2}, 31104, 31104),
    # tp=2, pp=2: 27 layers split 14/13, the 14-layer stage bounds: 14 x 576 x 2 = 16128
    ("deepseek-v2-lite", {"tp": 2, "pp": 2}, 16128, 16128),
    # DeepSeek-V3: (512 + 64) x 61 x 2 = 70272, and the same at tp=8
    ("deepseek-v3", {}, 70272, 70272),
    ("deepseek-v3", {"tp": 8}, 70272, 70272),
    # pp=2: 61 layers split 31/30: 31 x 576 x 2 = 35712
    ("deepseek-v3", {"pp": 2}, 35712, 35712),
    # fp8 KV: 61 x 576 x 1 = 35136
    ("deepseek-v3", {"kv_cache_dtype": "fp8"}, 35136, 35136),
    # gpt-oss-20b: no torch_dtype (weights are mxfp4), the cache is 16-bit; 12 sliding + 12 full
    # layers, two groups of 12: 2 x 24 x 8 x 64 x 2 = 49152
    ("gpt-oss-20b", {}, 49152, 49152),
    # gpt-oss-120b: 2 x 36 x 8 x 64 x 2 = 73728
    ("gpt-oss-120b", {}, 73728, 73728),
    # Phi-3-mini-4k: 3072 / 32 heads = 96, no GQA: 2 x 32 x 32 x 96 x 2 = 393216
    ("phi-3-mini-4k", {}, 393216, 393216),
    # GPT-2: n_layer 12, n_head 12, n_embd 768 -> head 64; no dtype in the config (float32),
    # served in 16 bits: 2 x 12 x 12 x 64 x 2 = 36864
    ("gpt2", {}, 36864, 36864),
    # Qwen3-Next-80B-A3B: every 4th of 48 layers is full attention (12), the rest linear
    # attention with a fixed state: 2 x 12 x 2 KV heads x 256 x 2 = 24576
    ("qwen3-next-80b-a3b", {}, 24576, 24576),
    # tp=4 > 2 KV heads: 1 per GPU: 2 x 12 x 1 x 256 x 2 = 12288
    ("qwen3-next-80b-a3b", {"tp": 4}, 12288, 12288),
    # Jamba-v0.1: attention at layer i % 8 == 4 -> 4 of 32 layers; 2 x 4 x 8 x 128 x 2 = 16384
    ("jamba-v0.1", {}, 16384, 16384),
    # Granite-4.0-H-Small: 4 attention layers of 40 (36 Mamba): 2 x 4 x 8 x 128 x 2 = 16384
    ("granite-4.0-h-small", {}, 16384, 16384),
    # The testbed's tiny Llama: 2 x 2 layers x 2 KV heads x 64 x 2 = 1024
    ("tiny-llama", {}, 1024, 1024),
    # ---- multimodal configs: the text model's layers only; the vision tower keeps no KV cache
    # Qwen2.5-VL-7B-Instruct as published (flat, vision_config beside the text fields): no
    # head_dim, 3584 / 28 heads = 128; sliding_window 32768 but use_sliding_window false, so
    # every layer is full: 2 x 28 layers x 4 KV heads x 128 x 2 B (bf16) = 57344
    ("qwen2.5-vl-7b-instruct", {}, 57344, 57344),
    # tp=4: 1 KV head per GPU: 2 x 28 x 1 x 128 x 2 = 14336
    ("qwen2.5-vl-7b-instruct", {"tp": 4}, 14336, 14336),
    # the same checkpoint re-saved by transformers 4.53 (fields also under text_config, whose
    # torch_dtype says float32): vLLM takes the top-level bfloat16, and it is served in 16 bits
    # either way: 2 x 28 x 4 x 128 x 2 = 57344
    ("qwen2.5-vl-7b-instruct-resaved", {}, 57344, 57344),
    # Qwen3-VL-8B-Instruct: text_config 36 layers, 8 KV heads, head_dim 128, dtype only in
    # text_config (bfloat16): 2 x 36 x 8 x 128 x 2 = 147456
    ("qwen3-vl-8b-instruct", {}, 147456, 147456),
    # --kv-cache-dtype fp8: 2 x 36 x 8 x 128 x 1 = 73728
    ("qwen3-vl-8b-instruct", {"kv_cache_dtype": "fp8"}, 73728, 73728),
    # Llama-4-Scout-17B-16E-Instruct: 48 layers; no_rope_layers empty -> every 4th layer NoPE
    # (12 full), the other 36 chunked local attention (chunk 8192). Per layer 2 x 8 x 128 x 2 =
    # 4096 B. Group size min(12, 36) = 12 (36 >= 1.5 x 12): 1 full + 3 chunked groups of 12, no
    # padding: acct 4 x 12 x 4096 = 196608 = phys 48 x 4096
    ("llama-4-scout-17b-16e-instruct", {}, 196608, 196608),
    # tp=8: 1 KV head per GPU: 2 x 48 x 1 x 128 x 2 = 24576; tp=4: 2 heads, 2 x 48 x 2 x 128 x 2
    # = 49152
    ("llama-4-scout-17b-16e-instruct", {"tp": 8}, 24576, 24576),
    ("llama-4-scout-17b-16e-instruct", {"tp": 4}, 49152, 49152),
    # Gemma-3-27b-it as published (text_config relies on Gemma3TextConfig defaults): the same
    # geometry as gemma-3-27b above: acct 7 groups x 10 x 8192 = 573440, phys 62 x 8192 = 507904
    ("gemma-3-27b-it", {}, 573440, 507904),
    # Mistral-Small-3.1-24B-Instruct-2503 (Mistral 3): text_config 40 layers, 8 KV heads,
    # head_dim 128 (not 5120 / 32 = 160), sliding_window null: 2 x 40 x 8 x 128 x 2 = 163840
    ("mistral-small-3.1-24b-instruct-2503", {}, 163840, 163840),
    # tp=2: 4 KV heads per GPU: 2 x 40 x 4 x 128 x 2 = 81920
    ("mistral-small-3.1-24b-instruct-2503", {"tp": 2}, 81920, 81920),
    # The tiny random Llama 4 served for real (see test_tiny_llama4_*): 8 layers, 6 chunked + 2
    # full, groups of 2, per layer 2 x 2 KV heads x 64 x 2 = 512 B: 4 x 2 x 512 = 4096 = 8 x 512
    ("tiny-llama4", {}, 4096, 4096),
]


@pytest.mark.parametrize(
    ("name", "flags", "accounting", "physical"),
    BYTES_PER_TOKEN,
    ids=[
        f"{name}-{'-'.join(f'{k}={v}' for k, v in flags.items()) or 'default'}"
        for name, flags, _, _ in BYTES_PER_TOKEN
    ],
)
def test_bytes_per_token(name: str, flags: dict[str, Any], accounting: int, physical: int) -> None:
    result = layout(name, **flags)
    assert result.bytes_per_token == accounting
    assert result.bytes_per_token_physical == physical


def test_every_fixture_config_is_in_the_table() -> None:
    fixtures = {path.stem for path in CONFIGS.glob("*.json")}
    assert fixtures == {name for name, _, _, _ in BYTES_PER_TOKEN}


@pytest.mark.parametrize(
    ("name", "kv_heads_per_gpu", "head_dim"),
    [
        ("llama-3.1-8b", 8, 128),
        ("qwen3-0.6b", 8, 128),  # head_dim from the config, not hidden / heads = 64
        ("mistral-small-24b", 8, 128),  # not 160
        ("gemma-2-9b", 8, 256),  # not 3584 / 16 = 224
        ("gemma-3-27b", 16, 128),  # nested under text_config; not 5376 / 32 = 168
        ("gpt2", 12, 64),  # GPT-2 names: n_head, n_embd
        ("deepseek-v3", 1, 576),  # MLA: one latent "head" of kv_lora_rank + qk_rope_head_dim
        ("qwen2.5-vl-7b-instruct", 4, 128),  # flat: 3584 / 28, not the vision tower's 1280 / 16
        ("qwen3-vl-8b-instruct", 8, 128),  # text_config, not the vision tower's 16 heads
        ("llama-4-scout-17b-16e-instruct", 8, 128),
        ("mistral-small-3.1-24b-instruct-2503", 8, 128),  # not 5120 / 32 = 160, not pixtral's 64
    ],
)
def test_heads_and_head_size(name: str, kv_heads_per_gpu: int, head_dim: int) -> None:
    result = layout(name)
    assert (result.kv_heads_per_gpu, result.head_dim) == (kv_heads_per_gpu, head_dim)


def test_fp8_halves_every_16_bit_model() -> None:
    for name in ("llama-3.1-8b", "qwen3-8b", "gemma-3-27b", "deepseek-v3", "gpt-oss-20b"):
        assert layout(name, kv_cache_dtype="fp8").bytes_per_token * 2 == layout(name).bytes_per_token


# ---------------------------------------------------------------- hybrid grouping
# vLLM's _get_kv_cache_groups_uniform_page_size (v1/core/kv_cache_utils.py): bucket layers by
# kind, group size = the smallest bucket (or the largest, when largest < 1.5 x smallest), split
# each bucket into ceil(len / group size) groups taking every n-th layer, pad each group to the
# group size. A block id stands for group-size pages; every non-state group takes one block id
# per block_size tokens.


def groups_of(result: KVCacheLayout) -> list[tuple[str, int]]:
    return sorted((group.kind.value, group.layers_on_worst_stage) for group in result.groups)


def test_gemma3_groups_ten_full_and_six_padded_sliding() -> None:
    result = layout("gemma-3-27b")
    # 52 sliding layers taken every 6th: sizes 9, 9, 9, 9, 8, 8 (52 = 4 x 9 + 2 x 8)
    assert groups_of(result) == sorted([("full", 10)] + [("sliding", 9)] * 4 + [("sliding", 8)] * 2)
    assert result.group_size == 10
    assert result.bytes_per_block == 10 * 8192 * 16  # 10 pages of 16 tokens x 8192 B


def test_gpt_oss_groups_evenly() -> None:
    result = layout("gpt-oss-20b")
    assert groups_of(result) == [("full", 12), ("sliding", 12)]
    assert result.bytes_per_block == 12 * 2048 * 16


def layer_types_config(layer_types: list[str]) -> dict[str, Any]:
    return {
        "model_type": "synthetic",
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 512,
        "sliding_window": 256,
        "layer_types": layer_types,
        "torch_dtype": "bfloat16",
    }


PER_LAYER = 2 * 8 * 64 * 2  # 2048 B per token per layer in the synthetic configs


@pytest.mark.parametrize(
    ("full", "sliding", "groups", "group_size"),
    [
        # 12 sliding + 13 full: 13 < 1.5 x 12, so the group size is 13 and the sliding group is
        # padded by one (vLLM's gpt-oss + eagle example): 2 groups of 13
        (13, 12, [("full", 13), ("sliding", 12)], 13),
        # 10 full + 20 sliding: group size 10, sliding split in two, no padding
        (10, 20, [("full", 10), ("sliding", 10), ("sliding", 10)], 10),
        # 20 full + 30 sliding: 30 is not < 1.5 x 20, so the group size is 20 and the 30
        # sliding layers become two groups of 15, each padded to 20
        (20, 30, [("full", 20), ("sliding", 15), ("sliding", 15)], 20),
    ],
)
def test_group_size_heuristic(
    full: int, sliding: int, groups: list[tuple[str, int]], group_size: int
) -> None:
    kinds = ["full_attention"] * full + ["sliding_attention"] * sliding
    result = kv_cache_layout(model_shape(layer_types_config(kinds)))
    assert groups_of(result) == sorted(groups)
    assert result.group_size == group_size
    assert result.bytes_per_token_physical == (full + sliding) * PER_LAYER
    assert result.bytes_per_token == len(groups) * group_size * PER_LAYER


def test_state_groups_take_one_block_and_charge_nothing_per_token() -> None:
    result = layout("qwen3-next-80b-a3b")
    # 12 full + 36 linear-attention layers: group size 12, the state bucket splits in three
    assert groups_of(result) == [("full", 12), ("state", 12), ("state", 12), ("state", 12)]
    # a 1000-token request: ceil(1000 / 16) = 63 blocks for the full group + 1 per state group
    assert request_blocks(result, 1000) == 63 + 3
    jamba = layout("jamba-v0.1")
    assert groups_of(jamba) == [("full", 4)] + [("state", 4)] * 7  # 28 Mamba layers / 4
    assert request_blocks(jamba, 1000) == 63 + 7


# ---------------------------------------------------------------- sliding-window caps
# A sliding group holds at most the window's last `window - 1` tokens plus the tokens in flight
# (max_num_batched_tokens, 2048 by default) and one more block for the window's unaligned
# start (SlidingWindowSpec.max_admission_blocks_per_request), and never more than the request.


@pytest.mark.parametrize(
    ("name", "tokens", "flags", "expected"),
    [
        # Mistral, one sliding group, window 4096: ceil((4095 + 2048) / 16) + 1 = 384 + 1
        ("mistral-7b-v0.1", 100_000, {}, 385),
        # a request shorter than the cap keeps every block: ceil(1000 / 16) = 63
        ("mistral-7b-v0.1", 1000, {}, 63),
        # 6200 tokens: ceil(6200 / 16) = 388 would exceed the cap, so 385
        ("mistral-7b-v0.1", 6200, {}, 385),
        # Gemma-2 alternates: full group ceil(100000 / 16) = 6250 + sliding group 385
        ("gemma-2-9b", 100_000, {}, 6250 + 385),
        # gpt-oss window 128: full 6250 + sliding ceil((127 + 2048) / 16) + 1 = 136 + 1
        ("gpt-oss-20b", 100_000, {}, 6250 + 137),
        # with 8192 tokens in flight: ceil((127 + 8192) / 16) + 1 = 520 + 1
        ("gpt-oss-20b", 100_000, {"max_num_batched_tokens": 8192}, 6250 + 521),
        # Gemma-3-27B: 1 full group + 6 sliding (window 1024): 6250 + 6 x (ceil(3071 / 16) + 1)
        ("gemma-3-27b", 100_000, {}, 6250 + 6 * 193),
        # Phi-3-mini-4k slides on every layer (window 2047), as vLLM 0.32 builds it:
        # ceil((2046 + 2048) / 16) + 1 = 256 + 1, but a 4096-token request has only 256 blocks
        ("phi-3-mini-4k", 4096, {}, 256),
        ("phi-3-mini-4k", 3000, {}, 188),
    ],
)
def test_sliding_window_caps_request_blocks(
    name: str, tokens: int, flags: dict[str, Any], expected: int
) -> None:
    assert request_blocks(layout(name, **flags), tokens) == expected


def test_full_attention_request_blocks_is_plain_ceiling() -> None:
    result = layout("llama-3.1-8b", block_size=32)
    assert [request_blocks(result, t) for t in (0, 1, 32, 33, 1024)] == [0, 1, 1, 2, 32]
    assert blocks_for_tokens(1025, 32) == 33


def test_phi3_window_is_applied_to_every_layer() -> None:
    shape = model_shape(config("phi-3-mini-4k"))
    assert shape.sliding_window == 2047
    assert set(shape.layer_kinds) == {LayerKind.SLIDING}


def test_zero_sliding_window_means_none() -> None:
    # vLLM reads sliding_window 0 as "no window"; so does the estimator.
    shape = model_shape({**config("mistral-7b-v0.1"), "sliding_window": 0})
    assert shape.sliding_window is None
    assert set(shape.layer_kinds) == {LayerKind.FULL}


# ---------------------------------------------------------------- capacity


def test_testbed_startup_log_is_reproduced_exactly() -> None:
    # tests/fixtures/vllm/startup_tiny_llama_0.32.0.log: "Explicitly set (1.0/8.96) GiB for KV
    # cache", "Overriding num_gpu_blocks=32768 with num_gpu_blocks_override=64", "CPU KV cache
    # size: 2,048 tokens, Maximum concurrency for 1,024 tokens per request: 2.00x".
    tiny = layout("tiny-llama", block_size=32)
    assert tiny.bytes_per_block == 32 * 1024  # 32 tokens x 1024 B
    sized = capacity_plan(tiny, max_model_len=1024, gpu_memory_gib=1.0, gpu_memory_utilization=1.0)
    assert sized.num_blocks == 32768  # 1 GiB / 32 KiB
    overridden = capacity_plan(tiny, max_model_len=1024, num_blocks_override=64)
    assert overridden.num_blocks == 64
    assert overridden.kv_cache_tokens == 2048  # 64 blocks / 32 per request x 1024
    assert overridden.max_concurrency == 2.0


def test_startup_concurrency_charges_the_full_sliding_reservation() -> None:
    # vLLM's start-up report sizes a sliding group at its cap even when max_model_len is shorter:
    # Mistral at max_model_len 4096: ceil(min(4095 + 2048, 4096) / 16) + 1 = 257 blocks per
    # request, one more than the 256 a 4096-token request can actually hold.
    mistral = layout("mistral-7b-v0.1")
    assert request_blocks(mistral, 4096) == 256
    plan = capacity_plan(mistral, max_model_len=4096, num_blocks_override=2570)
    assert plan.max_concurrency == 10.0  # 2570 / 257
    assert plan.kv_cache_tokens == 40960


def test_capacity_divides_free_memory_by_block_bytes() -> None:
    # Llama-3.1-8B on an 80 GiB GPU at 0.75 with 15 GiB of weights: 45 GiB free;
    # a 16-token block is 16 x 131072 B = 2 MiB, so 45 x 512 = 23040 blocks = 368640 tokens.
    plan = capacity_plan(
        layout("llama-3.1-8b"),
        max_model_len=8192,
        gpu_memory_gib=80,
        gpu_memory_utilization=0.75,
        weights_bytes=15 * 2**30,
    )
    assert plan.num_blocks == 23040
    assert plan.kv_cache_tokens == 368640
    assert plan.max_concurrency == 45.0  # 23040 / (8192 tokens = 512 blocks)


# ---------------------------------------------------------------- multimodal configs
# vLLM reads a multimodal model through hf_config.get_text_config(): layers, heads, windows and
# chunks come from text_config; the vision tower (its own `num_hidden_layers` / `depth`) holds
# no KV cache. Its weights do share the GPU, so they enter the weight estimate.


def test_vision_tower_layers_are_not_kv_layers() -> None:
    for name, text_layers in [
        ("qwen2.5-vl-7b-instruct", 28),  # vision depth 32
        ("qwen3-vl-8b-instruct", 36),  # vision depth 27
        ("llama-4-scout-17b-16e-instruct", 48),  # vision 34 layers
        ("gemma-3-27b-it", 62),  # SigLIP 27 layers
        ("mistral-small-3.1-24b-instruct-2503", 40),  # Pixtral 24 layers
    ]:
        assert model_shape(config(name)).num_layers == text_layers


def test_published_and_resaved_qwen25_vl_read_the_same() -> None:
    flat = layout("qwen2.5-vl-7b-instruct")
    nested = layout("qwen2.5-vl-7b-instruct-resaved")
    assert flat == nested
    assert groups_of(flat) == [("full", 28)]  # use_sliding_window false: no sliding layer


def test_dtype_is_read_where_vllm_reads_it() -> None:
    # ModelArchConfigConvertorBase.get_torch_dtype: the top level, then text_config, then
    # vision_config. The re-saved Qwen2.5-VL says bfloat16 at the top and float32 in both
    # sub-configs; Qwen3-VL-8B has its dtype only in text_config.
    assert model_shape(config("qwen2.5-vl-7b-instruct-resaved")).config_dtype == "bfloat16"
    assert model_shape(config("qwen3-vl-8b-instruct")).config_dtype == "bfloat16"
    vision_only = {
        **config("qwen3-vl-8b-instruct"),
        "text_config": {
            k: v for k, v in config("qwen3-vl-8b-instruct")["text_config"].items() if k != "dtype"
        },
        "vision_config": {"depth": 27, "hidden_size": 1152, "dtype": "float16"},
    }
    assert model_shape(vision_only).config_dtype == "float16"
    # float16 KV: 2 B per element as for bf16, 2 x 36 x 8 x 128 x 2 = 147456
    assert kv_cache_layout(model_shape(vision_only)).bytes_per_token == 147456


def test_gemma3_published_config_takes_transformers_defaults() -> None:
    # google/gemma-3-27b-it's text_config has no max_position_embeddings, vocab_size or
    # sliding_window_pattern: Gemma3TextConfig supplies 131072, 262208 and 6, as vLLM sees them.
    shape = model_shape(config("gemma-3-27b-it"))
    assert shape.max_position_embeddings == 131072
    assert shape.layer_kinds.count(LayerKind.FULL) == 10  # layers 5, 11, .., 59: (i + 1) % 6 == 0
    assert layout("gemma-3-27b-it") == layout("gemma-3-27b")


def test_vision_tower_weights_are_counted() -> None:
    # SigLIP in gemma-3-27b-it: 27 blocks x (attention 4 x 1152^2 + MLP 2 x 1152 x 4304)
    # = 27 x (5308416 + 9916416) = 411070464 parameters (gelu: two MLP matrices).
    with_tower = model_shape(config("gemma-3-27b-it")).parameter_count
    text_only = {k: v for k, v in config("gemma-3-27b-it").items() if k != "vision_config"}
    assert with_tower - model_shape(text_only).parameter_count == 411070464
    # Qwen2.5-VL's tower is gated (silu): 32 x (4 x 1280^2 + 3 x 1280 x 3420)
    # = 32 x (6553600 + 13132800) = 629964800
    flat = config("qwen2.5-vl-7b-instruct")
    no_tower = {k: v for k, v in flat.items() if k != "vision_config"}
    assert model_shape(flat).parameter_count - model_shape(no_tower).parameter_count == 629964800


# Llama 4 in vLLM 0.32: Llama4Attention uses ChunkedLocalAttention on its RoPE layers
# (no_rope_layers[i] == 1) when the config has attention_chunk_size; the NoPE layers attend to
# everything. The hybrid allocator stays on for it by default
# (VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1), so the 36 chunked layers form their own
# groups, and a chunked group holds at most cdiv(chunk + in-flight tokens, block size) blocks
# (ChunkedLocalAttentionSpec.max_admission_blocks_per_request).


def test_llama4_groups_twelve_full_and_three_chunked() -> None:
    result = layout("llama-4-scout-17b-16e-instruct")
    assert groups_of(result) == [("chunked", 12)] * 3 + [("full", 12)]
    assert result.attention_chunk_size == 8192
    assert result.bytes_per_block == 12 * 4096 * 16  # 12 pages of 16 tokens x 4096 B
    kinds = model_shape(config("llama-4-scout-17b-16e-instruct")).layer_kinds
    assert [i for i, kind in enumerate(kinds) if kind is LayerKind.FULL] == list(range(3, 48, 4))


@pytest.mark.parametrize(
    ("tokens", "flags", "expected"),
    [
        # 100000 tokens: full group ceil(100000 / 16) = 6250; each chunked group
        # ceil(min(8192 + 2048, 100000) / 16) = 640: 6250 + 3 x 640
        (100_000, {}, 6250 + 3 * 640),
        # shorter than a chunk plus the in-flight tokens: every group holds ceil(5000 / 16) = 313
        (5000, {}, 4 * 313),
        # 10240 = 8192 + 2048 exactly: 640 blocks in every group
        (10240, {}, 4 * 640),
        # with 8192 tokens in flight: ceil(min(16384, 100000) / 16) = 1024 per chunked group
        (100_000, {"max_num_batched_tokens": 8192}, 6250 + 3 * 1024),
        # block size 64: ceil(100000 / 64) = 1563 + 3 x ceil(10240 / 64) = 3 x 160
        (100_000, {"block_size": 64}, 1563 + 3 * 160),
    ],
)
def test_llama4_chunked_groups_stop_growing_at_a_chunk(
    tokens: int, flags: dict[str, Any], expected: int
) -> None:
    assert request_blocks(layout("llama-4-scout-17b-16e-instruct", **flags), tokens) == expected


def test_llama4_startup_concurrency_charges_one_chunk_per_chunked_group() -> None:
    # max_model_len 131072: a request is charged ceil(131072 / 16) = 8192 full blocks plus
    # 3 x ceil(min(8192 + 2048, 131072) / 16) = 3 x 640: 10112 blocks; 101120 blocks hold 10.
    plan = capacity_plan(
        layout("llama-4-scout-17b-16e-instruct"), max_model_len=131072, num_blocks_override=101120
    )
    assert plan.max_concurrency == 10.0
    assert plan.kv_cache_tokens == 1310720


def test_llama4_without_chunking_is_all_full_attention() -> None:
    # An explicit null turns chunking off (the EAGLE drafter for Scout ships that): 48 full
    # layers in one group, and a request holds ceil(100000 / 16) = 6250 blocks.
    scout = config("llama-4-scout-17b-16e-instruct")
    off = {**scout, "text_config": {**scout["text_config"], "attention_chunk_size": None}}
    result = kv_cache_layout(model_shape(off))
    assert groups_of(result) == [("full", 48)]
    assert request_blocks(result, 100_000) == 6250
    # Left out, transformers' Llama4TextConfig supplies 8192: the same as the published file.
    absent = {
        **scout,
        "text_config": {k: v for k, v in scout["text_config"].items() if k != "attention_chunk_size"},
    }
    assert kv_cache_layout(model_shape(absent)) == layout("llama-4-scout-17b-16e-instruct")


def test_llama4_explicit_no_rope_layers_match_the_default() -> None:
    # A text-only Scout fine-tune (vllm-project/vllm issue "Llama4 always go OOM when using
    # LLama4ForCausalLM") spells the list out: 1, 1, 1, 0 repeated.
    scout = config("llama-4-scout-17b-16e-instruct")
    spelled = {**scout, "text_config": {**scout["text_config"], "no_rope_layers": [1, 1, 1, 0] * 12}}
    assert kv_cache_layout(model_shape(spelled)) == layout("llama-4-scout-17b-16e-instruct")
    # every 2nd layer NoPE: 24 full + 24 chunked, two groups of 24
    halves = {**scout, "text_config": {**scout["text_config"], "no_rope_layers": [1, 0] * 24}}
    assert groups_of(kv_cache_layout(model_shape(halves))) == [("chunked", 24), ("full", 24)]


def test_a_garbled_vision_tower_changes_no_kv_figure() -> None:
    # The tower keeps no KV cache; a nonsense depth only drops it from the weight estimate.
    name = "qwen3-vl-8b-instruct"
    garbled = {**config(name), "vision_config": {"depth": "many", "hidden_size": -1}}
    assert kv_cache_layout(model_shape(garbled)) == layout(name)
    no_tower = {k: v for k, v in config(name).items() if k != "vision_config"}
    assert model_shape(garbled).parameter_count == model_shape(no_tower).parameter_count


# ---------------------------------------------------------------- the real vLLM, Llama 4 chunks
# A tiny random Llama4ForCausalLM (tests/fixtures/configs/tiny-llama4.json: 8 layers, chunk 64,
# every 4th layer NoPE) served by vLLM 0.32.0 on CPU; SOURCES.md says how it was built and run.


def test_tiny_llama4_startup_log_is_reproduced_exactly() -> None:
    log = (VLLM_FIXTURES / "startup_tiny_llama4_chunked_0.32.0.log").read_text()
    # "kv cache group sizes (32, 32, 32, 32)": four groups, as the chunked grouping predicts
    assert "kv cache group sizes (32, 32, 32, 32)" in log
    tiny = layout("tiny-llama4", block_size=32, max_num_batched_tokens=64)
    assert groups_of(tiny) == [("chunked", 2)] * 3 + [("full", 2)]
    # "Explicitly set (1.0/...) GiB", "Overriding num_gpu_blocks=32768": a block id is 2 layers x
    # 32 tokens x 512 B = 32768 B, so 1 GiB holds 32768 (one group of 8 layers would give 8192)
    assert "num_gpu_blocks=32768" in log
    sized = capacity_plan(tiny, max_model_len=1024, gpu_memory_gib=1.0, gpu_memory_utilization=1.0)
    assert sized.num_blocks == 32768
    # "CPU KV cache size: 1,489 tokens, Maximum concurrency for 1,024 tokens per request: 1.45x":
    # a request is charged 32 full blocks + 3 x ceil(min(64 + 64, 1024) / 32) = 44; 64 / 44 = 1.45
    assert "1,489 tokens" in log
    assert "1.45x" in log
    overridden = capacity_plan(tiny, max_model_len=1024, num_blocks_override=64)
    assert overridden.kv_cache_tokens == 1489
    assert round(overridden.max_concurrency, 2) == 1.45


def test_tiny_llama4_reservation_covers_what_vllm_held() -> None:
    # Measured peaks (fixture): vLLM held full ceil(T / 32) + 3 x the blocks of the current
    # chunk. kvgate reserves full + 3 x ceil(min(64 + 64, T) / 32), never less than that; the plain
    # ceiling (one group) is below what vLLM held every time.
    peaks = json.loads((VLLM_FIXTURES / "tiny_llama4_chunked_peaks_0.32.0.json").read_text())
    tiny = layout("tiny-llama4", block_size=32, max_num_batched_tokens=64)
    for request in peaks["requests"]:
        tokens = request["prompt_tokens"] + request["completion_tokens"]
        assert round(request["peak_kv_cache_usage_perc"] * peaks["usable_blocks"]) == request["peak_blocks"]
        assert request_blocks(tiny, tokens) >= request["peak_blocks"] > blocks_for_tokens(tokens, 32)
    # 100 tokens: reserve 4 + 3 x 4 = 16 for the 10 held; 900: 29 + 3 x 4 = 41 for the 34 held
    assert [request_blocks(tiny, t) for t in (100, 500, 900)] == [16, 28, 41]

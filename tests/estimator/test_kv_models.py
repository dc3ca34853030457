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

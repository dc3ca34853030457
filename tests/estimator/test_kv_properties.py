"""Properties of the block math that must hold for any model and any serving flags."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from estimator.kv import (
    KVCacheLayout,
    LayerKind,
    blocks_for_tokens,
    capacity_plan,
    kv_cache_layout,
    model_shape,
    request_blocks,
)

BLOCK_SIZES = st.sampled_from([1, 8, 16, 32, 64, 128, 256])
TOKENS = st.integers(min_value=0, max_value=2_000_000)


@st.composite
def configs(draw: st.DrawFn, *, kinds: tuple[str, ...]) -> dict[str, Any]:
    """A plausible decoder config whose layers are drawn from `kinds` (layer_types names)."""
    kv_heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([64, 96, 128, 256]))
    layers = draw(st.integers(min_value=1, max_value=96))
    layer_types = draw(st.lists(st.sampled_from(kinds), min_size=layers, max_size=layers))
    if "full_attention" not in layer_types and "sliding_attention" not in layer_types:
        layer_types[draw(st.integers(min_value=0, max_value=layers - 1))] = "full_attention"
    return {
        "model_type": "synthetic",
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": heads * head_dim,
        "sliding_window": draw(st.integers(min_value=1, max_value=8192)),
        "attention_chunk_size": draw(st.sampled_from([64, 1000, 8192])),
        "layer_types": layer_types,
        "torch_dtype": draw(st.sampled_from(["bfloat16", "float16", "float32"])),
    }


@st.composite
def layouts(draw: st.DrawFn, *, kinds: tuple[str, ...]) -> KVCacheLayout:
    shape = model_shape(draw(configs(kinds=kinds)))
    return kv_cache_layout(
        shape,
        block_size=draw(BLOCK_SIZES),
        tp=draw(st.sampled_from([1, 2, 4, 8, 16])),
        pp=draw(st.integers(min_value=1, max_value=shape.num_layers)),
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8"])),
        max_num_batched_tokens=draw(st.sampled_from([512, 2048, 8192])),
    )


FULL_ONLY = layouts(kinds=("full_attention",))
ANY_KIND = layouts(kinds=("full_attention", "sliding_attention", "chunked_attention", "linear_attention"))


@given(tokens=TOKENS, block_size=BLOCK_SIZES)
def test_blocks_for_tokens_is_the_ceiling(tokens: int, block_size: int) -> None:
    blocks = blocks_for_tokens(tokens, block_size)
    assert (blocks - 1) * block_size < tokens <= blocks * block_size or tokens == blocks == 0


@given(layout=FULL_ONLY, tokens=TOKENS, more=st.integers(min_value=0, max_value=100_000))
def test_full_attention_blocks_are_monotone_and_never_below_the_ceiling(
    layout: KVCacheLayout, tokens: int, more: int
) -> None:
    blocks = request_blocks(layout, tokens)
    assert blocks >= blocks_for_tokens(tokens, layout.block_size)
    assert request_blocks(layout, tokens + more) >= blocks


@given(layout=ANY_KIND, tokens=TOKENS, more=st.integers(min_value=0, max_value=100_000))
def test_any_layout_is_monotone_and_bounded_by_one_ceiling_per_group(
    layout: KVCacheLayout, tokens: int, more: int
) -> None:
    blocks = request_blocks(layout, tokens)
    assert blocks <= len(layout.groups) * blocks_for_tokens(tokens, layout.block_size)
    assert request_blocks(layout, tokens + more) >= blocks
    assert request_blocks(layout, 0) == 0


@given(layout=layouts(kinds=("sliding_attention",)), tokens=TOKENS)
def test_sliding_window_groups_stop_growing(layout: KVCacheLayout, tokens: int) -> None:
    assert layout.sliding_window is not None
    cap = blocks_for_tokens(layout.sliding_window - 1 + layout.max_num_batched_tokens, layout.block_size) + 1
    assert request_blocks(layout, tokens) <= len(layout.groups) * cap


@given(layout=layouts(kinds=("chunked_attention", "full_attention")), tokens=TOKENS)
def test_chunked_local_groups_stop_growing_at_a_chunk(layout: KVCacheLayout, tokens: int) -> None:
    # Llama 4's chunked layers hold at most one chunk plus the tokens in flight per group.
    full = blocks_for_tokens(tokens, layout.block_size)
    chunked = sum(1 for group in layout.groups if group.kind is LayerKind.CHUNKED)
    if chunked:
        assert layout.attention_chunk_size is not None
        cap = blocks_for_tokens(
            layout.attention_chunk_size + layout.max_num_batched_tokens, layout.block_size
        )
        others = len(layout.groups) - chunked
        assert request_blocks(layout, tokens) <= others * full + chunked * min(cap, full)
    else:
        assert request_blocks(layout, tokens) == len(layout.groups) * full


@given(layout=ANY_KIND)
def test_accounting_never_charges_less_than_the_physical_bytes(layout: KVCacheLayout) -> None:
    # Padding layers only add: every token group holds at most group_size real layers.
    assert layout.bytes_per_token >= layout.bytes_per_token_physical > 0
    token_groups = [group for group in layout.groups if group.kind is not LayerKind.STATE]
    assert all(group.layers_on_worst_stage <= layout.group_size for group in token_groups)


@given(
    layout=ANY_KIND,
    memory_gib=st.floats(min_value=1, max_value=192, allow_nan=False),
    extra_gib=st.floats(min_value=0, max_value=64, allow_nan=False),
    max_model_len=st.integers(min_value=1, max_value=262_144),
)
def test_capacity_is_monotone_in_memory(
    layout: KVCacheLayout, memory_gib: float, extra_gib: float, max_model_len: int
) -> None:
    smaller = capacity_plan(layout, max_model_len=max_model_len, gpu_memory_gib=memory_gib)
    larger = capacity_plan(layout, max_model_len=max_model_len, gpu_memory_gib=memory_gib + extra_gib)
    assert larger.num_blocks >= smaller.num_blocks
    assert larger.kv_cache_tokens >= smaller.kv_cache_tokens
    assert smaller.num_blocks * layout.bytes_per_block <= smaller.available_kv_bytes


@given(config=configs(kinds=("full_attention", "sliding_attention")), tp=st.sampled_from([1, 2, 4, 8]))
def test_more_tensor_parallel_never_costs_more_per_gpu(config: dict[str, Any], tp: int) -> None:
    shape = model_shape(config)
    assert kv_cache_layout(shape, tp=2 * tp).bytes_per_token <= kv_cache_layout(shape, tp=tp).bytes_per_token

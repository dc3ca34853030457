"""What a request costs in KV-cache blocks, the way vLLM's V1 engine accounts for it.

Three steps, all pure functions over plain data:

1. `model_shape(config)` reads a Hugging Face `config.json` (as a mapping) into a `ModelShape`:
   layers and the kind of each (full attention, sliding window, chunked local attention, MLA
   latent, or a fixed-size state such as Mamba / linear attention), KV heads, head size and
   dtype. A multimodal config is read through its `text_config`, as vLLM reads it through
   `get_text_config()`: the vision tower holds weights but no KV cache.
2. `kv_cache_layout(shape, ...)` applies the serving flags (tensor and pipeline parallel,
   `--kv-cache-dtype`, `--dtype`, `--block-size`) and groups the layers the way vLLM's hybrid
   allocator does, giving page and block sizes per GPU and the bytes per token.
3. `request_blocks(layout, tokens)` and `capacity_plan(layout, ...)` give one request's block
   count and the whole pool's size, matching vLLM's start-up log lines
   "Available KV cache memory" and "GPU KV cache size: N tokens".

Nothing here does I/O; `estimator.modelconfig` finds and reads the config file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

GIB = 1024**3
DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# vLLM's default `max_num_batched_tokens` for the OpenAI server on GPUs below 70 GiB; it bounds
# how many tokens a sliding-window layer may hold beyond its window while a chunk is in flight.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# When a hybrid model's layer kinds are nearly balanced vLLM pads the smaller kind up to the
# larger one instead of splitting the larger into many groups (kv_cache_utils, vLLM 0.32).
HYBRID_GROUP_BALANCE_RATIO = 1.5

DTYPE_BYTES: Mapping[str, int] = {
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}
FLOAT32_NAMES = frozenset({"float32", "float", "fp32"})


class ConfigError(ValueError):
    """A model config lacks or mangles a field the KV math needs. `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class LayerKind(StrEnum):
    """How one decoder layer keeps its past: this decides what it charges per token."""

    FULL = "full"  # K and V for every token
    SLIDING = "sliding"  # K and V for the last `sliding_window` tokens only
    CHUNKED = "chunked"  # K and V from the start of the current `attention_chunk_size` chunk (Llama 4)
    MLA = "mla"  # one compressed latent per token (DeepSeek-style multi-head latent attention)
    STATE = "state"  # a fixed-size recurrent state per request (Mamba, linear attention)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a model config that decide its KV-cache footprint."""

    model_type: str
    layer_kinds: tuple[LayerKind, ...]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    mla_latent_dim: int | None
    sliding_window: int | None
    config_dtype: str
    max_position_embeddings: int | None
    parameter_count: int
    attention_chunk_size: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim is not None


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One vLLM KV-cache group: layers of one kind that share block ids from the pool.

    `layers_on_worst_stage` counts this group's layers on the pipeline stage that holds the most
    KV bytes per block; padding layers (vLLM pads every group to the same size) are not counted.
    """

    kind: LayerKind
    layers_on_worst_stage: int


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Per-GPU KV-cache layout of one model under one set of serving flags."""

    block_size: int
    kv_dtype: str
    kv_dtype_bytes: int
    kv_heads_per_gpu: int
    head_dim: int
    bytes_per_token_per_layer: int  # one layer's K and V (or MLA latent) for one token, per GPU
    group_size: int  # layers per group, padding included: the tensors sharing one block id
    groups: tuple[KVGroup, ...]
    attention_layers_on_worst_stage: int
    sliding_window: int | None
    max_num_batched_tokens: int
    tensor_parallel: int
    pipeline_parallel: int
    attention_chunk_size: int | None = None

    @property
    def page_size_bytes(self) -> int:
        """One layer's share of one block."""
        return self.bytes_per_token_per_layer * self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Memory one block id stands for on one GPU: what vLLM divides free memory by."""
        return self.page_size_bytes * self.group_size

    @property
    def bytes_per_token(self) -> int:
        """What vLLM's block accounting charges per token of a request (per GPU).

        Every group hands a request one block id per `block_size` tokens, and a block id stands
        for `bytes_per_block`. For a plain model this is layers x per-layer bytes; for hybrids it
        includes the padding layers that vLLM's grouping adds.
        """
        token_groups = sum(1 for group in self.groups if group.kind is not LayerKind.STATE)
        return token_groups * self.bytes_per_block // self.block_size

    @property
    def bytes_per_token_physical(self) -> int:
        """The K/V bytes one token occupies on one GPU across its stage's attention layers."""
        return self.attention_layers_on_worst_stage * self.bytes_per_token_per_layer

    @property
    def is_hybrid(self) -> bool:
        return len({group.kind for group in self.groups}) > 1


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The pool vLLM would build: its start-up log's KV lines, per GPU."""

    available_kv_bytes: int
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    weights_bytes: int


# ---------------------------------------------------------------- reading a config

# Fields that published configs leave out because transformers' config class supplies them,
# per text model type (transformers 5.19, as vLLM 0.32 loads them). Only fields that do not
# size the KV cache by themselves are defaulted: a missing head or layer count stays an error.
TEXT_MODEL_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    # Gemma3TextConfig: google/gemma-3-*-it publish no context length or vocabulary size.
    "gemma3_text": {"max_position_embeddings": 131072, "vocab_size": 262208},
    # Llama4TextConfig: chunked local attention of 8192 tokens unless the config says
    # otherwise (an explicit null turns it off), and a NoPE (global) layer every 4th layer
    # when `no_rope_layers` is empty.
    "llama4_text": {"attention_chunk_size": 8192, "no_rope_layer_interval": 4},
}
# A top-level model type names the composite model; its text model has its own type.
_TEXT_MODEL_TYPES: Mapping[str, str] = {"gemma3": "gemma3_text", "llama4": "llama4_text"}


@dataclass(frozen=True, slots=True)
class ConfigSection:
    """The part of a config that describes the language model, and where it sits.

    `prefix` is "text_config." when the fields come from a multimodal config's `text_config`,
    so that an error names the field where the file has it (`text_config.hidden_size`).
    `defaults` are transformers' values for fields the file leaves out (absent, not null).
    """

    fields: Mapping[str, Any]
    prefix: str = ""
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        if name in self.fields:
            return self.fields[name]
        return self.defaults.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self.fields or name in self.defaults

    def path(self, name: str) -> str:
        return self.prefix + name

    @property
    def model_type(self) -> str:
        return str(self.get("model_type") or "")


def _first(config: ConfigSection, names: Sequence[str]) -> Any:
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return None


def _required_int(config: ConfigSection, names: Sequence[str]) -> int:
    value = _first(config, names)
    field = names[0]
    where = config.path(field)
    if value is None:
        others = ", ".join(config.path(name) for name in names[1:])
        alternatives = f" (or {others})" if others else ""
        raise ConfigError(field, f"config is missing field '{where}'{alternatives}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, f"config field '{where}' must be a positive integer, got {value!r}")
    return value


def _optional_int(config: ConfigSection, names: Sequence[str]) -> int | None:
    value = _first(config, names)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        where = config.path(names[0])
        raise ConfigError(names[0], f"config field '{where}' must be a positive integer, got {value!r}")
    return value


def _sliding_window(config: ConfigSection) -> int | None:
    """The config's attention window, or None. Some checkpoints write 0 for "no window" and
    vLLM reads 0 as None, so this does too."""
    if config.get("sliding_window") == 0:
        return None
    return _optional_int(config, ("sliding_window",))


def _config_dtype(config: Mapping[str, Any], text: Mapping[str, Any]) -> Any:
    """The checkpoint dtype where vLLM looks for it: the top level first, then the text
    config, then the vision config (ModelArchConfigConvertorBase.get_torch_dtype)."""
    vision = config.get("vision_config")
    for section in (config, text, vision if isinstance(vision, Mapping) else {}):
        for key in ("torch_dtype", "dtype"):
            if section.get(key) is not None:
                return section[key]
    return None


def text_config(config: Mapping[str, Any]) -> ConfigSection:
    """The language model's part of a config, as vLLM's `hf_config.get_text_config()` gives it.

    A multimodal config (Qwen2.5/3-VL re-saved by recent transformers, Llama 4, Gemma 3,
    Mistral 3) nests the text model under `text_config`; its vision tower's layers keep no KV
    cache and are not read. Only the dtype and the model type fall back to the top level, where
    such configs often keep them. A flat config (Qwen2.5-VL as published) is its own section.
    """
    nested = config.get("text_config")
    if nested is None:
        section: Mapping[str, Any] = config
        prefix = ""
    elif isinstance(nested, Mapping):
        section = dict(nested)
        prefix = "text_config."
        if not section.get("model_type") and config.get("model_type"):
            top = str(config["model_type"])
            section["model_type"] = _TEXT_MODEL_TYPES.get(top, top)
    else:
        raise ConfigError("text_config", f"config field 'text_config' must be an object, got {nested!r}")
    dtype = _config_dtype(config, section)
    fields = {**section, "torch_dtype": dtype} if dtype is not None else section
    model_type = str(fields.get("model_type") or "")
    return ConfigSection(fields, prefix, TEXT_MODEL_DEFAULTS.get(model_type, {}))


_SLIDING_NAMES = frozenset({"sliding_attention", "sliding", "local_attention", "local"})
_CHUNKED_NAMES = frozenset({"chunked_attention", "chunked_local_attention"})
_FULL_NAMES = frozenset({"full_attention", "full", "attention", "global", "global_attention"})
_STATE_NAMES = frozenset(
    {"mamba", "mamba2", "linear_attention", "linear", "conv", "short_conv", "recurrent", "ssm"}
)


def _attention_chunk_size(cfg: ConfigSection) -> int | None:
    """Llama 4's chunk of local attention, or None: vLLM reads `attention_chunk_size` from the
    text config, and a null (or 0) there turns chunking off."""
    if cfg.get("attention_chunk_size") == 0:
        return None
    return _optional_int(cfg, ("attention_chunk_size",))


def _no_rope_layers(cfg: ConfigSection, num_layers: int) -> list[int]:
    """Llama 4's per-layer RoPE flags (1 = RoPE with chunked attention, 0 = NoPE, global).

    An empty or missing list means transformers' default: a NoPE layer every
    `no_rope_layer_interval`-th layer (Llama4TextConfig.__post_init__)."""
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = _required_int(cfg, ("no_rope_layer_interval",))
        return [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) < num_layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(
            "no_rope_layers",
            f"config field '{cfg.path('no_rope_layers')}' must list 0 or 1 for each of {num_layers} layers",
        )
    return [int(f) for f in flags[:num_layers]]


def _layer_kinds(cfg: ConfigSection, num_layers: int, is_mla: bool) -> tuple[LayerKind, ...]:
    """Which layers keep full K/V, a sliding window, a chunk, or a fixed state.

    Follows the conventions of the model families vLLM serves: an explicit `layer_types` list
    (Gemma 3, gpt-oss, Qwen3-Next, Granite 4), Llama 4's `no_rope_layers` with
    `attention_chunk_size`, Gemma 2's alternation, Gemma 3's `sliding_window_pattern`,
    Qwen2's `use_sliding_window` + `max_window_layers`, Jamba's attention period and offset,
    Qwen3-Next's `full_attention_interval`, and a bare `sliding_window` (Mistral) meaning every
    layer slides.
    """
    full = LayerKind.MLA if is_mla else LayerKind.FULL
    window = _sliding_window(cfg)
    chunk = _attention_chunk_size(cfg)
    model_type = cfg.model_type

    if model_type.startswith("llama4"):
        # vLLM's Llama4Attention: a layer uses chunked local attention when it has RoPE and
        # the config has a chunk size; the NoPE layers attend globally.
        if chunk is None:
            return (full,) * num_layers
        return tuple(LayerKind.CHUNKED if rope else full for rope in _no_rope_layers(cfg, num_layers))

    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kinds: list[LayerKind] = []
        for index, name in enumerate(layer_types[:num_layers]):
            name = str(name).lower()
            if name in _SLIDING_NAMES:
                kinds.append(LayerKind.SLIDING if window else full)
            elif name in _CHUNKED_NAMES:
                kinds.append(LayerKind.CHUNKED if chunk else full)
            elif name in _FULL_NAMES:
                kinds.append(full)
            elif name in _STATE_NAMES:
                kinds.append(LayerKind.STATE)
            else:
                raise ConfigError(
                    "layer_types", f"config {cfg.path('layer_types')}[{index}] is unknown: {name!r}"
                )
        if len(kinds) != num_layers:
            raise ConfigError(
                "layer_types",
                f"config {cfg.path('layer_types')} has {len(layer_types)} entries for {num_layers} layers",
            )
        return tuple(kinds)

    if "attn_layer_period" in cfg and "attn_layer_offset" in cfg:  # Jamba
        period = _required_int(cfg, ("attn_layer_period",))
        offset = int(cfg.get("attn_layer_offset"))
        return tuple(full if i % period == offset else LayerKind.STATE for i in range(num_layers))

    if "full_attention_interval" in cfg:  # Qwen3-Next: linear attention with periodic full
        interval = _required_int(cfg, ("full_attention_interval",))
        return tuple(full if (i + 1) % interval == 0 else LayerKind.STATE for i in range(num_layers))

    if window is None:
        return (full,) * num_layers

    if model_type.startswith("qwen"):
        if not cfg.get("use_sliding_window", False):
            return (full,) * num_layers
        first_sliding = int(cfg.get("max_window_layers", 0) or 0)
        return tuple(LayerKind.SLIDING if i >= first_sliding else full for i in range(num_layers))
    if model_type == "gemma2":
        return tuple(LayerKind.SLIDING if i % 2 == 0 else full for i in range(num_layers))
    if model_type.startswith("gemma3"):
        pattern = int(cfg.get("sliding_window_pattern", 6) or 6)
        return tuple(full if (i + 1) % pattern == 0 else LayerKind.SLIDING for i in range(num_layers))
    if cfg.get("use_sliding_window") is False:
        return (full,) * num_layers
    # A bare window with no per-layer list slides on every layer: vLLM copies it into the cache
    # config and each attention layer falls back to it. That includes Phi-3 and PhiMoE, whose
    # configs carry `sliding_window` (2047 for Phi-3-mini-4k) and no `layer_types`.
    return (LayerKind.SLIDING,) * num_layers


def _parameter_count(
    cfg: ConfigSection, layers: int, heads: int, kv_heads: int, head_dim: int, mla: bool
) -> int:
    """Approximate parameter count implied by the config, for the weight-memory estimate.

    Counts embeddings, attention projections, dense or mixture-of-experts MLPs and the output
    head. Norms and biases are ignored (well under 0.1% of any model here). Use `--weights-gib`
    when exact weight memory matters.
    """
    hidden = _required_int(cfg, ("hidden_size", "n_embd", "d_model"))
    vocab = _optional_int(cfg, ("vocab_size",)) or 0
    intermediate = _optional_int(cfg, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * hidden
    if mla:
        q_lora = _optional_int(cfg, ("q_lora_rank",))
        kv_lora = _required_int(cfg, ("kv_lora_rank",))
        rope = _required_int(cfg, ("qk_rope_head_dim",))
        nope = _optional_int(cfg, ("qk_nope_head_dim",)) or 0
        v_head = _optional_int(cfg, ("v_head_dim",)) or nope
        q_dim = heads * (nope + rope)
        q_params = hidden * q_lora + q_lora * q_dim if q_lora else hidden * q_dim
        attention = (
            q_params + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_head) + heads * v_head * hidden
        )
    else:
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    gated = str(cfg.get("model_type", "")) not in {"gpt2", "gpt_bigcode", "opt", "phi"}
    mlp_matrices = 3 if gated else 2
    experts = _optional_int(cfg, ("num_local_experts", "n_routed_experts", "num_experts"))
    if experts:
        expert_size = _optional_int(cfg, ("moe_intermediate_size", "intermediate_size")) or intermediate
        shared = _optional_int(cfg, ("n_shared_experts",)) or 0
        shared_size = _optional_int(cfg, ("shared_expert_intermediate_size",)) or shared * expert_size
        dense_layers = min(layers, int(cfg.get("first_k_dense_replace", 0) or 0))
        dense_size = intermediate
        if cfg.model_type.startswith("llama4"):
            # Llama 4: every `interleave_moe_layer_step`-th layer is MoE with one shared expert
            # of the routed experts' size; the others are dense of `intermediate_size_mlp`.
            # A step of 0 means no MoE layer at all (vLLM's Llama4DecoderLayer: step > 0).
            step = cfg.get("interleave_moe_layer_step", 1)
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ConfigError(
                    "interleave_moe_layer_step",
                    f"config field '{cfg.path('interleave_moe_layer_step')}' must be a whole number, "
                    f"got {step!r}",
                )
            dense_layers = layers - (len(range(step - 1, layers, step)) if step else 0)
            shared_size = expert_size
            dense_size = _optional_int(cfg, ("intermediate_size_mlp",)) or intermediate
        moe_layers = layers - dense_layers
        mlp_total = (
            moe_layers * (mlp_matrices * hidden * (experts * expert_size + shared_size) + hidden * experts)
            + dense_layers * mlp_matrices * hidden * dense_size
        )
    else:
        mlp_total = layers * mlp_matrices * hidden * intermediate
    # transformers ties the output head to the embeddings by default for Gemma and GPT-2, and
    # their configs leave the field out.
    model_type = cfg.model_type
    tied_by_default = model_type.startswith(("gemma", "gpt2"))
    tied = cfg.get("tie_word_embeddings", tied_by_default)
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * attention + mlp_total + embeddings


def _vision_parameter_count(config: Mapping[str, Any]) -> int:
    """Rough weight count of a multimodal config's vision tower: it keeps no KV cache, but its
    weights share the GPU. Counts each block's attention (4 h^2) and MLP (2 or, gated, 3
    matrices of h x intermediate); patch embedding and projector are left out."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    section = ConfigSection(vision, "vision_config.")
    try:
        layers = _optional_int(section, ("depth", "num_hidden_layers"))
        hidden = _optional_int(section, ("hidden_size", "embed_dim"))
        intermediate = _optional_int(section, ("intermediate_size",))
    except ConfigError:
        return 0  # a garbled tower changes no KV figure; the weights are an estimate anyway
    if layers is None or hidden is None:
        return 0
    gated = str(vision.get("hidden_act", "")).lower() in {"silu", "swiglu"}
    return layers * (4 * hidden * hidden + (3 if gated else 2) * hidden * (intermediate or 4 * hidden))


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """Read the KV-relevant shape out of a Hugging Face config; raise `ConfigError` if unusable.

    Multimodal configs are read through `text_config` (see `text_config`); an error names the
    field as the file nests it, e.g. `text_config.hidden_size`.
    """
    cfg = text_config(config)
    num_layers = _required_int(cfg, ("num_hidden_layers", "n_layer", "num_layers"))
    heads = _required_int(cfg, ("num_attention_heads", "n_head", "num_heads"))
    kv_lora_rank = _optional_int(cfg, ("kv_lora_rank",))
    is_mla = kv_lora_rank is not None
    mla_latent_dim: int | None = None
    if is_mla:
        assert kv_lora_rank is not None
        mla_latent_dim = kv_lora_rank + _required_int(cfg, ("qk_rope_head_dim",))
    if cfg.get("multi_query") is True:
        kv_heads = 1
    else:
        kv_heads = _optional_int(cfg, ("num_key_value_heads", "n_head_kv", "num_kv_heads")) or heads
    head_dim = _optional_int(cfg, ("head_dim",))
    if head_dim is None:
        hidden = _required_int(cfg, ("hidden_size", "n_embd", "d_model"))
        if hidden % heads:
            raise ConfigError(
                "head_dim",
                f"config has no '{cfg.path('head_dim')}' and hidden size {hidden} is not a multiple "
                f"of {heads} heads",
            )
        head_dim = hidden // heads
    dtype_value = _first(cfg, ("torch_dtype", "dtype"))
    # transformers treats a config without a dtype as float32 weights.
    config_dtype = str(dtype_value).removeprefix("torch.") if dtype_value else "float32"
    kinds = _layer_kinds(cfg, num_layers, is_mla)
    return ModelShape(
        model_type=cfg.model_type or str(config.get("model_type", "")),
        layer_kinds=kinds,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mla_latent_dim=mla_latent_dim,
        sliding_window=_sliding_window(cfg),
        config_dtype=config_dtype,
        max_position_embeddings=_optional_int(cfg, ("max_position_embeddings", "n_positions", "max_seq_len")),
        parameter_count=_parameter_count(cfg, num_layers, heads, kv_heads, head_dim, is_mla)
        + _vision_parameter_count(config),
        attention_chunk_size=_attention_chunk_size(cfg) if LayerKind.CHUNKED in kinds else None,
    )


# ---------------------------------------------------------------- serving flags -> layout


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(
            "dtype", f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


def model_dtype(shape: ModelShape, dtype: str = "auto") -> str:
    """The dtype vLLM runs the model in: `--dtype`, or for `auto` the config's dtype, where
    float32 checkpoints are served in 16 bits (vLLM downcasts them to the platform's preferred
    half type)."""
    if dtype != "auto":
        dtype_bytes(dtype)
        return dtype
    return "bfloat16" if shape.config_dtype.lower() in FLOAT32_NAMES else shape.config_dtype


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """Split layers across pipeline stages as vLLM does: remainders go to the stages just
    before the last one (the last carries the output head)."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"pipeline parallel size must be between 1 and {num_layers}, got {pp}")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(range(start, start + size))
        start += size
    return stages


def kv_cache_layout(
    shape: ModelShape,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tp: int = 1,
    pp: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> KVCacheLayout:
    """Group the layers like vLLM's KV-cache manager and size pages and blocks per GPU."""
    if block_size < 1:
        raise ValueError(f"block size must be positive, got {block_size}")
    if tp < 1:
        raise ValueError(f"tensor parallel size must be positive, got {tp}")
    kv_dtype = model_dtype(shape, dtype) if kv_cache_dtype == "auto" else kv_cache_dtype
    element_bytes = dtype_bytes(kv_dtype)
    if shape.mla_latent_dim is not None:
        # MLA caches one latent (compressed KV plus the rotary part) per token: no separate K
        # and V, and every tensor-parallel rank keeps the whole latent.
        kv_heads_per_gpu = 1
        per_layer = shape.mla_latent_dim * element_bytes
    else:
        # GQA heads are split across ranks; with more ranks than KV heads vLLM replicates them
        # so that each rank holds one.
        kv_heads_per_gpu = max(1, shape.num_kv_heads // tp)
        per_layer = 2 * kv_heads_per_gpu * shape.head_dim * element_bytes

    # Buckets of same-kind layers, in layer order, as vLLM builds them before grouping.
    buckets: dict[LayerKind, list[int]] = {}
    for index, kind in enumerate(shape.layer_kinds):
        buckets.setdefault(kind, []).append(index)
    attention_buckets = {kind: idx for kind, idx in buckets.items() if kind is not LayerKind.STATE}
    if not attention_buckets:
        raise ConfigError(
            "layer_types", "config layer_types has no attention layer: nothing grows a KV cache"
        )
    sizes = [len(layers) for layers in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * HYBRID_GROUP_BALANCE_RATIO:
        group_size = max(sizes)

    stages = pipeline_stages(shape.num_layers, pp)
    # Each group takes every num_groups-th layer of its kind, so a group spreads over stages.
    group_members: list[tuple[LayerKind, list[int]]] = []
    for kind, layers in buckets.items():
        num_groups = math.ceil(len(layers) / group_size)
        group_members.extend((kind, layers[i::num_groups]) for i in range(num_groups))

    def stage_block_bytes(stage: range) -> int:
        return max(
            sum(1 for layer in members if layer in stage)
            for kind, members in group_members
            if kind is not LayerKind.STATE
        )

    worst_stage = max(stages, key=stage_block_bytes)
    groups = tuple(
        KVGroup(kind=kind, layers_on_worst_stage=sum(1 for layer in members if layer in worst_stage))
        for kind, members in group_members
    )
    attention_on_stage = sum(1 for layer in worst_stage if shape.layer_kinds[layer] is not LayerKind.STATE)
    # Each GPU allocates as many tensors per block as the fullest group on its stage holds.
    stage_group_size = max(g.layers_on_worst_stage for g in groups if g.kind is not LayerKind.STATE)
    return KVCacheLayout(
        block_size=block_size,
        kv_dtype=kv_dtype,
        kv_dtype_bytes=element_bytes,
        kv_heads_per_gpu=kv_heads_per_gpu,
        head_dim=shape.mla_latent_dim or shape.head_dim,
        bytes_per_token_per_layer=per_layer,
        group_size=stage_group_size,
        groups=groups,
        attention_layers_on_worst_stage=attention_on_stage,
        sliding_window=shape.sliding_window if LayerKind.SLIDING in buckets else None,
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        attention_chunk_size=shape.attention_chunk_size if LayerKind.CHUNKED in buckets else None,
    )


# ---------------------------------------------------------------- blocks


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens: vLLM allocates whole blocks, never part of one."""
    if tokens < 0:
        raise ValueError(f"token count must not be negative, got {tokens}")
    if block_size < 1:
        raise ValueError(f"block size must be positive, got {block_size}")
    return -(-tokens // block_size)


def sliding_window_blocks(window: int, tokens: int, block_size: int, in_flight_tokens: int) -> int:
    """Most blocks a sliding-window layer holds for a sequence of `tokens` tokens.

    vLLM frees blocks that fall wholly out of the window, but keeps the window's last
    `window - 1` tokens plus whatever is being computed, and one more block because the window
    rarely starts on a block boundary.
    """
    if tokens == 0:
        return 0
    capped = min(window - 1 + in_flight_tokens, tokens)
    return min(blocks_for_tokens(capped, block_size) + 1, blocks_for_tokens(tokens, block_size))


def chunked_local_blocks(chunk: int, tokens: int, block_size: int, in_flight_tokens: int) -> int:
    """Most blocks a chunked-local-attention layer (Llama 4) holds for `tokens` tokens.

    vLLM frees the blocks before the current chunk, so a layer holds at most one chunk plus
    the tokens in flight: ChunkedLocalAttentionSpec.max_admission_blocks_per_request, which
    its admission also caps each request's reservation with, and never more than the request.
    """
    return blocks_for_tokens(min(chunk + in_flight_tokens, tokens), block_size)


def request_blocks(layout: KVCacheLayout, tokens: int) -> int:
    """Block ids a sequence of `tokens` tokens takes from the shared pool at its peak.

    Full and MLA groups need one block per `block_size` tokens; sliding-window groups stop
    growing at the window and chunked-local groups at a chunk; state groups (Mamba, linear
    attention) take one block each.
    """
    full = blocks_for_tokens(tokens, layout.block_size)
    total = 0
    for group in layout.groups:
        if group.kind is LayerKind.SLIDING and layout.sliding_window is not None:
            total += sliding_window_blocks(
                layout.sliding_window, tokens, layout.block_size, layout.max_num_batched_tokens
            )
        elif group.kind is LayerKind.CHUNKED and layout.attention_chunk_size is not None:
            total += chunked_local_blocks(
                layout.attention_chunk_size, tokens, layout.block_size, layout.max_num_batched_tokens
            )
        elif group.kind is LayerKind.STATE:
            total += 1 if tokens else 0
        else:
            total += full
    return total


def startup_blocks_per_request(layout: KVCacheLayout, max_model_len: int) -> int:
    """Blocks vLLM's start-up report charges one max-model-len request (its concurrency divisor).

    Like `request_blocks`, except that a sliding-window group is charged its full reservation
    (window - 1 + in-flight tokens, plus the block the window straddles) even when
    `max_model_len` is shorter: vLLM sizes that group with `max_admission_blocks_per_request`
    and does not cap it by the request's own length, while its runtime admission does.
    """
    full = blocks_for_tokens(max_model_len, layout.block_size)
    total = 0
    for group in layout.groups:
        if group.kind is LayerKind.SLIDING and layout.sliding_window is not None:
            held = min(layout.sliding_window - 1 + layout.max_num_batched_tokens, max_model_len)
            total += blocks_for_tokens(held, layout.block_size) + 1
        elif group.kind is LayerKind.CHUNKED and layout.attention_chunk_size is not None:
            # ChunkedLocalAttentionSpec.max_memory_usage_bytes: one chunk plus the in-flight
            # tokens, capped by max_model_len (with no extra straddling block).
            total += chunked_local_blocks(
                layout.attention_chunk_size, max_model_len, layout.block_size, layout.max_num_batched_tokens
            )
        elif group.kind is LayerKind.STATE:
            total += 1
        else:
            total += full
    return total


def capacity_plan(
    layout: KVCacheLayout,
    *,
    max_model_len: int,
    gpu_memory_gib: float | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    weights_bytes: int = 0,
    overhead_gib: float = 0.0,
    num_blocks_override: int | None = None,
) -> CapacityPlan:
    """The KV pool vLLM builds on each GPU, as its start-up log reports it.

    Available KV memory = memory x utilization - weights (per GPU) - activation overhead; blocks
    = available // bytes per block (or the `--num-gpu-blocks-override`); tokens and concurrency
    follow vLLM's capacity report: a max-model-len request needs
    `startup_blocks_per_request(max_model_len)` blocks.
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
        available = num_blocks * layout.bytes_per_block
    else:
        if gpu_memory_gib is None:
            raise ValueError("a capacity plan needs --gpu-memory-gib or a block-count override")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
        available = int(gpu_memory_gib * GIB * gpu_memory_utilization - weights_bytes - overhead_gib * GIB)
        if available <= 0:
            raise ValueError(
                f"no memory left for the KV cache: {gpu_memory_gib} GiB x {gpu_memory_utilization} "
                f"minus {weights_bytes / GIB:.2f} GiB of weights and {overhead_gib} GiB overhead"
            )
        num_blocks = available // layout.bytes_per_block
    per_request = startup_blocks_per_request(layout, max_model_len)
    max_concurrency = num_blocks / per_request
    return CapacityPlan(
        available_kv_bytes=available,
        num_blocks=num_blocks,
        kv_cache_tokens=int(max_concurrency * max_model_len),
        max_concurrency=max_concurrency,
        max_model_len=max_model_len,
        weights_bytes=weights_bytes,
    )


def weights_bytes_per_gpu(shape: ModelShape, *, dtype: str = "auto", tp: int = 1, pp: int = 1) -> int:
    """Weight memory on the busiest GPU, from the config's implied parameter count."""
    return int(shape.parameter_count * dtype_bytes(model_dtype(shape, dtype)) / (tp * pp))


def naive_bytes_per_token(shape: ModelShape, *, kv_dtype_bytes: int) -> int:
    """What a token would cost if every attention head kept its own K and V (no GQA, no MLA):
    the textbook formula, shown next to the real one."""
    return 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * kv_dtype_bytes

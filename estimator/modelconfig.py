"""Find and read a model's `config.json`: a file, a model folder, or a model id that is already
in the local Hugging Face cache. Never fetches anything over the network.

`load_layout` turns what it finds into the model's KV-group layout, which is what a request's
blocks in vLLM's shared pool depend on (a hybrid model's request holds blocks in every group).
Multimodal configs are read through their `text_config` (`estimator.kv.text_config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from estimator import kv


class ModelNotFoundError(FileNotFoundError):
    """No config could be found for the given path or model id."""


def find_config(config_or_model: str) -> Path:
    """Resolve a config file, a model folder, or a cached model id to a `config.json` path."""
    path = Path(config_or_model).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / "config.json"
        if candidate.is_file():
            return candidate
        raise ModelNotFoundError(f"{path} is a folder without a config.json")
    cached = _from_hf_cache(config_or_model)
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"{config_or_model!r} is neither a config file, a model folder, nor a model id in the "
        "local Hugging Face cache (kvgate never downloads)"
    )


def _from_hf_cache(model_id: str) -> Path | None:
    if model_id.count("/") > 1 or model_id.startswith((".", "/")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def model_folder(config_or_model: str) -> Path | None:
    """The folder beside the config, where a tokenizer would live, if there is one."""
    try:
        return find_config(config_or_model).parent
    except ModelNotFoundError:
        return None


def load_config(config_or_model: str) -> dict[str, Any]:
    """Read and parse a model config; errors name the file and say what is wrong."""
    path = find_config(config_or_model)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelNotFoundError(f"{path}: cannot read a JSON config: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelNotFoundError(f"{path}: a config must be a JSON object")
    return data


def load_layout(
    config_or_model: str,
    *,
    block_size: int,
    max_num_batched_tokens: int = kv.DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> kv.KVCacheLayout:
    """The KV-group layout of a local model for vLLM's `--block-size`, to count request blocks
    the way vLLM's shared pool does (`estimator.kv.request_blocks`).

    Block counts depend on the groups, the block size, windows and chunks, not on tensor
    parallelism or dtypes, so those flags are left at their defaults. Raises
    `ModelNotFoundError` when no config is found and `kv.ConfigError` when it is unusable.
    Blocking file I/O: call it off the event loop.
    """
    shape = kv.model_shape(load_config(config_or_model))
    return kv.kv_cache_layout(shape, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)

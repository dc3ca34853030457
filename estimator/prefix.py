"""Chained hashes of a prompt's full blocks, structured the way vLLM's prefix cache keys blocks.

vLLM 0.32 (vllm/v1/core/kv_cache_utils.py, hash_block_tokens) keys every FULL block of a
request's tokens by hash((parent block's hash, the block's token ids, extra keys)), the first
block's parent being NONE_HASH; the extra keys hold the LoRA adapter (every block), multimodal
hashes (blocks that overlap an item) and `cache_salt` (first block only). A trailing partial
block is never hashed, hence never shared. Because each hash covers its parent's, two prompts
share a leading run of equal hashes exactly as long as their leading run of equal full blocks.

These hashes have that structure but not vLLM's values: the gateway only compares its own
hashes with its own, in the process that made them, to predict which blocks a backend still
holds. Python's built-in `hash` of tuples (C, no allocation beyond the tuples) is stable within
one process, which is all that needs; it is salted per process, so never persist or share it.
What vLLM puts in extra keys goes into the seed instead (see `prefix_seed`): a seed that differs
changes the first block's hash, hence every later one, which is what vLLM's keys achieve for
the requests the gateway can hash (no media parts, see estimator.tokens).
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_seed(model: str, cache_salt: str | None) -> int:
    """The parent of the first block's hash for requests to `model` (the served name: each
    LoRA adapter has its own) with `cache_salt` (None or "": unsalted, as vLLM ignores an empty
    salt). Requests that differ in either never share a block hash, as in vLLM, where another
    adapter or salt changes the first block's extra keys."""
    # The tag keeps these seeds apart from any other tuple hashed in the process.
    return hash(("kvgate-prefix-seed", model, cache_salt or None))


def chained_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: int = 0, max_blocks: int | None = None
) -> tuple[int, ...]:
    """The chained hashes of the full `block_size`-token blocks of `token_ids`, first block
    first, at most `max_blocks` of them (None: all). Block i's hash covers `seed` and blocks
    0..i, so equal leading blocks give equal leading hashes and a difference in a block changes
    its hash and every one after it. Raises ValueError unless block_size >= 1 and max_blocks is
    None or >= 0."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"max_blocks must not be negative, not {max_blocks}")
    blocks = len(token_ids) // block_size
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    # One tuple of the hashed span, whose slices are tuples: no per-block list to convert.
    ids = tuple(token_ids[: blocks * block_size])
    hashes: list[int] = []
    parent = seed
    for start in range(0, blocks * block_size, block_size):
        parent = hash((parent, ids[start : start + block_size]))
        hashes.append(parent)
    return tuple(hashes)

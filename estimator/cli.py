"""`kvgate estimate`: a model's KV-cache cost per token, its pool, and one request's blocks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from estimator import kv
from estimator.modelconfig import ModelNotFoundError, load_config, model_folder
from estimator.tokens import RequestBodyError, Route, TokenCounter

EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="KV-cache bytes per token, pool size and request blocks for a model",
        description=(
            "Compute per-GPU KV-cache bytes per token as vLLM accounts for them, the block pool "
            "a GPU holds, and the blocks one request takes. CONFIG_OR_MODEL is a config.json, a "
            "model folder, or a model id already in the local Hugging Face cache."
        ),
    )
    parser.add_argument("model", metavar="CONFIG_OR_MODEL")
    serving = parser.add_argument_group("serving flags (as vLLM's)")
    serving.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    serving.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    serving.add_argument("--dtype", default="auto", help="model dtype, like vLLM's --dtype (default auto)")
    serving.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model dtype), fp8, fp8_e4m3, fp8_e5m2, ... (default auto)",
    )
    serving.add_argument(
        "--block-size",
        type=int,
        default=kv.DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {kv.DEFAULT_BLOCK_SIZE})",
    )
    serving.add_argument("--max-model-len", type=int, help="context length (default: the config's)")
    serving.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=kv.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens per engine step; bounds sliding-window blocks (default %(default)s)",
    )
    memory = parser.add_argument_group("capacity plan")
    memory.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU in GiB")
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=kv.DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of GPU memory vLLM may use (default %(default)s)",
    )
    memory.add_argument(
        "--weights-gib", type=float, help="weight memory per GPU (default: from the config's parameter count)"
    )
    memory.add_argument(
        "--overhead-gib",
        type=float,
        default=0.0,
        help="activation peak and other non-KV memory per GPU (default 0)",
    )
    memory.add_argument("--num-gpu-blocks-override", type=int, help="fix the block count, as vLLM's flag")
    request = parser.add_argument_group("one request")
    request.add_argument("--prompt-tokens", type=int, help="prompt length in tokens")
    request.add_argument("--max-tokens", type=int, help="output cap (default: what fits in max-model-len)")
    request.add_argument(
        "--request",
        type=Path,
        metavar="FILE",
        help="an OpenAI chat or completions body (JSON) to count with the tokenizer",
    )
    request.add_argument("--tokenizer", help="tokenizer folder or cached id (default: the model folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


class UsageError(Exception):
    """Bad input on the command line: reported in one line, exit status 2."""


def run(args: argparse.Namespace) -> int:
    try:
        result = estimate(args)
    except (UsageError, kv.ConfigError, ModelNotFoundError, RequestBodyError, ValueError) as exc:
        print(f"kvgate estimate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render_table(result))
    return 0


def estimate(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.model)
    shape = kv.model_shape(config)
    layout = kv.kv_cache_layout(
        shape,
        block_size=args.block_size,
        tp=args.tp,
        pp=args.pp,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    max_model_len = args.max_model_len or shape.max_position_embeddings
    result: dict[str, Any] = {
        "model": args.model,
        "model_type": shape.model_type,
        "layers": shape.num_layers,
        "attention_layers_per_gpu": layout.attention_layers_on_worst_stage,
        "kv_heads_per_gpu": layout.kv_heads_per_gpu,
        "head_dim": layout.head_dim,
        "mla": shape.is_mla,
        "kv_cache_dtype": layout.kv_dtype,
        "tensor_parallel": args.tp,
        "pipeline_parallel": args.pp,
        "block_size": layout.block_size,
        "kv_bytes_per_token": layout.bytes_per_token,
        "kv_bytes_per_token_physical": layout.bytes_per_token_physical,
        "kv_bytes_per_token_naive": kv.naive_bytes_per_token(shape, kv_dtype_bytes=layout.kv_dtype_bytes),
        "bytes_per_block": layout.bytes_per_block,
        "hybrid": layout.is_hybrid,
        "kv_groups": [g.kind.value for g in layout.groups],
        "sliding_window": layout.sliding_window,
        "attention_chunk_size": layout.attention_chunk_size,
        "capacity_uses": "kv_bytes_per_token (vLLM block accounting)",
        "max_model_len": max_model_len,
    }

    def context_length() -> int:
        if max_model_len is None:
            raise UsageError("the config has no max_position_embeddings: pass --max-model-len")
        return int(max_model_len)

    if args.gpu_memory_gib is not None or args.num_gpu_blocks_override is not None:
        weights = (
            int(args.weights_gib * kv.GIB)
            if args.weights_gib is not None
            else kv.weights_bytes_per_gpu(shape, dtype=args.dtype, tp=args.tp, pp=args.pp)
        )
        plan = kv.capacity_plan(
            layout,
            max_model_len=context_length(),
            gpu_memory_gib=args.gpu_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization,
            weights_bytes=weights,
            overhead_gib=args.overhead_gib,
            num_blocks_override=args.num_gpu_blocks_override,
        )
        result.update(
            weights_gib_per_gpu=round(weights / kv.GIB, 3),
            available_kv_cache_gib=round(plan.available_kv_bytes / kv.GIB, 3),
            num_blocks=plan.num_blocks,
            kv_cache_tokens=plan.kv_cache_tokens,
            max_concurrency=round(plan.max_concurrency, 2),
        )

    prompt_tokens = _prompt_tokens(args)
    if prompt_tokens is not None:
        if args.max_tokens is not None and args.max_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        room = context_length() - prompt_tokens
        if room < 1:
            raise UsageError(
                f"the prompt ({prompt_tokens} tokens) leaves no room in max-model-len {max_model_len}"
            )
        output = args.max_tokens if args.max_tokens is not None else room
        if output > room:
            raise UsageError(
                f"prompt {prompt_tokens} + max tokens {output} exceeds max-model-len {max_model_len}"
            )
        result.update(
            prompt_tokens=prompt_tokens,
            max_output_tokens=output,
            request_blocks=kv.request_blocks(layout, prompt_tokens + output),
        )
    return result


def _prompt_tokens(args: argparse.Namespace) -> int | None:
    if args.request is None:
        if args.prompt_tokens is not None and args.prompt_tokens < 0:
            raise UsageError(f"--prompt-tokens must not be negative, got {args.prompt_tokens}")
        return args.prompt_tokens  # type: ignore[no-any-return]
    try:
        body = json.loads(args.request.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read request file {args.request}: {exc}") from exc
    if not isinstance(body, dict):
        raise UsageError(f"request file {args.request} must hold a JSON object")
    route = Route.CHAT if "messages" in body else Route.COMPLETIONS
    tokenizer_source = args.tokenizer or model_folder(args.model)
    try:
        counter = TokenCounter.from_pretrained(str(tokenizer_source)) if tokenizer_source else None
    except OSError:
        counter = None
    if counter is None:
        print("kvgate estimate: no tokenizer found; prompt tokens are approximate", file=sys.stderr)
        counter = TokenCounter.approximate()
    count = counter.count(route, body)
    if args.max_tokens is None:
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(cap, int) and not isinstance(cap, bool):
            args.max_tokens = cap
    return count.longest


def render_table(result: dict[str, Any]) -> str:
    """A readable summary that puts the textbook formula beside vLLM's accounting."""
    kib = 1024
    lines = [
        f"model                     {result['model']} ({result['model_type']})",
        f"layers / per GPU          {result['layers']} / {result['attention_layers_per_gpu']} attention layers",
        f"KV heads per GPU x dim    {result['kv_heads_per_gpu']} x {result['head_dim']}"
        + ("  (MLA latent)" if result["mla"] else ""),
        f"KV cache dtype            {result['kv_cache_dtype']}",
        "",
        "bytes per token, per GPU",
        f"  naive (every head K+V)  {result['kv_bytes_per_token_naive']:>12,} B  "
        f"({result['kv_bytes_per_token_naive'] / kib:,.1f} KiB)",
        f"  physical                {result['kv_bytes_per_token_physical']:>12,} B  "
        f"({result['kv_bytes_per_token_physical'] / kib:,.1f} KiB)",
        f"  vLLM accounting         {result['kv_bytes_per_token']:>12,} B  "
        f"({result['kv_bytes_per_token'] / kib:,.1f} KiB)   <- capacity uses this",
        f"block size                {result['block_size']} tokens, {result['bytes_per_block']:,} B per block",
    ]
    if result["hybrid"]:
        windows = [
            f"{label} {result[key]}"
            for label, key in (
                ("sliding window", "sliding_window"),
                ("attention chunk", "attention_chunk_size"),
            )
            if result.get(key) is not None
        ]
        lines.append(
            f"KV groups                 {', '.join(result['kv_groups'])}"
            + (f" ({', '.join(windows)})" if windows else "")
        )
    if "num_blocks" in result:
        lines += [
            "",
            f"weights per GPU           {result['weights_gib_per_gpu']:.2f} GiB",
            f"available KV cache        {result['available_kv_cache_gib']:.2f} GiB",
            f"KV blocks per GPU         {result['num_blocks']:,}",
            f"KV cache tokens           {result['kv_cache_tokens']:,}",
            f"max concurrency           {result['max_concurrency']:.2f}x at {result['max_model_len']:,} tokens",
        ]
    if "request_blocks" in result:
        lines += [
            "",
            f"request                   {result['prompt_tokens']:,} prompt + {result['max_output_tokens']:,} output tokens",
            f"request blocks            {result['request_blocks']:,}",
        ]
    return "\n".join(lines)

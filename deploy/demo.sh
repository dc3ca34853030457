#!/usr/bin/env bash
# `make demo`: start the real vLLM CPU testbed and show kvgate's view of it.
# Leaves vLLM running (stop it with `make demo-stop`).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
PORT="${1:-8000}"
URL="http://127.0.0.1:$PORT"
MODEL="${KVGATE_CACHE_DIR:-$HOME/.cache/kvgate}/tiny-llama"
mkdir -p build

if ! curl -sf "$URL/health" >/dev/null; then
    echo "== starting the vLLM testbed on $URL (about 100 s; log in build/demo-vllm.log)"
    $BIN/python tests/testbed/testbed.py start --port "$PORT" --pidfile build/demo-vllm.pid \
        --log build/demo-vllm.log >/dev/null
fi

echo
echo "== what vLLM says about its KV pool (vllm:cache_config_info)"
curl -s "$URL/metrics" | grep '^vllm:cache_config_info' | tr ',' '\n' \
    | grep -E '^(block_size|num_gpu_blocks|kv_cache_size_tokens|kv_cache_max_concurrency)='

echo
echo "== what kvgate estimates for the same model and flags"
$BIN/kvgate estimate "$MODEL" --block-size 32 --max-model-len 1024 --num-gpu-blocks-override 64 \
    --prompt-tokens 200 --max-tokens 400

echo
echo "== the same arithmetic for a real model: Llama-3.1-8B on one 80 GiB GPU"
$BIN/kvgate estimate tests/fixtures/configs/llama-3.1-8b.json --gpu-memory-gib 80 --overhead-gib 2 \
    --max-model-len 8192 --prompt-tokens 1500 --max-tokens 500

echo
echo "vLLM testbed: $URL (OpenAI API at $URL/v1, metrics at $URL/metrics); stop it with: make demo-stop"

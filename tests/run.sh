#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it: lint and types, then pytest with a real vLLM.
# Starts the vLLM testbed once (unless KVGATE_TEST_VLLM_URL names a running one) and stops it
# on exit, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
mkdir -p build

echo "== lint and types"
$BIN/ruff check .
$BIN/ruff format --check .
$BIN/mypy

if [[ -z "${KVGATE_TEST_VLLM_URL:-}" ]]; then
    port="${KVGATE_TEST_VLLM_PORT:-8031}"
    echo "== starting the vLLM testbed on port $port (about 100 s)"
    trap '$BIN/python tests/testbed/testbed.py stop --pidfile build/test-vllm.pid' EXIT
    KVGATE_TEST_VLLM_URL="$($BIN/python tests/testbed/testbed.py start --port "$port" \
        --pidfile build/test-vllm.pid --log build/test-vllm.log)"
    export KVGATE_TEST_VLLM_URL
fi
echo "== pytest against $KVGATE_TEST_VLLM_URL"
$BIN/pytest -p no:cacheprovider "$@"

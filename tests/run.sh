#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it: lint and types, then pytest with a real vLLM.
# Starts the vLLM testbed once (unless KVGATE_TEST_VLLM_URL names a running one) and, beside it
# and at the same time, the variant that the prefix-cache and request-template tests need
# (prefix caching off, request chat templates trusted; unless both of their URLs are given);
# stops what it started on exit, whatever happens. The LoRA tests start their own engine.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
mkdir -p build

echo "== lint and types"
$BIN/ruff check .
$BIN/ruff format --check .
$BIN/mypy

started=()
stop_started() {
    for pidfile in "${started[@]}"; do
        $BIN/python tests/testbed/testbed.py stop --pidfile "$pidfile" || true
    done
}
trap stop_started EXIT

start_testbed() {  # name port [vLLM flags...]: starts in the background, URL in build/NAME.url
    local name=$1 port=$2
    shift 2
    started+=("build/$name.pid")
    $BIN/python tests/testbed/testbed.py start --port "$port" --pidfile "build/$name.pid" \
        --log "build/$name.log" -- "$@" >"build/$name.url" &
}

waits=()
if [[ -z "${KVGATE_TEST_VLLM_URL:-}" ]]; then
    echo "== starting the vLLM testbed on port ${KVGATE_TEST_VLLM_PORT:-8031} (about 100 s)"
    start_testbed test-vllm "${KVGATE_TEST_VLLM_PORT:-8031}"
    waits+=($!)
fi
if [[ -z "${KVGATE_TEST_VLLM_NO_PREFIX_CACHE_URL:-}" || -z "${KVGATE_TEST_VLLM_TRUSTED_URL:-}" ]]; then
    echo "== starting the variant testbed (no prefix cache, trusted templates) on port 8032"
    start_testbed test-vllm-variant 8032 --no-enable-prefix-caching --trust-request-chat-template
    waits+=($!)
fi
for pid in "${waits[@]}"; do
    wait "$pid"
done
if [[ -z "${KVGATE_TEST_VLLM_URL:-}" ]]; then
    KVGATE_TEST_VLLM_URL="$(cat build/test-vllm.url)"
    export KVGATE_TEST_VLLM_URL
fi
if [[ -f build/test-vllm-variant.url ]] && [[ " ${started[*]} " == *" build/test-vllm-variant.pid "* ]]; then
    variant="$(cat build/test-vllm-variant.url)"
    export KVGATE_TEST_VLLM_NO_PREFIX_CACHE_URL="${KVGATE_TEST_VLLM_NO_PREFIX_CACHE_URL:-$variant}"
    export KVGATE_TEST_VLLM_TRUSTED_URL="${KVGATE_TEST_VLLM_TRUSTED_URL:-$variant}"
fi
echo "== pytest against $KVGATE_TEST_VLLM_URL"
$BIN/pytest -p no:cacheprovider "$@"

#!/usr/bin/env bash
# `make demo`: the real vLLM CPU testbed, kvgate in front of it, and two bursts through both, one
# at what this machine's vLLM sustains (1x, measured first) and one at three times that.
# Prints what the gateway changed and leaves both running (stop them with `make demo-stop`).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
VLLM_PORT="${1:-8000}"
KVGATE_PORT="${2:-8080}"
VLLM="http://127.0.0.1:$VLLM_PORT"
KVGATE="http://127.0.0.1:$KVGATE_PORT"
MODEL="${KVGATE_CACHE_DIR:-$HOME/.cache/kvgate}/tiny-llama"
PIN_GATEWAY=()
if [[ $(nproc) -gt 1 ]] && command -v taskset >/dev/null; then
    PIN_GATEWAY=(taskset -c 0)   # the engine has the last core; gateway and load share core 0
fi
mkdir -p build
# The demo's requests: 150-300 prompt tokens, 150-350 output tokens (max_tokens 512).
REQUESTS="prompt=uniform:150:300,output=uniform:150:350"

if ! curl -sf "$VLLM/health" >/dev/null; then
    echo "== starting the vLLM testbed on $VLLM (about 100 s; log in build/demo-vllm.log)"
    $BIN/python tests/testbed/testbed.py start --port "$VLLM_PORT" --pidfile build/demo-vllm.pid \
        --log build/demo-vllm.log >/dev/null
fi
if ! curl -sf "$KVGATE/healthz" >/dev/null; then
    echo "== starting kvgate on $KVGATE in front of it (log in build/demo-kvgate.log)"
    "${PIN_GATEWAY[@]}" $BIN/kvgate serve --backend "$VLLM" --port "$KVGATE_PORT" \
        >build/demo-kvgate.log 2>&1 &
    echo $! >build/demo-kvgate.pid
    for _ in $(seq 120); do curl -sf "$KVGATE/readyz" >/dev/null && break; sleep 0.5; done
fi

echo
echo "== what vLLM says about its KV pool, and what kvgate estimates for the same model and flags"
curl -s "$VLLM/metrics" | grep '^vllm:cache_config_info' | tr ',' '\n' \
    | grep -E '^(block_size|num_gpu_blocks|kv_cache_size_tokens)=' | tr '\n' ' '
echo
$BIN/kvgate estimate "$MODEL" --block-size 32 --max-model-len 1024 --num-gpu-blocks-override 64 \
    --prompt-tokens 250 --max-tokens 300 --json \
    | $BIN/python -c '
import json, sys
d = json.load(sys.stdin)
print(f"kvgate estimate: {d['"'"'kv_bytes_per_token'"'"']} B/token, {d['"'"'num_blocks'"'"']} blocks of {d['"'"'block_size'"'"']}, "
      f"{d['"'"'kv_cache_tokens'"'"']} tokens; a 250 + 300 token request takes {d['"'"'request_blocks'"'"']} blocks")'

echo
echo "== warming up kvgate's output-length model: 30 requests at 3 per second through kvgate"
echo "   (a fresh gateway reserves each request's whole max_tokens until it has seen answers)"
"${PIN_GATEWAY[@]}" $BIN/kvgate bench --target "$KVGATE" \
    --synthetic "n=30,rate=3,$REQUESTS" \
    --max-tokens 512 --seed 3 --out build/demo-warmup >/dev/null 2>&1

# The bursts are sized by measurement: the testbed's speed differs by 2x between machines, so a
# rate fixed here would be within capacity on one and far beyond it on another.
echo
echo "== measuring what this machine's vLLM sustains: bursts of 40 of the demo's requests straight to it,"
echo "   rate doubled then bisected until it finishes 98% within 10 s; 1x is 0.8 of that rate"
ONE_X=$("${PIN_GATEWAY[@]}" $BIN/python deploy/demo_rate.py --vllm "$VLLM" --requests "$REQUESTS" \
    --out build/demo-rate | sed -n 's/^1x=//p')
[[ -n "$ONE_X" ]] || { echo "could not measure a rate this vLLM sustains (build/demo-rate)"; exit 1; }
THREE_X=$($BIN/python -c "print(f'{3 * $ONE_X:.4g}')")
echo "   1x = $ONE_X requests/s"

# Each burst goes first straight to vLLM, then through kvgate, on the same arrivals. Clients
# send X-Kvgate-Deadline-Ms: they want their whole answer within 10 s, and give up then.
burst() {  # name, synthetic spec, what it is
    echo
    echo "== $3"
    "${PIN_GATEWAY[@]}" $BIN/kvgate bench --target "$VLLM" --target "$KVGATE" --synthetic "$2" \
        --max-tokens 512 --clients deadline --deadline 10 --backend-metrics "$VLLM/metrics" \
        --seed 7 --out "build/demo-$1" >"build/demo-$1.log" 2>&1 || { tail -n 5 "build/demo-$1.log"; exit 1; }
    $BIN/python deploy/demo_summary.py "build/demo-$1/summary.json"
    echo "   full report: build/demo-$1/report.md (plots beside it)"
}
burst within "n=40,rate=$ONE_X,$REQUESTS" \
    "at capacity (1x): 40 requests (150-300 prompt + 150-350 output tokens) at $ONE_X per second"
burst beyond "n=120,rate=$THREE_X,$REQUESTS" \
    "beyond capacity (3x): 120 of the same requests at $THREE_X per second"

echo
echo "vLLM:   $VLLM/v1  (metrics $VLLM/metrics)"
echo "kvgate: $KVGATE/v1  (status page $KVGATE/dashboard, metrics $KVGATE/metrics)"
echo "stop both with: make demo-stop"

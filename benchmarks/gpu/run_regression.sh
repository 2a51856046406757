#!/usr/bin/env bash
# Before / after in one device call: the medium V4.1 decode step (batch 1 / 8 / 64, graphs, native BF16) and
# one 16k-token prefill chunk, for a baseline tree and for this tree, on the same GPU, interleaved; then the
# after / before ratios (compare_trees.py).
#
#     git archive BASE packages native | tar -x -C .baseline          # the baseline's code, gitignored
#     bash benchmarks/gpu/run_regression.sh [BASELINE_DIR]            # default .baseline; carry it and the bundle
#
# Needs the kernel bundle in BUNDLE_DIR (default .gpu: bundle.tar.xz, setup.sh, pysite.tar.xz; see README.md
# here; DeepGEMM is not built, so a bundle without its sdist and the z3 binary fits the carry limit beside
# both trees). The medium checkpoint is made
# once, by this tree's generator, and both trees load it. Knobs: REGRESS_BATCHES (1,8,64), REGRESS_CHUNK
# (16384), REGRESS_STEPS (measured decode steps, 12), REGRESS_ROUNDS (decode runs per tree, interleaved, 2),
# REGRESS_LIMIT_S (per bench run, 150); REGRESS_TESTS: pytest paths of this tree's gpu tests to run while the
# checkpoint is made (before any timing; `-m "gpu and not slow"`, limit REGRESS_TESTS_LIMIT_S, default 150).
# Results: $OUT (device tool) or benchmarks/out: regression_{decode,prefill}_{baseline,current}.json and
# regression.json (one record per configuration with both times and their ratio).
set -uo pipefail
baseline=$(cd "${1:-.baseline}" && pwd) || { echo "no baseline tree at ${1:-.baseline}" >&2; exit 2; }
final=${OUT:-benchmarks/out}
out=/tmp/gpu-regression-out
mkdir -p "$out" "$final"
trap 'cp "$out"/*.json "$final"/ 2>/dev/null; tar -C "$out" -czf "$final/regression_logs.tar.gz" --exclude="*.json" .' EXIT
export PYTHONUNBUFFERED=1 HOME=${HOME:-/root} OMP_NUM_THREADS=16 LC_ALL=C
export DEEPINFER_ACCELERATOR=${DEEPINFER_ACCELERATOR:-nvidia}  # (the benches run native numerics, the tests their own)
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
bundle=${BUNDLE_DIR:-.gpu}
source "$bundle/setup.sh" || { echo "bundle setup failed" >&2; exit 1; }
[ -f "$bundle/pysite.tar.xz" ] && tar -C /tmp -xJf "$bundle/pysite.tar.xz"
export -n DEEPINFER_SITE  # setup.sh's own variable, not an engine setting
current=$PWD
medium=/tmp/medium-v41
src_path() { ls -d "$1"/packages/*/src | grep -v deepinfer-sched | tr '\n' ':'; }
base_path=$PYTHONPATH
(PYTHONPATH="$(src_path "$current")/tmp/pysite:$base_path" python3 benchmarks/gpu/make_medium_checkpoint.py "$medium" \
  > "$out/medium_checkpoint.log" 2>&1) &
medium_pid=$!
for tag in baseline current; do  # each tree's own C++ scheduler (its step output may differ)
  tree=$([ $tag = baseline ] && echo "$baseline" || echo "$current")
  el "building deepinfer-sched of the $tag tree"
  python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/sched-$tag" "$tree/packages/deepinfer-sched" \
    > "$out/sched_build_$tag.log" 2>&1 || { tail -20 "$out/sched_build_$tag.log"; exit 1; }
done
if [ -n "${REGRESS_TESTS:-}" ]; then  # the GPU is idle while the checkpoint is drawn: this tree's gpu tests
  el "gpu tests: $REGRESS_TESTS"
  PYTHONPATH="/tmp/sched-current:$(src_path "$current")/tmp/pysite:$base_path" timeout "${REGRESS_TESTS_LIMIT_S:-150}" \
    python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" -n 4 -rfE $REGRESS_TESTS > "$out/gpu_tests.log" 2>&1
  tail -15 "$out/gpu_tests.log"
fi
wait "$medium_pid" || { tail -20 "$out/medium_checkpoint.log"; exit 1; }
el "$(tail -1 "$out/medium_checkpoint.log")"
run() {  # run TAG MODE NAME ARGS...: one bench of one tree, its results named NAME
  local tag=$1 mode=$2 name=$3; shift 3
  local tree; tree=$([ "$tag" = baseline ] && echo "$baseline" || echo "$current")
  el "bench $mode: $name"
  (cd "$tree" && PYTHONPATH="/tmp/sched-$tag:$(src_path "$tree")/tmp/pysite:$base_path" DEEPINFER_NUMERICS=native \
    timeout "${REGRESS_LIMIT_S:-150}" python3 -m deepinfer.cli bench "$mode" --model "$medium" --device cuda \
    --dtype bfloat16 --no-progress --no-plot --results-dir "$out" --name "$name" "$@") \
    > "$out/$name.log" 2>&1
  tail -8 "$out/$name.log"
  cp "$out"/*.json "$final"/ 2>/dev/null  # out at once: a later run may hit the call's limit
}
dec=(--max-model-len 1024 --decode-context 128 --batches "${REGRESS_BATCHES:-1,8,64}" --nextn 0
     --measure-steps "${REGRESS_STEPS:-12}")
pre=(--max-model-len 20480 --max-num-seqs 1 --chunks "${REGRESS_CHUNK:-16384}" --prefill-repeats 2)
for round in $(seq "${REGRESS_ROUNDS:-2}"); do  # decode interleaved: drift of the card shows as spread
  sfx=$([ "$round" = 1 ] || echo "_$round")
  for tag in baseline current; do run $tag decode "regression_decode_$tag$sfx" "${dec[@]}"; done
done
for tag in baseline current; do
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run $tag prefill "regression_prefill_$tag" "${pre[@]}"
done
python3 benchmarks/gpu/compare_trees.py "$out" --output "$out/regression.json"
el "done"

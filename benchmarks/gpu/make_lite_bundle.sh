#!/usr/bin/env bash
# Write .gpu-lite/bundle.tar.xz + setup.sh: the kernel bundle (.gpu/bundle.tar.xz, made by the environment's bundle
# script) without what the engine suite's NO_DEEP_GEMM=1 steps never use, so that it travels beside the checkout
# and .gpu/pysite.tar.xz within the device tool's 64 MiB: the z3 command-line binary (TileLang uses libz3.so, kept
# once with its versioned name as a link) and the DeepGEMM / DeepEP source distributions. About 50 MiB (58 MiB in).
#
#   bash benchmarks/gpu/make_lite_bundle.sh            (from the project root; xz takes ~1.5 min on 2 cores)
#
# On the CUDA machine (carry .gpu-lite/bundle.tar.xz, .gpu-lite/setup.sh, .gpu/pysite.tar.xz, .gpu/rpds312.tar.xz):
#   mkdir -p .gpu && cp .gpu-lite/* .gpu/ && NO_DEEP_GEMM=1 bash benchmarks/gpu/run_engine_suite.sh engine vision
set -euo pipefail
src=${1:-.gpu}
out=${2:-.gpu-lite}
[ -f "$src/bundle.tar.xz" ] && [ -f "$src/setup.sh" ] || { echo "no $src/bundle.tar.xz + setup.sh" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$src/bundle.tar.xz"
rm -f "$work"/site/z3_solver-*.data/data/bin/z3 "$work"/extra/*.tar.gz
lib="$work/site/z3/lib"
if [ -f "$lib/libz3.so" ] && [ ! -L "$lib/libz3.so" ]; then
    versioned=$(cd "$lib" && ls libz3.so.* | head -1)
    rm "$lib/libz3.so" && ln -s "$versioned" "$lib/libz3.so"
fi
mkdir -p "$out"
tar -C "$work" -cJf "$out/bundle.tar.xz" site extra
cp "$src/setup.sh" "$out/"
ls -la "$out"

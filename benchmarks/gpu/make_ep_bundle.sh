#!/usr/bin/env bash
# Write .gpu-ep/ (gitignored; < 64 MiB, what one call to the multi-GPU machine can carry): NCCL 2.32.3 with only
# its Hopper code (DeepEP 2.5 needs NCCL >= 2.32.3; the machine's torch ships 2.28.9), the DeepEP sdist, the
# engine's pure-Python extras (xgrammar, pydantic) from .gpu/bundle.tar.xz, and .gpu's pysite / rpds tarballs.
# Run from the project root on a machine that reaches PyPI, after .gpu/ exists (../shared/gpu/make-bundle.sh).
set -euo pipefail
root=$PWD dst=$PWD/.gpu-ep work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dst" "$work/pkg/nccl/lib" "$work/pkg/site"
python3 -m pip download -q --no-deps -d "$work" "nvidia-nccl-cu13==2.32.3"
(cd "$work" && unzip -q nvidia_nccl_cu13-*.whl 'nvidia/nccl/*')
cp -r "$work/nvidia/nccl/include" "$work/pkg/nccl/"
cp "$work"/nvidia/nccl/lib/libnccl_device.* "$work/pkg/nccl/lib/"
python3 "$root/benchmarks/gpu/prune_fatbin.py" "$work/nvidia/nccl/lib/libnccl.so.2" "$work/pkg/nccl/lib/libnccl.so.2"
strip --strip-debug "$work/pkg/nccl/lib/libnccl.so.2"
tar -C "$work" -xJf "$root/.gpu/bundle.tar.xz" extra/deepinfer_ep-2.5.0.tar.gz $(tar -tJf "$root/.gpu/bundle.tar.xz" | grep '^extra/.*\.deb$') \
  $(tar -tJf "$root/.gpu/bundle.tar.xz" | grep -E '^site/(xgrammar|pydantic|pydantic_core|annotated_types|typing_inspection|tvm_ffi|apache_tvm_ffi|torch_c_dlpack_ext)[^/]*/$')
mkdir -p "$work/pkg/extra" && mv "$work"/extra/* "$work/pkg/extra/"  # the sdist and elfutils headers (DeepJIT)
mv "$work"/site/* "$work/pkg/site/"
tar -C "$work/pkg" -cJf "$dst/ep.tar.xz" -T <(cd "$work/pkg" && ls)
cp "$root/.gpu/pysite.tar.xz" "$root/.gpu/rpds312.tar.xz" "$dst/"
du -sh "$dst"/*

#!/usr/bin/env bash
# Build DeepEP (`deep_ep`, PyPI sdist `deepinfer-ep`, carried in .gpu/bundle.tar.xz) on the CUDA machine into
# $DEEPINFER_SITE/site (source .gpu/setup.sh first). Its kernels are JIT-compiled at run time (DeepJIT);
# the build here is only the host extension. Prints the toolchain it saw; exit 1 if the import fails.
set -uo pipefail
: "${DEEPINFER_SITE:?source .gpu/setup.sh first}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "nvcc: $(nvcc --version | tail -2 | head -1)"
python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "built with nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())
import ctypes; v = ctypes.c_int(); ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v)); print("nccl loaded", v.value)
for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        pass
PY
if ! python3 -c "import deep_ep" 2>/dev/null; then
  ( set -e; mkdir -p "$DEEPINFER_SITE/build" && cd "$DEEPINFER_SITE/build"
    tar xzf "$DEEPINFER_SITE"/extra/deepinfer_ep-*.tar.gz && cd deepinfer_ep-*
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --target "$DEEPINFER_SITE/site" . )
fi
python3 -c 'import deep_ep; print("deep_ep", deep_ep.__file__)' || exit 1

# source on the multi-GPU machine from the project root (carry .gpu-ep, made by make_ep_bundle.sh):
#   source benchmarks/gpu/setup_ep.sh
# Unpacks NCCL 2.32.3 (Hopper code only) and makes every process load it (LD_PRELOAD: torch and deep_ep must use
# the same libnccl), builds DeepEP against it, puts xgrammar / pydantic / the small pure-Python extras on
# PYTHONPATH, and sets the NVLink-multicast switches the machine's notes require in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DEEPINFER_SITE=/tmp/deepinfer-ep CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ ! -d "$DEEPINFER_SITE/site" ]; then
  mkdir -p "$DEEPINFER_SITE" && tar -C "$DEEPINFER_SITE" -xJf .gpu-ep/ep.tar.xz
  for d in "$DEEPINFER_SITE"/extra/*.deb; do dpkg -x "$d" "$DEEPINFER_SITE/sys"; done  # elfutils for DeepJIT
  for t in .gpu-ep/pysite.tar.xz .gpu-ep/rpds312.tar.xz; do [ -f "$t" ] && tar -C /tmp -xJf "$t"; done
fi
export EP_NCCL_ROOT_DIR="$DEEPINFER_SITE/nccl"
export LD_PRELOAD="$EP_NCCL_ROOT_DIR/lib/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}"
# torch also maps its own NCCL 2.28 by path (seen: both in /proc/self/maps), so DeepEP's same-library check is
# skipped and DeepEP creates its own communicator with 2.32 instead of reusing torch's.
export EP_SUPPRESS_NCCL_CHECK=1 EP_REUSE_NCCL_COMM=0
# One host, NVLink only: no RDMA network, so NCCL GIN (DeepEP's RDMA path) is unavailable (seen: "NCCL GIN is unavailable").
export EP_DISABLE_GIN=1
export PYTHONPATH="$DEEPINFER_SITE/site:/tmp/pysite${PYTHONPATH:+:$PYTHONPATH}"
export CPATH="$DEEPINFER_SITE/sys/usr/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$DEEPINFER_SITE/sys/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$DEEPINFER_SITE/sys/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EP_JIT_CACHE_DIR=/tmp/deepinfer-ep/jit
bash benchmarks/gpu/build_deep_ep.sh > "$DEEPINFER_SITE/build_deep_ep.log" 2>&1 || { tail -40 "$DEEPINFER_SITE/build_deep_ep.log"; false; }

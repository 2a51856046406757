"""Kernel backends of the op registry (`deepinfer_model.ops`).

* `cpu`: thin wrappers over the reference blocks in `deepinfer_model.layers` (FP64 math, the spec's
  rounding points) - the definition of correctness.
* `nvidia`: Hopper (SM90) implementations: TileLang kernels, FlashMLA (legacy SM90 kernels), DeepGEMM,
  torch on CUDA where a library kernel is not (yet) used.

A backend module registers its ops when imported; `deepinfer_model.ops.get_ops()` imports it.
"""

"""The TileLang kernels lower to CUDA for SM90 (no GPU needed; skipped without the `nvidia` extra).

Catches front-end errors (annotations, layouts, loop forms) before a device run; numerics are checked
on the GPU by test_ops_nvidia.py.
"""

from __future__ import annotations

import pytest

tilelang = pytest.importorskip("tilelang")

from deepinfer_model.backends.nvidia import tilelang_mhc, tilelang_norm, tilelang_rope  # noqa: E402

PROGRAMS = {
    "norm_bf16": lambda: tilelang_norm._norm_program(512, "bfloat16", "bfloat16", 1e-6, 128),
    "norm_f32_to_bf16": lambda: tilelang_norm._norm_program(1536, "float32", "bfloat16", 1e-6, 128),
    "rope_with_passthrough": lambda: tilelang_rope._rope_program(512, 32, 64, "float32", "bfloat16"),
    "rope_all_channels": lambda: tilelang_rope._rope_program(128, 64, 4, "bfloat16", "bfloat16"),
    "hc_read": lambda: tilelang_mhc._read_program(4, 7168, "bfloat16", "bfloat16"),
    "hc_read_small_block": lambda: tilelang_mhc._read_program(4, 96, "float32", "float32"),
    "hc_write": lambda: tilelang_mhc._write_program(4, 7168, "float32", "float32", "bfloat16"),
    "hc_mixes_epilogue": lambda: tilelang_mhc._mixes_program(4, 20, 1e-6),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_kernel_lowers_to_cuda_for_sm90(name):
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        lowered = tilelang.lower(PROGRAMS[name](), target=target)
    source = getattr(lowered, "kernel_source", None) or str(lowered)
    assert "__global__" in source

"""The NVIDIA backend's Triton kernels compile for Hopper (SM90) on a machine without a GPU.

Triton's interpreter (`test_triton_interpreted.py`) checks what the kernels compute, in Python: it does not
lower them, so a construct the GPU compiler rejects (a block shape `tl.dot` cannot take, an unsupported
conditional, a constexpr of the wrong kind) passes there and fails only on the device. Here each kernel goes
through Triton's whole pipeline to SM90 machine code (its bundled `ptxas`), with the specialisations the
prefill and decode paths launch, and the matrix products must use the tensor cores. Runs on the CPU CI;
what the machine code computes is still the GPU tests' business (`test_ops_nvidia.py`).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


HOPPER_SHARED_MEMORY = 232_448  # bytes a block may use on SM90 (what a launch beyond it fails with)


def _compile(fn, signature: dict, constexprs: dict, num_warps: int = 4, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bin_dir, "ptxas")):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def _f32(*names):
    return {n: "*fp32" for n in names}


@pytest.mark.parametrize("weighted", [True, False])
def test_expert_swiglu_kernel(weighted):
    from deepinfer_model.backends.nvidia import triton_moe_sum as m

    sig = {
        "g_ptr": "*bf16",
        "u_ptr": "*bf16",
        "ws_ptr": "*fp32",
        "h_ptr": "*bf16",
        "N": "i32",
        "limit": "fp32",
    }
    assert "cubin" in _compile(m._swiglu_kernel, sig, {"WEIGHTED": weighted, "BLOCK": 1024}).asm


@pytest.mark.parametrize(
    "gather,weighted,y,round_to", [(True, False, "*bf16", "bf16"), (False, True, "*fp32", "fp32")]
)
def test_expert_combine_kernel(gather, weighted, y, round_to):
    import triton.language as tl
    from deepinfer_model.backends.nvidia import triton_moe_sum as m

    sig = {"y_ptr": y, "pos_ptr": "*i64", **_f32("ws_ptr", "add_ptr", "out_ptr"), "H": "i32"}
    consts = {"K_SLOTS": 6, "GATHER": gather, "WEIGHTED": weighted, "HAS_ADD": True, "BLOCK": 1024}
    consts["ROUND_TO"] = tl.bfloat16 if round_to == "bf16" else tl.float32
    assert "cubin" in _compile(m._combine_kernel, sig, consts).asm


@pytest.mark.parametrize(
    "trunk,parts,read", [("*bf16", "*bf16", True), ("*bf16", "*bf16", False), ("*fp16", "*fp32", True)]
)
def test_mhc_projection_kernel_uses_the_tensor_cores(trunk, parts, read):
    from deepinfer_model.backends.nvidia import triton_mhc as h

    sig = {"x_ptr": trunk, "f_ptr": parts, **_f32("z_ptr", "ss_ptr", "w_ptr"), "r_ptr": trunk}
    sig.update(T="i32", H="i32", one="fp32")
    consts = {
        "M": 4,
        "READ": read,  # (with the sub-layer's read: `hc_mixes_read`; without: `hc_mixes`)
        "N": 24,
        "BLOCK_N": 32,
        "BLOCK_T": h.PROJECT_BLOCK_T,
        "BLOCK_K": h.PROJECT_BLOCK_K,
    }
    import torch

    dtype = torch.bfloat16 if trunk == "*bf16" else torch.float16
    compiled = _compile(h._project_kernel, sig, consts, **h.project_pipelining(dtype))
    # (the FP16 trunk's launch once asked the H200 for 360 KB and failed to launch)
    assert compiled.metadata.shared <= HOPPER_SHARED_MEMORY
    ptx = compiled.asm["ptx"]
    # tensor-core products, exact for these operands: BF16 x BF16 parts, or FP16 (as TF32) x TF32 parts
    assert "mma" in ptx and (".bf16" if parts == "*bf16" else ".tf32") in ptx
    # each chunk's tensor-core sum starts from zero and is added to the running sum outside the dots (the
    # tensor cores truncate what they add: fed the running sum, the bias grows with K)
    ttgir = compiled.asm["ttgir"]
    assert re.search(r"arith\.mulf %[\w#]+, %[\w#]+", ttgir) and "arith.addf" in ttgir


@pytest.mark.parametrize("ss_given", [True, False])
def test_mhc_mixes_kernel(ss_given):
    from deepinfer_model.backends.nvidia import triton_mhc as h

    sig = {**_f32("z_ptr", "x_ptr", "ss_ptr", "scale_ptr", "base_ptr", "pre_ptr", "post_ptr", "comb_ptr")}
    sig.update(n_k="i32", rms_eps="fp32", hc_eps="fp32")
    consts = {"M": 4, "MP": 4, "ITERS": 20, "BLOCK_K": 1024, "SS_GIVEN": ss_given}
    assert "cubin" in _compile(h._mixes_kernel, sig, consts).asm


def test_topk_keys_kernel():
    from deepinfer_model.backends.nvidia import triton_keys as k

    sig = {"bits_ptr": "*i16", "valid_ptr": "*u8", "out_ptr": "*i32", "n": "i32"}
    assert "cubin" in _compile(k._keys_kernel, sig, {"BLOCK": k.BLOCK}).asm


def test_topk_indices_kernels():
    from deepinfer_model.backends.nvidia import triton_select as s

    sig = {"bits_ptr": "*i16", "valid_ptr": "*u8", "out_ptr": "*i64", "n": "i32", "k": "i32"}
    assert (
        "cubin" in _compile(s._select_kernel, dict(sig), {"BLOCK": s.BLOCK, "OUT_BLOCK": s.OUT_BLOCK}, 8).asm
    )
    for row, warps in ((s.ROW_MAX, 16), (1024, 4)):  # the row in registers: the launches topk_indices makes
        consts = {"ROW": row, "OUT_BLOCK": s.OUT_BLOCK}
        assert "cubin" in _compile(s._select_row_kernel, dict(sig), consts, warps).asm


@pytest.mark.parametrize(
    "h,trunk,kv,out,round_to",
    [
        (4096, "*bf16", "*bf16", "*bf16", "bf16"),  # medium V4.1, native BF16 (narrow trunk, keys and values)
        (7168, "*bf16", "*bf16", "*fp32", "bf16"),  # full V4.1 width; the FP32 carrier out (a wide trunk)
        (256, "*fp32", "*fp32", "*fp32", "fp32"),  # FP32 activations; many tokens per program
    ],
)
def test_engram_gate_kernel(h, trunk, kv, out, round_to):
    import triton.language as tl
    from deepinfer_model.backends.nvidia import triton_engram as e

    sig = {"x_ptr": trunk, "k_ptr": kv, "v_ptr": kv, "qk_ptr": "*fp32", "img_ptr": "*u8", "out_ptr": out}
    sig.update({n: "i32" for n in ("T", "H", "x_st", "x_ss", "k_st", "k_ss", "v_st")})
    sig.update(eps="fp32", sqrt_h="fp32")
    block_h, block_t, warps = e._config(h)
    consts = {"M": 4, "BLOCK_T": block_t, "BLOCK_H": block_h}
    consts["ROUND_TO"] = tl.bfloat16 if round_to == "bf16" else tl.float32
    kernel = _compile(e._gate_kernel, sig, consts, num_warps=warps)
    assert "cubin" in kernel.asm
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(cuobjdump):  # no register spills (a stack frame) at the tile sizes `_config` picks
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


@pytest.mark.parametrize("scores,block", [("*bf16", 16), ("*fp32", 64)])
def test_block_max_kernel(scores, block):
    from deepinfer_model.backends.nvidia import triton_blocks as b

    sig = {"s_ptr": scores, "v_ptr": "*u8", "max_ptr": scores, "count_ptr": "*i64"}
    sig.update(T="i32", n="i32", nb="i32")
    assert "cubin" in _compile(b._block_max_kernel, sig, {"BLOCK": block, "ROWS": b.ROWS, "COLS": b.COLS}).asm

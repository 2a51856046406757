"""The NVIDIA backend's Triton kernels run by Triton's interpreter on the CPU against the CPU reference.

The `gpu` tests check the compiled kernels on an H200; these check the same kernel source on every CI
run (indexing, masks, padded tiles), so a logic error shows up before a device call. The interpreter is
chosen when `triton.jit` decorates a kernel, so each check runs in a fresh process with
`TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

_MIXES = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_mhc
    cpu, errors = get_ops("cpu"), []
    torch.manual_seed(0)
    for t, m, h, iters in json.loads(sys.argv[1]):
        trunk = (torch.randn(t, m, h) * 2).to(torch.bfloat16)
        fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
        base, scale = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5
        refs = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, iters)
        outs = triton_mhc.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, iters)
        for o, r in zip(outs, refs, strict=True):
            assert o.shape == r.shape and o.dtype == torch.float32, (o.shape, r.shape, o.dtype)
            assert bool(torch.isfinite(o).all())
            errors.append(float((o.double() - r.double()).norm() / r.double().norm()))
    print(json.dumps(errors))
    """
)


_EXPERTS = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_moe
    cpu, errors, dt = get_ops("cpu"), [], torch.float16
    torch.manual_seed(0)
    for t, k, e, inter, hidden, weight_before_down in json.loads(sys.argv[1]):
        x = torch.randn(t, hidden).to(dt)
        w1 = (torch.randn(e, inter, hidden) * hidden**-0.5).to(dt)
        w3 = (torch.randn(e, inter, hidden) * hidden**-0.5).to(dt)
        w2 = (torch.randn(e, hidden, inter) * inter**-0.5).to(dt)
        pairs = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).reshape(-1) if t else torch.zeros(0, dtype=torch.long)
        ws = torch.rand(t * k)
        ref = cpu.expert_swiglu(x, pairs, ws, w1, w3, w2, 1.5, weight_before_down)
        out = triton_moe.expert_swiglu(x, pairs, ws, w1, w3, w2, 1.5, weight_before_down)
        assert out.shape == ref.shape == (t * k, hidden) and out.dtype == torch.float32, (out.shape, ref.shape)
        assert bool(torch.isfinite(out).all())
        errors.append(float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)))
    print(json.dumps(errors))
    """
)


_SORT = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.backends.nvidia import triton_moe
    torch.manual_seed(0)
    same = []
    for p, e, out_of_range in json.loads(sys.argv[1]):
        pairs = torch.randint(0, e, (p,))
        if out_of_range:
            pairs[p // 2] = e + 3
        order, ends = triton_moe.sort_pairs(pairs, e)
        # torch's stable sort and group ends, with the out-of-range id sorted last
        ref_order = torch.argsort(torch.where(pairs < e, pairs, e), stable=True)
        ref_ends = torch.searchsorted(pairs[ref_order], torch.arange(e), right=True).to(torch.int32)
        n = int(ref_ends[-1])
        same.append(bool(torch.equal(ends, ref_ends) and torch.equal(order[:n], ref_order[:n])))
    print(json.dumps(same))
    """
)


def _interpreted(script: str, arg: str) -> list[float]:
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_TILELANG="0")
    done = subprocess.run(
        [sys.executable, "-c", script, arg], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mhc_mixes_kernel_matches_the_reference():
    # m = 4 (V4.1), m = 2, and m = 3 (a padded tile); one and twenty Sinkhorn iterations; a trunk row longer
    # than one load block of the row norm
    shapes = [[1, 4, 512, 20], [6, 4, 700, 20], [5, 2, 256, 1], [3, 3, 96, 20]]
    errors = _interpreted(_MIXES, json.dumps(shapes))
    assert len(errors) == 3 * len(shapes)
    assert max(errors) < 1e-5, errors


def test_expert_swiglu_kernels_match_the_grouped_gemm_reference():
    # FP16 operands: Triton 3.9's interpreter multiplies BF16 tiles wrongly (a BF16 tl.dot there is off by
    # 1e10), the kernels are dtype-generic and their BF16 build is checked on the H200 (test_ops_nvidia).
    # One token; column counts that are not multiples of the column blocks and a hidden size that is not one
    # of BLOCK_K; experts with no pairs; more rows per expert than one 16-row tile; both weight orders
    shapes = [[1, 2, 4, 64, 48, True], [5, 3, 6, 40, 200, False], [40, 2, 3, 32, 128, True]]
    errors = _interpreted(_EXPERTS, json.dumps(shapes))
    assert len(errors) == len(shapes)
    assert max(errors) < 1e-4, errors


def test_pair_sort_kernel_is_torchs_stable_sort():
    # one pair; a decode batch's pairs; experts that get none; many ties; the largest one-program tile; an
    # expert id outside the table (left out)
    cases = [[1, 4, False], [6, 16, False], [48, 16, False], [200, 7, False], [256, 256, False], [9, 3, True]]
    assert _interpreted(_SORT, json.dumps(cases)) == [True] * len(cases)

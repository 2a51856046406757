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

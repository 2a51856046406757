"""Section 1: held-out loss and perplexity of the served model, a unigram baseline, a long-range ablation.

What is measured (nats per token, natural log):

* `heldout`: `count` windows of `window` tokens spread evenly over `heldout.npy` (the recipe's held-out
  rule). Each window is one forward of the model as the engine loads and runs it
  (`deepinfer_model.load_model(path, float32)`, the engine's default dtype, in the current
  `DEEPINFER_NUMERICS`, default `exact`); the loss is the mean of -log p(x_t | x_<t) over every target
  t = 1 .. window - 1 of every window. `ppl` = exp(loss). The same targets are also averaged by the
  target's position in its window (`pos_A_B`: targets with A <= t < B tokens of context).
* `unigram`: add-one smoothed token frequencies of `train.npy`, p(v) = (count(v) + 1) / (N + V), their
  cross-entropy on exactly the same targets (float64).
* `long_range`: the last `tail` targets of each window, predicted (a) with the whole window before them
  (`full_context`, from the forward above) and (b) from a forward over the window's last `cut` tokens
  only (`cut_context`), so each target sees between `cut - tail` and `cut - 1` tokens. `cut - tail` is
  at least the sliding window: every target keeps all of its sliding-window keys, and what the cut takes
  away is the context beyond `cut` tokens, which only the compressed / sparse attention layers (and
  the stacked windows' receptive field) reach. `gain` = cut loss - full loss: > 0 when the model uses
  that far context.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from card_common import Records, evenly_spaced_windows, ppl, token_nll
from tqdm import tqdm


def unigram_nll(train: np.ndarray, targets: np.ndarray, vocab: int) -> np.ndarray:
    """-log p(target) per target under add-one smoothed frequencies of `train` (float64)."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab).astype(np.float64)
    if counts.size > vocab:
        raise ValueError(f"train.npy holds token ids >= vocab_size {vocab}")
    logp = np.log(counts + 1.0) - np.log(train.size + vocab)
    return -logp[targets]


def position_buckets(window: int, sliding_window: int) -> list[tuple[int, int]]:
    """[A, B) ranges of target positions: within one sliding window, up to 1k, beyond 1k (those that exist)."""
    edges = sorted({1, sliding_window, 1024, window})
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b <= window and a < window]


def plan(counts: dict, text_config: dict) -> tuple[int, int, int]:
    """(window, tail, cut): the window capped at the model's context, tail a quarter of it unless given,
    cut = tail + the sliding window unless given."""
    window = min(counts["window"], text_config["max_position_embeddings"])
    tail = counts["tail"] or window // 4
    cut = counts["cut"] or tail + text_config["sliding_window"]
    if not 0 < tail < cut < window:
        raise ValueError(f"long-range ablation needs 0 < tail ({tail}) < cut ({cut}) < window ({window})")
    if cut - tail < text_config["sliding_window"]:
        raise ValueError(
            f"cut - tail ({cut - tail}) must be >= the sliding window ({text_config['sliding_window']})"
        )
    return window, tail, cut


def windows_only(data: Path, counts: dict, text_config: dict) -> dict:
    """The held-out windows of `run` without measuring them (the quantisation section alone)."""
    window, _, _ = plan(counts, text_config)
    held = np.load(data / "heldout.npy", mmap_mode="r")
    return {"windows": evenly_spaced_windows(held, window, counts["windows"]), "window_loss": None}


def run(model, data: Path, records: Records, counts: dict, text_config: dict) -> dict:
    """Fill the section's records; returns the windows and their losses for the quantisation section."""
    window, tail, cut = plan(counts, text_config)
    held = np.load(data / "heldout.npy", mmap_mode="r")
    windows = evenly_spaced_windows(held, window, counts["windows"])
    full, tails_full, tails_cut = [], [], []
    for w in tqdm(windows, desc="held-out windows", unit="window"):
        nll = token_nll(model, w)
        full.append(nll)
        tails_full.append(nll[-tail:])
        tails_cut.append(token_nll(model, w[-cut:])[-tail:])
    full_all = np.concatenate(full)
    targets = np.concatenate([w[1:] for w in windows])
    train = np.load(data / "train.npy", mmap_mode="r")
    uni = unigram_nll(train, targets, text_config["vocab_size"])
    loss = float(full_all.mean())
    common = {"windows": len(windows), "window_tokens": window, "targets": int(full_all.size)}
    records.add("heldout", variant="model", **common, loss_nats_per_token=loss, ppl=ppl(loss))
    records.add(
        "heldout",
        variant="unigram",
        **common,
        train_tokens=int(train.size),
        loss_nats_per_token=float(uni.mean()),
        ppl=ppl(float(uni.mean())),
    )
    by_pos = np.stack(full)  # [windows, window - 1]; column j is target position j + 1
    for a, b in position_buckets(window, text_config["sliding_window"]):
        part = by_pos[:, a - 1 : b - 1]
        records.add(
            "heldout_by_position",
            variant="model",
            position_from=a,
            position_to=b,
            targets=int(part.size),
            loss_nats_per_token=float(part.mean()),
        )
    lf, lc = float(np.concatenate(tails_full).mean()), float(np.concatenate(tails_cut).mean())
    records.add(
        "long_range",
        variant="model",
        windows=len(windows),
        window_tokens=window,
        tail_tokens=tail,
        cut_context_tokens=cut,
        full_context_loss_nats_per_token=lf,
        cut_context_loss_nats_per_token=lc,
        gain_nats_per_token=lc - lf,
        full_context_ppl=ppl(lf),
        cut_context_ppl=ppl(lc),
    )
    return {"windows": windows, "window_loss": [float(x.mean()) for x in full]}

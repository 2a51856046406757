"""A drafted block after each listed sequence of a paged step, from the `draft_main.*` pools."""

from __future__ import annotations

import numpy as np
import torch

from ....runtime.metadata import StepMetadata
from ....runtime.pools import PagedKVCache
from ..drafter import DraftOutput, Sampler, draft_blocks, greedy
from ..drafter_heads import confidence_temperatures
from ..model import DeepseekV41ForCausalLM


def v41_paged_draft(
    model: DeepseekV41ForCausalLM,
    meta: StepMetadata,
    cache: PagedKVCache,
    seqs: list[int],
    next_tokens: list[int],
    num_draft_tokens: int,
    sampler: Sampler | list[Sampler] = greedy,
    last_positions: list[int] | None = None,
) -> list[DraftOutput]:
    """One drafted block after the last position of each listed sequence of the step `meta` describes
    (which must have run), or after `last_positions[k]` (a position of that step or before it: the last
    accepted one of a verification step), starting from the token the target produced there; the
    drafter's main keys come from the `draft_main.*` pools (the last `sliding_window` positions). All
    sequences draft in one batched forward (`draft_blocks`); `sampler` is one per sequence or shared."""
    cfg, w = model.config, model.weights
    if w.drafter is None:
        raise ValueError(
            "num_draft_tokens > 0 needs a checkpoint with draft blocks (num_nextn_predict_layers > 0)"
        )
    if not 1 <= num_draft_tokens <= 32:
        raise ValueError(f"num_draft_tokens = {num_draft_tokens} must lie in [1, 32]")
    seq_arr = np.asarray(seqs, dtype=np.int64).reshape(-1)
    last = draft_last_positions(model, meta, seq_arr, next_tokens, last_positions)
    if not len(seq_arr):
        return []
    slots = meta.dev(draft_window_slots(meta, seq_arr, last, cfg.sliding_window))
    windows = torch.stack([cache.read(f"draft_main.{b}", slots) for b in range(len(w.drafter.blocks))])
    return draft_blocks(
        cfg,
        w.drafter,
        w.embed,
        w.head,
        windows,
        [int(g) for g in next_tokens],
        last.tolist(),
        num_draft_tokens,
        sampler,
        confidence_temperatures(num_draft_tokens),
        model.act_dtype,
        model.kvq,
        getattr(model, "draft_moe_fn", None),
    )


def draft_last_positions(
    model: DeepseekV41ForCausalLM,
    meta: StepMetadata,
    seqs: np.ndarray,
    next_tokens,
    last_positions=None,
) -> np.ndarray:
    """The position each listed sequence of the step `meta` drafts after (its last position, or
    `last_positions[k]`), validated with the next tokens (host ints)."""
    cfg = model.config
    last = meta.ends[seqs].astype(np.int64) - 1
    for k, g in enumerate(next_tokens):
        if not 0 <= g < cfg.vocab_size:
            raise ValueError(f"next_token = {g} must lie in [0, vocab_size={cfg.vocab_size})")
        if last_positions is not None:
            if not 0 <= last_positions[k] <= last[k]:
                raise ValueError(f"last_positions[{k}] = {last_positions[k]} must lie in [0, {last[k]}]")
            last[k] = last_positions[k]
    return last


def draft_window_slots(
    meta: StepMetadata, seqs: np.ndarray, last: np.ndarray, window: int, width: int | None = None
) -> np.ndarray:
    """Cache slots [N, width] (host) of each sequence's window of main keys in columns 0 .. L - 1
    (positions lo .. last, L = min(last + 1, window)); the columns past a shorter window re-read its
    last key (finite, never visible: the drafter masks them). `width`: default the longest L."""
    lo = np.maximum(last - window + 1, 0)
    width = int((last - lo).max()) + 1 if width is None else width
    pos = np.minimum(lo[:, None] + np.arange(width)[None, :], last[:, None])
    return meta.token_slots_of(seqs[:, None], pos)

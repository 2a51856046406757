"""vLLM's logits processors: allowed token ids, bad words, logit bias, presence / frequency /
repetition penalties.

Each is a pure function of the row's parameters and of the tokens the row has seen
(`RowParams.prompt_token_ids` / `output_token_ids`), so a row is processed the same whatever its
batch mates, whichever loop built it, and whether the tokens before it are committed or drafts being
verified (the verifier's row j sees drafts 1..j as output, as plain decoding does once they are
accepted).

Order, vLLM's: allowed ids, bad words, logit bias, then the penalties — repetition over prompt +
output (a positive logit is divided by the penalty, any other multiplied), frequency (penalty times
the token's count) and presence (once per token) over the output only. Masked logits (-inf) stay
masked through all of them, so the order against the ban and grammar masks does not matter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..runtime.device import to_device
from .params import RowParams


def bad_word_bans(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens banned next: the last token of each bad word whose earlier tokens end the output
    (a one-token bad word is always banned)."""
    out = []
    n = len(output_token_ids)
    for word in bad_words:
        head = len(word) - 1
        if head <= n and tuple(output_token_ids[n - head :]) == tuple(word[:-1]):
            out.append(word[-1])
    return out


def _check_ids(name: str, ids, vocab: int) -> None:
    if ids and max(ids) >= vocab:
        raise ValueError(f"{name} must be token ids in [0, {vocab}), got {max(ids)}")


def process_logits_(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Apply each row's processors to `logits` [len(rows), V] in place (any float dtype, any device);
    rows without processors are not touched. Returns `logits`."""
    vocab = logits.shape[-1]
    dev = logits.device
    allowed_rows, allowed_r, allowed_t = [], [], []
    ban_r, ban_t = [], []
    bias_r, bias_t, bias_v = [], [], []
    rep_r, rep_t, rep_v = [], [], []
    add_r, add_t, freq_v, pres_v = [], [], [], []
    for i, row in enumerate(rows):
        if not row.processed:
            continue
        if row.allowed_token_ids is not None:
            _check_ids("allowed_token_ids", row.allowed_token_ids, vocab)
            allowed_r.extend([len(allowed_rows)] * len(row.allowed_token_ids))
            allowed_t.extend(row.allowed_token_ids)
            allowed_rows.append(i)
        if row.bad_words:
            bans = bad_word_bans(row.bad_words, row.output_token_ids)
            _check_ids("bad_words", bans, vocab)
            ban_r.extend([i] * len(bans))
            ban_t.extend(bans)
        if row.logit_bias:
            ids = [t for t, _ in row.logit_bias]
            _check_ids("logit_bias", ids, vocab)
            bias_r.extend([i] * len(ids))
            bias_t.extend(ids)
            bias_v.extend(b for _, b in row.logit_bias)
        if row.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(row.prompt_token_ids + row.output_token_ids, dtype=np.int64))
            _check_ids("seen tokens", seen.tolist(), vocab)
            rep_r.extend([i] * len(seen))
            rep_t.extend(seen.tolist())
            rep_v.extend([row.repetition_penalty] * len(seen))
        if row.frequency_penalty != 0.0 or row.presence_penalty != 0.0:
            ids, counts = np.unique(np.asarray(row.output_token_ids, dtype=np.int64), return_counts=True)
            _check_ids("output tokens", ids.tolist(), vocab)
            add_r.extend([i] * len(ids))
            add_t.extend(ids.tolist())
            freq_v.extend((row.frequency_penalty * counts).tolist())
            pres_v.extend([row.presence_penalty] * len(ids))

    def idx(values) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), dev)

    def vals(values) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.float32), dev).to(logits.dtype)

    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool, device=dev)
        keep[idx(allowed_r), idx(allowed_t)] = True
        at = idx(allowed_rows)
        logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(~keep, float("-inf")))
    if ban_r:
        logits[idx(ban_r), idx(ban_t)] = float("-inf")
    if bias_r:
        at = (idx(bias_r), idx(bias_t))
        logits[at] = logits[at] + vals(bias_v)
    if rep_r:
        at, penalty = (idx(rep_r), idx(rep_t)), vals(rep_v)
        x = logits[at]
        logits[at] = torch.where(x > 0, x / penalty, x * penalty)
    if add_r:
        at = (idx(add_r), idx(add_t))
        logits[at] = logits[at] - vals(freq_v) - vals(pres_v)
    return logits

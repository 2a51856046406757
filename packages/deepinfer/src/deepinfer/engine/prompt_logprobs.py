"""Prompt logprobs (`SamplingParams.prompt_logprobs`) from the prefill's own logits.

A prefill chunk of such a request asks the runner for the logits of every row (`logits_lens` = the
chunk's length): row j, at position p, gives the distribution of the prompt token at p + 1. The rows
are reduced on the device (log-softmax, the prompt token's logprob and rank, the top alternatives)
right after the forward, so the runner may reuse its logits buffer, and read back with the step's
tokens. Requests that ask for them take a prefix-cache namespace of their own (`request_table.py`):
a cached prefix would be skipped by the forward and its rows never computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from deepinfer_model import to_device

_ROWS_PER_PASS = 512  # bounds the float32 [rows, vocab] log-softmax held at once


@dataclass
class PromptTargets:
    """What one sequence's prefill chunk scores: its rows 0 .. len(token_ids) - 1 predict these
    prompt tokens, the first at position `first_position`; `k` alternatives per row."""

    first_position: int
    token_ids: list[int]
    k: int


@dataclass
class PromptRows:
    """The scored rows of one chunk, on the host."""

    first_position: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 + tokens more likely than the prompt's own
    top: list[dict[int, float]]  # the k most likely, most likely first


def set_prompt_rows(batch, seq_index: int, targets: PromptTargets) -> None:
    """Ask the runner for every row of this sequence's chunk."""
    batch.logits_lens[seq_index] = int(batch.query_lens[seq_index])


class PendingPromptRows:
    """The device-side reduction of one step's prompt rows, until `read` copies it back."""

    def __init__(self, logits: torch.Tensor, spans: list[tuple[int, int, PromptTargets]]) -> None:
        """spans: (sequence index, its first row in `logits`, targets)."""
        self.spans = spans
        dev = logits.device
        rows = np.concatenate([np.arange(lo, lo + len(t.token_ids)) for _, lo, t in spans])
        tokens = np.concatenate([np.asarray(t.token_ids, dtype=np.int64) for _, _, t in spans])
        self.k = max(t.k for _, _, t in spans)
        chosen, above, vals, ids = [], [], [], []
        for a in range(0, len(rows), _ROWS_PER_PASS):
            r = to_device(rows[a : a + _ROWS_PER_PASS], dev, torch.int64)
            # (an image sentinel id, past the vocabulary, is scored as the last id: its row is dropped)
            t = to_device(np.minimum(tokens[a : a + _ROWS_PER_PASS], logits.shape[-1] - 1), dev, torch.int64)
            lp = torch.log_softmax(logits[r].float(), dim=-1)
            c = lp.gather(1, t[:, None])
            chosen.append(c.squeeze(1))
            above.append((lp > c).sum(-1).to(lp.dtype))  # exact in float32 (vocabularies < 2**24)
            if self.k:
                v, i = torch.topk(lp, min(self.k, lp.shape[-1]), dim=-1)
                vals.append(v)
                ids.append(i)
        self.chosen, self.above = torch.cat(chosen), torch.cat(above)
        self.vals = torch.cat(vals) if vals else None
        self.ids = torch.cat(ids) if ids else None

    def read(self) -> dict[int, PromptRows]:
        chosen, above = self.chosen.tolist(), self.above.tolist()
        vals = self.vals.tolist() if self.vals is not None else None
        ids = self.ids.tolist() if self.ids is not None else None
        out, at = {}, 0
        for i, _, t in self.spans:
            m = len(t.token_ids)
            top = [dict(zip(ids[at + j][: t.k], vals[at + j][: t.k])) if t.k else {} for j in range(m)]
            out[i] = PromptRows(
                t.first_position,
                t.token_ids,
                chosen[at : at + m],
                [int(a) + 1 for a in above[at : at + m]],
                top,
            )
            at += m
        return out

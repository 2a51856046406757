"""Sampled drafts inside the graph-safe draft: each row's sampling as int64 columns of the draft graphs'
staged inputs, and the row sampler that draws from them on the device.

The eager draft's sampler (the engine's `DraftRowSampler`) reads the requests' parameters on the host
at every draft step; a CUDA graph cannot. Here the same values travel as columns of the one int64 row a
drafting sequence already sends (`draft_graphs.DraftGraphRunner`): whether the row samples, its
float32 temperature / top-p / min-p (stored as the float64 that holds them exactly, as bit patterns),
its top-k (the vocabulary when off) and its draft stream's key (seed bits and the stream position of
draft step 0). `StaticDraftSampler` turns the columns into device tensors once per draft and draws
draft s of every row with the eager sampler's math: the uniforms of `stream_uniforms_tensor` at
position + s, `filter_probs` (the transform of `filtered_probs`) on the FP32 logits, NaN zeroed, q
widened to float64, `inverse_cdf`; greedy rows take the argmax. The filter passes are row-wise, so a
row's q and token are those the eager sampler computes for it (bitwise on the CPU, tested).

Two choices keep the graph free of value-dependent branches: the min-p pass runs for every row (a row
with min-p 0 comes out unchanged: the threshold is 0; NaN probabilities, zeroed anyway, become zeros
one pass earlier), and the top-p / top-k sort, which costs a sort of every row over the vocabulary,
is part of the graph only when a sampled row asks for it: `DraftSampling.needs_sort` picks which of
the two graphs of a bucket replays (a row that does not ask for it comes out of the sort pass
unchanged, as in the eager sampler, which also sorts every row when one asks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from deepinfer_spec import Purpose, inverse_cdf, stream_uniforms_tensor

from ..sampling.params import RowParams

# (`sampling.transform` imports `runtime.device`, whose package imports this module: the filters are
# imported where they are used, so that either package may be imported first)

# the sampling columns of one drafting row, in this order
SAMPLED, TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED, POSITION = range(7)
NUM_COLUMNS = 7


def _float_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as the int64 bit patterns of the float64 that holds each exactly."""
    return values.astype(np.float64).view(np.int64)


@dataclass(frozen=True)
class DraftSampling:
    """How each row of a draft batch draws its drafts, for the graph-safe draft: `params` per row (a
    greedy row takes the argmax; no row may have logits processors, which read the drafts so far on
    the host), `seeds` the int64 bit patterns of each row's draft stream seed (`int64_bits`) and
    `positions` the stream position of its draft step 0 (`draft_position(base, accepted, 0)`); a
    greedy row's seed and position are not read."""

    params: tuple[RowParams, ...]
    seeds: np.ndarray
    positions: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.params)
        if np.shape(self.seeds) != (n,) or np.shape(self.positions) != (n,):
            raise ValueError(
                f"DraftSampling: seeds {np.shape(self.seeds)} and positions {np.shape(self.positions)} "
                f"must hold one entry per row ({n})"
            )
        processed = [i for i, p in enumerate(self.params) if p.processed]
        if processed:
            raise ValueError(
                f"DraftSampling: rows {processed} have logits processors, which the graph-safe draft "
                "cannot apply (they read the drafts so far on the host)"
            )

    @property
    def sampled(self) -> np.ndarray:
        return np.array([not p.greedy for p in self.params], dtype=bool)

    def needs_sort(self, vocab: int) -> bool:
        """Whether a sampled row filters by top-p or top-k (the eager sampler filters its sampled rows
        alone, with this condition for sorting)."""
        from ..sampling.transform import needs_sort

        return needs_sort([p for p in self.params if not p.greedy], vocab)

    def columns(self, vocab: int) -> np.ndarray:
        """int64 [rows, NUM_COLUMNS]: the rows' sampling columns."""
        from ..sampling.transform import filter_values

        temps, top_p, top_k, min_p = filter_values(list(self.params), vocab)
        out = np.empty((len(self.params), NUM_COLUMNS), dtype=np.int64)
        out[:, SAMPLED] = self.sampled
        out[:, TEMPERATURE] = _float_bits(temps)
        out[:, TOP_P] = _float_bits(top_p)
        out[:, TOP_K] = top_k
        out[:, MIN_P] = _float_bits(min_p)
        out[:, SEED] = np.asarray(self.seeds, dtype=np.int64)
        out[:, POSITION] = np.asarray(self.positions, dtype=np.int64)
        return out


def placeholder_columns(vocab: int) -> np.ndarray:
    """int64 [NUM_COLUMNS]: a greedy row without filters (padding rows and greedy drafts)."""
    row = np.zeros(NUM_COLUMNS, dtype=np.int64)
    row[[TEMPERATURE, TOP_P]] = _float_bits(np.ones(2, dtype=np.float32))
    row[TOP_K] = vocab
    return row


class StaticDraftSampler:
    """The draft rows' sampler on their sampling columns (device int64 [N, NUM_COLUMNS]), without a
    host sync: `pick_rows(logits [N, V], s)` -> long [N], draft s of every row, writing q of step s
    into `q[:, s]` (float64 [N, k, V], every row's: a greedy row's is its unfiltered softmax, unread)
    and reusing `cdf` (float64 [N, V]) for the cumulative weights. `sort`: run the top-p / top-k
    pass (`DraftSampling.needs_sort`)."""

    def __init__(self, columns: torch.Tensor, q: torch.Tensor, cdf: torch.Tensor, sort: bool) -> None:
        self.num_rows, k, self.vocab = q.shape
        self.q, self.cdf, self.sort = q, cdf, sort
        self.sampled = columns[:, SAMPLED] != 0
        self.temps = columns[:, TEMPERATURE].view(torch.float64).to(torch.float32)
        self.top_p = columns[:, TOP_P].view(torch.float64).to(torch.float32)
        self.top_k = columns[:, TOP_K]
        self.min_p = columns[:, MIN_P].view(torch.float64).to(torch.float32)
        later = torch.arange(k, dtype=torch.long, device=columns.device)
        # [k, N]: row s holds every row's uniform of draft step s (the eager sampler's keys)
        seeds, first = columns[:, SEED], columns[:, POSITION]
        self.uniforms = stream_uniforms_tensor(
            seeds[None, :].expand(k, -1), first[None, :] + later[:, None], Purpose.SAMPLE
        )

    def pick_rows(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        if logits.shape != (self.num_rows, self.vocab):
            raise ValueError(
                f"StaticDraftSampler: logits {tuple(logits.shape)} must be [{self.num_rows}, {self.vocab}]"
            )
        from ..sampling.transform import filter_probs

        probs = filter_probs(
            logits.float(),
            self.temps,
            self.top_p if self.sort else None,
            self.top_k if self.sort else None,
            self.min_p,
        ).nan_to_num_(nan=0.0)
        q = self.q[:, step]
        q.copy_(probs)
        drawn = inverse_cdf(q, self.uniforms[step], cdf=self.cdf)
        return torch.where(self.sampled, drawn, torch.argmax(logits, dim=-1))  # first maximum = lowest id

    __call__ = pick_rows

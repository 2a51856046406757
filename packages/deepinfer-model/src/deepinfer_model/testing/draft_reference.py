"""A draft row sampler written from the definitions, for tests of the graph-safe sampled draft."""

from __future__ import annotations

import numpy as np
import torch
from deepinfer_spec import Purpose, int64_bits, inverse_cdf, stream_uniform

from ..runtime.draft_sampling import DraftSampling
from ..sampling import filtered_probs


class PerRowDraftReference:
    """A draft row sampler written from the definitions, one row at a time: greedy rows take the argmax,
    sampled rows draw by inverse CDF from `filtered_probs` of their own row (NaN zeroed, widened to
    float64) with the uniform of their stream at position + draft step; it keeps each row's q. It also
    describes itself to the sampled draft graph (`static_sampling`), which then draws in its place."""

    def __init__(self, params, seeds, positions, describe=True):
        self.params, self.seeds, self.positions = list(params), list(seeds), list(positions)
        self.num_rows = len(self.params)
        self.q = [[] for _ in self.params]
        self.describe = describe

    def pick_rows(self, logits, step):
        out = []
        for r, p in enumerate(self.params):
            if p.greedy:
                out.append(torch.argmax(logits[r]))
                continue
            q = filtered_probs(logits[r][None].float(), [p]).nan_to_num_(nan=0.0)[0].double()
            u = stream_uniform(self.seeds[r], self.positions[r] + step, Purpose.SAMPLE)
            out.append(inverse_cdf(q[None], torch.tensor([u], dtype=torch.float64, device=q.device))[0])
            self.q[r].append(q)
        return torch.stack(out)

    def static_sampling(self):
        if not self.describe:
            return None
        return DraftSampling(
            tuple(self.params), int64_bits(self.seeds), np.asarray(self.positions, dtype=np.int64)
        )

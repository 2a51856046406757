"""Context-parallel prefill of one sequence with the balanced mirror split (engine spec §7.2).

Rank `r` of the CP group keeps pieces `r` and `2·cp−1−r` of the sequence between attention layers, so
the per-token work (mHC, Engram, MoE) is split evenly; each attention layer computes queries, sparse
selections and outputs for its own rows only, and all-gathers (in sequence order) the keys every query
needs: the SWA latents it projected from its rows on every layer, the layer input on producer-half KV
sources (a compression window may straddle two ranks' pieces), and the YOCO shared hidden once. Every computation is per row in FP64 with one rounding, so the result is bitwise equal
to the single-process forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_parallel import all_gather_restore, mirror_split_plan

from ..models.deepseek_v41.model import DeepseekV41ForCausalLM, V41Output


class MirrorRows:
    """`RowSplit` of one sequence of `seq_len` tokens over the CP `group` (mirror split)."""

    def __init__(self, seq_len: int, group: dist.ProcessGroup | None = None):
        self.group = group
        self.plan = mirror_split_plan([seq_len], dist.get_world_size(group), dist.get_rank(group))
        # Attention queries of this rank's rows; a padding row repeats row 0 (gather drops its output).
        self.query_rows = self.plan.index.clamp(min=0)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        out = full[self.plan.index.clamp(min=0)].clone()
        out[~self.plan.valid] = 0  # padding rows of the last piece
        return out

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return all_gather_restore(local, self.plan, self.group)


def cp_prefill(
    model: DeepseekV41ForCausalLM, token_ids, group: dist.ProcessGroup | None = None, **forward_kwargs
) -> V41Output:
    """`model.forward(token_ids, ...)` computed by every rank of the CP `group` together; each returns
    the full output (collective: every CP rank calls it with the same `token_ids`)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("token_ids must hold at least one token")
    return model.forward(token_ids, row_split=MirrorRows(n, group), **forward_kwargs)

"""The shifted mHC schedule around one decoder block, and the V4.1 MoE FFN (spec v41-model §3.3, §6)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...layers.mhc import HCParams, expand
from ...layers.moe import moe_block
from ...numerics import carrier
from ...ops.model_calls import hc_mixes_read, hc_read, hc_write, rms_norm
from .config import DeepseekV41Config
from .weights import BlockWeights


class ShiftedHC:
    """Trunk `R` [T, m, H] and the pending pre mix: each sub-layer reads with the previous one's `pre`.

    The first read is one-hot on stream 0 (i.e. exactly the embedding); `final()` applies the last
    sub-layer's pre mix.

    Every sub-layer's write rounds the trunk to the act dtype; where `numerics.narrow_act` (native mode,
    16-bit activations) the trunk is then held in that dtype (the same values, half the bytes of the
    FP32 carrier: the widening copy after each write and the reads of the next mixes / read / write were
    ~12 of a 16k-token medium prefill step's 279 ms on the H200). The read feeding the norm stays narrow
    too, and so does the norm's output, the sub-layer input `fn` gets: every consumer of it multiplies
    act-dtype operands (`numerics.linear` / `logits`, the router's `layers.router.router_logits`, the
    experts' GEMMs), widens it itself (the `hidden.L` pool write, the torch expert-parallel dispatch rows,
    the FP8 experts' op input) or only passes it on (YOCO's shared hidden S, context parallelism's
    gathers). The values are those of the FP32 copy this saves ([T, H] per sub-layer; a 16k-token medium
    prefill spent 2.4 ms in them on the H200), and each GEMM no longer narrows a copy of it again. Exact
    mode and FP32 activations keep the carrier throughout.
    """

    def __init__(self, x0: torch.Tensor, cfg: DeepseekV41Config):
        self.cfg = cfg
        m = cfg.hc_mult
        self.trunk = expand(x0, m)  # (the embedding's values: not necessarily act-dtype values)
        self.prev_pre = torch.zeros(x0.shape[0], m, dtype=carrier(), device=x0.device)
        self.prev_pre[:, 0] = 1.0

    def sublayer(
        self,
        params: HCParams,
        norm: torch.Tensor,
        fn: Callable[[torch.Tensor], torch.Tensor],
        act_dtype: torch.dtype,
    ) -> None:
        c = self.cfg
        # hot ops through the registry (ops.model_calls): the reference on CPU, kernels on CUDA
        # (the mixes of this sub-layer and its input under the previous pre mix: one pass over the trunk)
        pre, post, comb, read = hc_mixes_read(
            self.trunk,
            params,
            c.hc_eps,
            c.rms_norm_eps,
            c.hc_sinkhorn_iters,
            self.prev_pre,
            act_dtype,
            narrow=True,
        )
        y_in = rms_norm(read, norm, c.rms_norm_eps, act_dtype, narrow=True)
        self.prev_pre = pre
        self.trunk = hc_write(fn(y_in), self.trunk, post, comb, act_dtype, narrow=True)

    def final(self, act_dtype: torch.dtype) -> torch.Tensor:
        return hc_read(self.trunk, self.prev_pre, act_dtype)


def moe_ffn(
    cfg: DeepseekV41Config, w: BlockWeights, y: torch.Tensor, top_k: int, act_dtype: torch.dtype
) -> torch.Tensor:
    """The shared MoE block; V4.1 applies the routing weight before `w2` (§6.2)."""
    return moe_block(
        y, None, w.moe, top_k, cfg.routed_scaling_factor, cfg.swiglu_limit, act_dtype, weight_before_down=True
    )

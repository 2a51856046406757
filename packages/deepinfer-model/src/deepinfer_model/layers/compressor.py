"""KV compressor: gated per-channel softmax pooling of `ratio` tokens into one compressed entry.

Entry `j` pools tokens `j*r .. j*r+r-1` (and, with `overlap`, also the first half of the projection of
tokens `(j-1)*r .. j*r-1`: public V4's CSA windows of width 2r and stride r). The pooled vector is
RMS-normalised and rotated (RoPE on its tail) at position `j*r`. Only complete blocks produce entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import RopeSpec
from ..numerics import carrier, logits, round_to
from .norm import rms_norm
from .rope import apply_rope, cos_sin


@dataclass
class CompressorWeights:
    """`wkv`/`wgate` [w*D, H] (w = 2 with overlap), `norm` [D], `ape` [r, w*D] gate bias or None.

    `wgate=None` is only valid for ratio 1 (a softmax over one token is 1).
    """

    wkv: torch.Tensor
    wgate: torch.Tensor | None
    norm: torch.Tensor
    ape: torch.Tensor | None = None


@dataclass
class Compressed:
    """Entries of one sequence: `pre_rope` [n, D] (normed) and `keys` [n, D] (with RoPE), `positions` [n]."""

    pre_rope: torch.Tensor
    keys: torch.Tensor
    positions: torch.Tensor


def compress(
    x: torch.Tensor,
    w: CompressorWeights,
    ratio: int,
    overlap: bool,
    rope: RopeSpec,
    eps: float,
    start_position: int = 0,
    act_dtype: torch.dtype = torch.float32,
    prev_block: torch.Tensor | None = None,
) -> Compressed:
    """Compress a contiguous run of token hiddens `x` [T, H] starting at a block boundary `start_position`.

    With `overlap`, entry j also pools block j-1: when continuing a sequence (`start_position > 0`) pass
    the hiddens of the `ratio` tokens before `start_position` as `prev_block` [r, H].
    """
    if start_position % ratio:
        raise ValueError(f"start_position = {start_position} must be a multiple of the ratio {ratio}")
    if overlap and start_position:
        if prev_block is None or prev_block.shape[0] != ratio:
            raise ValueError(
                f"an overlapping compressor continuing at {start_position} needs prev_block [{ratio}, H]"
            )
        full = compress(torch.cat((prev_block, x)), w, ratio, overlap, rope, eps, 0, act_dtype)
        shift = torch.arange(full.keys.shape[0] - 1, device=x.device) * ratio + start_position
        cos, sin = cos_sin(rope, shift)
        keys = round_to(apply_rope(full.pre_rope[1:], cos, sin), act_dtype)
        return Compressed(pre_rope=full.pre_rope[1:], keys=keys, positions=shift)
    n = x.shape[0] // ratio
    d = w.norm.shape[0]
    x = x[: n * ratio]
    # The projections keep FP32 outputs (pooling inputs): products of act-dtype operands, as `logits` (native:
    # a BF16 tensor-core GEMM with an FP32 output; x holds act-dtype values, so narrowing it loses nothing)
    kv = logits(x, w.wkv, act_dtype).to(carrier()).view(n, ratio, w.wkv.shape[0])
    if w.wgate is None:
        if ratio != 1:
            raise ValueError(f"a compressor without wgate needs ratio 1, got {ratio}")
        gate = torch.zeros_like(kv)
    else:
        gate = logits(x, w.wgate, act_dtype).to(carrier()).view(n, ratio, w.wgate.shape[0])
    if w.ape is not None:
        gate = gate + w.ape.to(carrier())
    if overlap:
        # slots [0, r): first-half channels of the previous block; slots [r, 2r): second half of this block
        prev_kv = kv.new_zeros(n, ratio, d)
        prev_gate = kv.new_full((n, ratio, d), float("-inf"))
        prev_kv[1:], prev_gate[1:] = kv[:-1, :, :d], gate[:-1, :, :d]
        kv = torch.cat((prev_kv, kv[..., d:]), dim=1)
        gate = torch.cat((prev_gate, gate[..., d:]), dim=1)
    pooled = round_to((kv * torch.softmax(gate, dim=1)).sum(dim=1), act_dtype)
    pre_rope = rms_norm(pooled, w.norm, eps, act_dtype)
    positions = start_position + torch.arange(n, device=x.device) * ratio
    cos, sin = cos_sin(rope, positions)
    keys = round_to(apply_rope(pre_rope, cos, sin), act_dtype)
    return Compressed(pre_rope=pre_rope, keys=keys, positions=positions)

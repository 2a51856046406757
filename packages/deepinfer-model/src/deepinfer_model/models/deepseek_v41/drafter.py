"""DSpark / DFlash drafter (spec v41-model §7.2–§7.4): main-token KV, block-parallel draft forward, heads.

After a target forward, the drafter's blocks get one "main" key per processed token, projected from
the target-layer features. A draft step then embeds `[g, noise, ..., noise]` (g = the token the
target just produced), runs the draft blocks (SWA-only; every row sees the last `W` main keys plus all
draft keys of the block: bidirectional inside the block) and turns the final hidden into per-position
logits with a Markov correction on the previous draft token, plus a confidence per position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...layers.attention import project_latent, project_output, project_query, sink_attention
from ...layers.norm import rms_norm
from ...layers.rope import cos_sin
from ...numerics import carrier, linear, round_to
from ...numerics import logits as head_logits
from .blocks import ShiftedHC, moe_ffn
from .config import DeepseekV41Config
from .drafter_heads import confidence, markov_correction
from .kv_quant import EXACT_KV, KVQuant
from .weights import BlockWeights, DrafterWeights

# (fp32 logits [V], draft step) -> token id: an int, or a 0-d long tensor on the logits' device (which
# keeps the draft loop free of host syncs; `greedy` does that)
Sampler = Callable[[torch.Tensor, int], "int | torch.Tensor"]


@dataclass
class DraftOutput:
    """One drafted block: `tokens` [Bd], `logits` [Bd, V] FP32 (after the Markov correction),
    `confidence` [Bd] in (0, 1), `hidden` [Bd, H] (pre-norm final hidden), `positions` [Bd]."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor


def greedy(logits: torch.Tensor, step: int) -> torch.Tensor:
    """The argmax (lowest id on ties) as a 0-d long tensor on the logits' device (no host sync)."""
    return torch.argmax(logits)


def main_keys(
    cfg: DeepseekV41Config,
    w: DrafterWeights,
    features: torch.Tensor,
    positions: torch.Tensor,
    act_dtype: torch.dtype,
    kvq: KVQuant = EXACT_KV,
) -> torch.Tensor:
    """[Ld, T, D]: each draft block's key/value latent for every processed main token (§7.2)."""
    eps = cfg.rms_norm_eps
    m = rms_norm(linear(features, w.main_proj, act_dtype), w.main_norm, eps, act_dtype)
    cos, sin = cos_sin(cfg.main_rope(), positions)
    return torch.stack([kvq.swa(project_latent(m, blk.attn, cos, sin, eps, act_dtype)) for blk in w.blocks])


def draft_block(
    cfg: DeepseekV41Config,
    w: DrafterWeights,
    embed: torch.Tensor,
    head: torch.Tensor,
    keys_main: torch.Tensor,
    next_token: int,
    last_position: int,
    num_draft_tokens: int,
    sampler: Sampler = greedy,
    temperatures: torch.Tensor | float = 1.0,
    act_dtype: torch.dtype = torch.float32,
    kvq: KVQuant = EXACT_KV,
    moe_fn: Callable[[int, BlockWeights, torch.Tensor], torch.Tensor] | None = None,
) -> DraftOutput:
    """Draft `num_draft_tokens` tokens after `next_token` (at `last_position + 1`).

    `moe_fn(block_index, block, y)` replaces the draft blocks' MoE (e.g. expert parallel).

    `keys_main` [Ld, >= last_position + 1, D] are the main keys of positions 0..last_position (§7.2);
    each block attends to the last `W` of them plus the block's own draft keys.
    """
    ds, eps, W = cfg.dspark, cfg.rms_norm_eps, cfg.sliding_window
    a, bd = last_position, num_draft_tokens
    dev = embed.device
    positions = torch.arange(a + 1, a + 1 + bd, device=dev)
    tokens = torch.full((bd,), ds.noise_token_id, dtype=torch.long, device=dev)
    tokens[0] = next_token
    cos, sin = cos_sin(cfg.main_rope(), positions)
    window = keys_main[:, max(0, a - W + 1) : a + 1]
    hc = ShiftedHC(embed[tokens].to(carrier()), cfg)
    for i, blk in enumerate(w.blocks):

        def attention(y, blk=blk, i=i):
            q, _ = project_query(y, blk.attn, cfg.num_attention_heads, cos, sin, eps, False, act_dtype)
            kd = kvq.swa(project_latent(y, blk.attn, cos, sin, eps, act_dtype))  # FP8 ring, like main keys
            keys = torch.cat((window[i], kd), dim=0)
            visible = torch.ones(
                bd, keys.shape[0], dtype=torch.bool, device=dev
            )  # bidirectional in the block
            o = sink_attention(q, keys, visible, blk.attn.sinks, cfg.head_dim**-0.5, act_dtype)
            return project_output(round_to(o, act_dtype), blk.attn, cfg.o_groups, cos, sin, act_dtype)

        hc.sublayer(blk.hc_attn, blk.attn_norm, attention, act_dtype)
        hc.sublayer(
            blk.hc_ffn,
            blk.ffn_norm,
            (lambda y, blk=blk: moe_ffn(cfg, blk, y, ds.num_experts_per_tok, act_dtype))
            if moe_fn is None
            else (lambda y, blk=blk, i=i: moe_fn(i, blk, y)),
            act_dtype,
        )
    hidden = hc.final(act_dtype)
    # shared LM head (FP32 logits, in the carrier for the Markov correction)
    base = head_logits(rms_norm(hidden, w.norm, eps, act_dtype), head, act_dtype).to(carrier())
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=dev).expand(bd)
    out_tokens, out_logits, out_conf = [], [], []
    prev = tokens[:1]  # next_token, already on the device
    for s in range(bd):  # sequential only through the Markov term: the drafted token feeds the next step
        logits, e = markov_correction(base[s : s + 1], prev, w.markov, act_dtype)
        out_conf.append(confidence(hidden[s : s + 1], e, w.confidence_proj, temps[s]))
        tok = sampler(logits[0], s)
        # an int sampler (e.g. the engine's seeded one) costs one host-to-device copy per draft step;
        # a tensor sampler none
        prev = torch.as_tensor(tok, dtype=torch.long, device=dev).reshape(1)
        out_tokens.append(prev)
        out_logits.append(logits[0])
    return DraftOutput(
        tokens=torch.cat(out_tokens),
        logits=torch.stack(out_logits).float(),
        confidence=torch.cat(out_conf).float(),
        hidden=hidden,
        positions=positions,
    )

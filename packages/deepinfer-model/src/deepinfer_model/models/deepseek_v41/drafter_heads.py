"""DSpark drafter heads (spec v41-model §7.1, §7.4): target features, Markov correction, confidence.

The drafter predicts a block of tokens in parallel; two small heads make it sequential-aware and
self-assessing: a rank-`r` first-order Markov term adds `head · embed[previous token]` to each draft
position's logits, and a confidence head turns `[hidden ; markov embedding]` into the probability the
scheduler uses to decide how many drafts to verify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_cluster import envs

from ... import batch_invariant
from ...numerics import carrier, round_to, weight_carrier

_CONF_CLAMP = 60.0
_MIN_TEMPERATURE = 1e-5


@dataclass
class MarkovHead:
    """`embed` [V, rank] (previous token -> low-rank code) and `head` [V, rank] (code -> logit correction)."""

    embed: torch.Tensor
    head: torch.Tensor


def target_features(trunk: torch.Tensor, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Drafter feature of one target layer: the mean of the mHC streams at its attention input [T, H].
    (A BF16 trunk is read as it is, widened inside the reduction: no [T, m, H] carrier copy.)"""
    return round_to(trunk.mean(dim=1, dtype=carrier()), act_dtype)


def markov_correction(
    logits: torch.Tensor,
    prev_tokens: torch.Tensor,
    markov: MarkovHead,
    act_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits + head · embed[prev] in FP32 [S, V], the embeddings e [S, rank] in act_dtype)."""
    e = round_to(markov.embed[prev_tokens.long()], act_dtype)
    # (batch-invariant mode: the rows' bits do not depend on how many sequences draft together)
    correction = batch_invariant.matmul(e, weight_carrier(markov.head).t())
    return round_to(logits.to(carrier()) + correction, torch.float32), e


def confidence(
    hidden: torch.Tensor,
    markov_embed: torch.Tensor,
    proj: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Per-draft acceptance confidence [S] = sigmoid(clamp(proj · [h ; e] / T, ±60)); `proj` [1, H + rank]."""
    feats = torch.cat((hidden.to(carrier()), markov_embed.to(carrier())), dim=-1)
    if batch_invariant.enabled():  # a row-invariant GEMM (a GEMV's row bits may depend on the row count)
        z = batch_invariant.matmul(feats, weight_carrier(proj).reshape(1, -1).t())[:, 0]
    else:
        z = feats @ proj.to(carrier()).reshape(-1)
    temp = torch.as_tensor(temperature, dtype=carrier(), device=z.device).clamp(min=_MIN_TEMPERATURE)
    return round_to(torch.sigmoid((z / temp).clamp(-_CONF_CLAMP, _CONF_CLAMP)), torch.float32)


def confidence_temperatures(num_draft_tokens: int) -> torch.Tensor:
    """`DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE`: one float or exactly `num_draft_tokens` comma-separated
    values (one per draft step), each floored at 1e-5; default 1.0."""
    vals = list(envs.get("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"))
    if len(vals) == 1:
        vals = vals * num_draft_tokens
    if len(vals) != num_draft_tokens:
        raise ValueError(
            f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE = {','.join(map(str, vals))!r} must hold 1 or exactly "
            f"{num_draft_tokens} values (one per draft step)"
        )
    return torch.tensor(vals, dtype=torch.float32, device="cpu").clamp(min=_MIN_TEMPERATURE)

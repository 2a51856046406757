"""Engram injection (spec v41-model §5.4): hashed n-gram embeddings gated into the mHC streams.

At an Engram layer the trunk entering the attention sub-layer is updated per stream `i`:
`R[i] += g_i * v`, where `[k_0 .. k_{m-1} | v] = W_e · concat(table rows of the token's n-gram hashes)`
and `g_i` is a signed-sqrt sigmoid gate of the normalised dot product of `R[i]` and `k_i` weighted by
`q_weight[i] * k_weight[i]`. Image tokens (hash -1) leave the trunk unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...numerics import carrier, linear, round_to
from ...ops.model_calls import engram_gate
from .config import EngramConfig
from .engram_hash import EngramLayout, engram_hash, hash_multipliers
from .engram_vocab import CompressedVocabulary


@dataclass
class EngramWeights:
    """One Engram layer, dequantised: `table` [rows, d_e], `wkv` [(m+1)H, (N-1)·n_heads·d_e], `q/k_weight` [m, H]."""

    table: torch.Tensor
    wkv: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor


def engram_inject(
    trunk: torch.Tensor,
    rows: torch.Tensor,
    w: EngramWeights,
    eps: float,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Return the trunk [T, m, H] after the gated Engram update; `rows` [T, n_sub] are table row ids (-1: image).

    The gate and the update are one registry op (`engram_gate`, reference `layers.engram.engram_gate`). Where
    `numerics.narrow_act(act_dtype)` (native mode, 16-bit activations) the projection's output stays in the act
    dtype (no FP32 copy of the [T, (m+1)H] keys and values) and so does the new trunk when the trunk given is
    one (the same values as the carrier would hold)."""
    t, m, hidden = trunk.shape
    image = (rows < 0).any(dim=1)
    e = w.table[rows.clamp(min=0)].to(carrier()).reshape(t, -1)  # (native, FP32 table: no copy)
    kv = linear(e, w.wkv, act_dtype, narrow=True)
    k, v = kv[:, : m * hidden].view(t, m, hidden), kv[:, m * hidden :]
    # [m, H], formed in FP32
    qk = round_to(w.q_weight.to(carrier()) * w.k_weight.to(carrier()), torch.float32)
    return engram_gate(trunk, k, v, qk.float(), image, eps, act_dtype, narrow=True)


class EngramHasher:
    """Everything Engram needs before the layers run: vocabulary compression, layout and multipliers."""

    def __init__(
        self,
        cfg: EngramConfig,
        vocab: CompressedVocabulary,
        device: torch.device | str = "cpu",
        text_vocab_size: int | None = None,
    ):
        """The lookup tables (vocabulary map, row offsets, multipliers) are kept on `device`, the model's,
        so hashing runs where the token ids are. `text_vocab_size`: ids at or above it (the image sentinels,
        `vision/tokens.py`) compress to the image sentinel -1 even where the tokenizer is larger than the
        text model's vocabulary."""
        self.cfg = cfg
        table = vocab.table if text_vocab_size is None else vocab.table[:text_vocab_size]
        self.vocab = dataclasses.replace(vocab, table=table.to(device))
        layout = EngramLayout.from_config(cfg)
        self.layout = dataclasses.replace(layout, offsets=tuple(o.to(device) for o in layout.offsets))
        self.multipliers = {
            layer: hash_multipliers(layer, cfg.max_ngram_size, vocab.size).to(device)
            for layer in cfg.layer_ids
        }

    def rows(self, token_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Table row ids [T, (N-1)·n_heads] per Engram layer for one sequence of raw token ids."""
        comp = self.vocab.compress(token_ids)
        return {
            layer: engram_hash(comp, self.layout, layer, self.multipliers[layer], self.vocab.pad_id)
            for layer in self.cfg.layer_ids
        }

"""The base model's training objective: next-token loss, the lightning indexer's KL and MoE balance.

The indexer's scores only pick the top-k (an integer selection: no gradient reaches it from the next-token
loss). As DeepSeek trains its lightning indexer, each index-source layer's scores are fitted (KL) to the
main attention's distribution over the compressed entries, summed over heads and renormalised. Inputs
are detached so this loss trains the indexer alone (`wq_b`, `weights_proj`, `wk`, `k_norm`).

Routing is balanced without an auxiliary gradient (DeepSeek-V3's `noaux_tc`): after each step the selection
bias of an overloaded expert goes down and that of an underloaded one up by `bias_rate`. A small
sequence-level balance loss guards against a whole sequence collapsing onto few experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from deepinfer_model.training import (
    AttentionTrace,
    DeepseekV41Config,
    V41Weights,
    compressed_visible,
    cos_sin,
    index_keys,
    index_queries,
    index_scores,
    linear,
    moe_ffn,
    project_query,
    router_logits,
    sqrt_softplus,
)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position t predicting token t + 1."""
    return F.cross_entropy(logits[:-1].float(), ids[1:].to(logits.device))


def indexer_kl(
    cfg: DeepseekV41Config, w: V41Weights, traces: list[AttentionTrace], act_dtype: torch.dtype
) -> torch.Tensor:
    """Mean over index-source layers of KL(main attention over compressed entries || softmax(index scores)),
    averaged over the queries that see at least one compressed entry."""
    topo, eps = cfg.topology, cfg.rms_norm_eps
    rope = cfg.compress_rope()
    keys_of: dict[int, torch.Tensor] = {}  # index-K source layer -> its index keys (with their graph)
    losses = []
    for tr in traces:
        layer = tr.layer
        if not topo.is_index_source(layer):
            continue
        blk, comp = w.layers[layer], tr.compressed
        y = tr.y.detach()
        n = comp.keys.shape[0]
        positions = torch.arange(y.shape[0], device=y.device)
        cos, sin = cos_sin(rope, positions)
        valid = compressed_visible(positions, n, cfg.compress_ratios[layer])
        rows = slice(_first_seeing_row(y.shape[0], n, cfg.compress_ratios[layer]), None)
        if rows.start >= y.shape[0]:
            continue
        with torch.no_grad():
            q, q_lat = project_query(y, blk.attn, cfg.num_attention_heads, cos, sin, eps, False, act_dtype)
            s = torch.einsum("thd,nd->thn", q.float(), comp.keys.detach().float()) * cfg.head_dim**-0.5
            s = s.masked_fill(~valid[:, None, :], float("-inf"))
            target = torch.softmax(s[rows], dim=-1).sum(dim=1)
            target = target / target.sum(dim=-1, keepdim=True)
        if topo.is_index_k_source(layer):
            keys_of[layer] = index_keys(
                comp.pre_rope.detach(),
                comp.positions,
                blk.indexer.wk,
                blk.indexer.k_norm,
                rope,
                eps,
                act_dtype,
            )
        ik = keys_of[topo.index_k_source[layer]]
        qi = index_queries(q_lat.detach(), blk.indexer, cfg.index_n_heads, cos, sin, act_dtype)
        head_w = linear(y, blk.indexer.weights_proj, act_dtype)
        scores = index_scores(qi, ik, head_w, False, act_dtype).float()
        logp = torch.log_softmax(scores[rows].masked_fill(~valid[rows], float("-inf")), dim=-1)
        kl = target * (torch.log(target.clamp_min(1e-30)) - logp.masked_fill(~valid[rows], 0.0))
        losses.append(kl.sum(dim=-1).mean())
    if not losses:
        return torch.zeros((), device=w.embed.device)
    return torch.stack(losses).mean()


@functools.lru_cache(maxsize=64)
def _first_seeing_row(t: int, n: int, ratio: int) -> int:
    """The first of `t` query rows that sees a compressed entry: the rows that see one are a suffix (an
    entry, once complete, stays visible), found on the host so the device never reports back
    (`t` when there is none)."""
    rows = compressed_visible(torch.arange(t), n, ratio).any(dim=1)
    first = int(rows.int().argmax()) if bool(rows.any()) else t
    if not bool(rows[first:].all()):
        raise RuntimeError(f"the rows that see a compressed entry are not a suffix (t={t}, ratio={ratio})")
    return first


@dataclass
class BalancedMoE:
    """`moe_fn` for `DeepseekV41ForCausalLM`: the library's MoE, plus per-layer expert loads and the
    sequence-level balance loss of the forward it served."""

    cfg: DeepseekV41Config
    act_dtype: torch.dtype
    loads: dict[int, torch.Tensor] = field(default_factory=dict)
    balance_terms: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, layer: int, blk, y: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        out = moe_ffn(cfg, blk, y, cfg.num_experts_per_tok, self.act_dtype)
        if torch.is_grad_enabled():
            scores = sqrt_softplus(router_logits(y, blk.moe.gate, self.act_dtype)).float()  # [T, E]
            k, e = cfg.num_experts_per_tok, scores.shape[1]
            with torch.no_grad():
                chosen = torch.topk(scores + blk.moe.bias.float(), k, dim=-1).indices
                load = torch.bincount(chosen.reshape(-1), minlength=e).float()
            self.loads[layer] = self.loads.get(layer, 0) + load
            share = scores / scores.sum(dim=-1, keepdim=True)
            self.balance_terms.append((load * e / (k * y.shape[0]) * share.mean(dim=0)).sum())
        return out

    def balance_loss(self) -> torch.Tensor:
        terms, self.balance_terms = self.balance_terms, []
        return torch.stack(terms).mean() if terms else torch.zeros(())

    @torch.no_grad()
    def update_biases(self, masters: dict[str, torch.Tensor], rate: float) -> None:
        """Move each layer's selection bias toward equal loads (sign rule), then forget the loads."""
        for layer, load in self.loads.items():
            bias = masters[f"layers.{layer}.ffn.gate.bias"]
            bias += rate * torch.sign(load.mean() - load).to(bias.device)
        self.loads = {}

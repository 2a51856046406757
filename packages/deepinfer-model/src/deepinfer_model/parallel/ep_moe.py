"""Expert-parallel MoE for the V4.1 backbone (spec v41-model §6.5, engine §7.3).

Each EP rank holds `S = (E + X) / ep` physical expert slots (`RedundantExpertLayout.local_logical`);
the router runs locally on this rank's tokens, `deepinfer_parallel.dispatch_combine` sends each
(token, choice) row to the rank owning its replica, and the shared expert is added locally.

V4.1 scales the SwiGLU output by the routing weight *before* `w2` (§6.2), so the owning rank needs
each row's weight. The dispatched row therefore carries `[y | weights(k) | logical ids(k)]` in FP64
and the combine multiplies by 1.0: the expert picks the weight of the choice that names its logical
expert (top-k ids are distinct) and computes exactly what the single-process block computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_parallel import EplbState, RedundantExpertLayout, dispatch_combine

from ..layers.experts import ExpertWeights, clamped_swiglu, mlp
from ..layers.router import route_topk
from ..models.deepseek_v41.config import DeepseekV41Config
from ..models.deepseek_v41.weights import BlockWeights
from ..numerics import linear, round_to


class ExpertParallelMoE:
    """`moe_fn` for `DeepseekV41ForCausalLM`: the backbone MoE with routed experts sharded over EP.

    `blk.moe.experts` of every layer must hold this rank's slots only (`[S, ...]`, slot order), as
    `load_v41_ep` builds them or `shard_experts` cuts them; EPLB shuffles those tensors in place.
    """

    def __init__(
        self,
        config: DeepseekV41Config,
        layout: RedundantExpertLayout,
        group: dist.ProcessGroup | None = None,
        act_dtype: torch.dtype = torch.float32,
    ):
        if layout.num_logical != config.n_routed_experts:
            raise ValueError(
                f"layout has {layout.num_logical} logical experts, the config n_routed_experts = "
                f"{config.n_routed_experts}"
            )
        if layout.num_layers != config.num_hidden_layers:
            raise ValueError(
                f"layout has {layout.num_layers} layers, the config num_hidden_layers = {config.num_hidden_layers}"
            )
        self.config, self.layout, self.group, self.act_dtype = config, layout, group, act_dtype
        self.ep_rank = dist.get_rank(group)
        if dist.get_world_size(group) != layout.ep_size:
            raise ValueError(f"layout ep_size={layout.ep_size} != EP group size {dist.get_world_size(group)}")
        self.eplb: EplbState | None = None  # set by attach_eplb: dispatch adds its per-slot counts

    def __call__(self, layer: int, blk: BlockWeights, y: torch.Tensor) -> torch.Tensor:
        cfg, act, k = self.config, self.act_dtype, self.config.num_experts_per_tok
        m = blk.moe
        if m.experts.w1.shape[0] != self.layout.slots_per_rank:
            raise ValueError(
                f"layer {layer} holds {m.experts.w1.shape[0]} experts; EP rank needs its "
                f"{self.layout.slots_per_rank} slots (load with load_v41_ep or shard_experts)"
            )
        weights, ids = route_topk(linear(y, m.gate, torch.float32), m.bias, k, cfg.routed_scaling_factor)
        h = y.shape[1]
        rows = torch.cat((y.double(), weights.double(), ids.double()), dim=1)
        slot_base = self.ep_rank * self.layout.slots_per_rank
        p2l = self.layout.phys_to_logical[layer]

        def local_expert(slot: int, x: torch.Tensor) -> torch.Tensor:
            e = int(p2l[slot_base + slot])
            pick = x[:, h + k :] == e  # exactly one choice per row names this expert
            w = x[:, h : h + k][pick].unsqueeze(1)
            xs = x[:, :h]
            ex: ExpertWeights = m.experts
            g = clamped_swiglu(linear(xs, ex.w1[slot], act), linear(xs, ex.w3[slot], act), cfg.swiglu_limit)
            out = torch.zeros_like(x)
            out[:, :h] = linear(g * w, ex.w2[slot], act)
            return out

        count = self.eplb.expert_count[layer] if self.eplb is not None else None
        ones = torch.ones_like(weights, dtype=torch.float64)
        routed = dispatch_combine(rows, ids, ones, local_expert, self.layout.layer(layer), self.group, count)[
            :, :h
        ]
        if m.shared is not None:
            routed = routed + mlp(y, m.shared, cfg.swiglu_limit, act)
        return round_to(routed, act)

    def idle_step(self, blocks: list[BlockWeights]) -> None:
        """Join every layer's dispatch / combine with no tokens: what an EP rank without work this step
        (e.g. an idle DP rank) must call so the other ranks' all-to-alls complete."""
        empty = torch.zeros(0, self.config.hidden_size, dtype=torch.float64)
        for layer, blk in enumerate(blocks):
            self(layer, blk, empty)

    def expert_tensors(self, blocks: list[BlockWeights]) -> list[list[torch.Tensor]]:
        """Per layer `[w1, w3, w2]` (each `[S, ...]`): what `EplbState` shuffles in place."""
        return [[b.moe.experts.w1, b.moe.experts.w3, b.moe.experts.w2] for b in blocks]

    def attach_eplb(self, eplb: EplbState) -> None:
        if eplb.layout is not self.layout:
            raise ValueError("the EplbState must manage this MoE's layout")
        self.eplb = eplb


def shard_experts(blocks: list[BlockWeights], layout: RedundantExpertLayout, ep_rank: int) -> None:
    """Replace every layer's full expert stacks by this rank's slots (tests, or a model loaded whole)."""
    for layer, b in enumerate(blocks):
        ids = torch.tensor(layout.local_logical(layer, ep_rank))
        ex = b.moe.experts
        b.moe.experts = ExpertWeights(ex.w1[ids].clone(), ex.w3[ids].clone(), ex.w2[ids].clone())

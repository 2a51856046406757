"""Expert-parallel MoE for the V4.1 and public V4 backbones (spec v41-model §6.5, engine §7.3).

Each EP rank holds `S = (E + X) / ep` physical expert slots (`RedundantExpertLayout.local_logical`);
the router runs locally on this rank's tokens, `deepinfer_parallel.dispatch_combine` sends each
(token, choice) row to the rank owning its replica, and the shared expert is added locally.

V4.1 scales the SwiGLU output by the routing weight *before* `w2` (§6.2), so the owning rank needs
each row's weight. The dispatched row then carries `[y | weights(k) | logical ids(k)]` in FP64 and the
combine multiplies by 1.0: the expert picks the weight of the choice naming its logical expert (score
top-k ids are distinct). The public V4 scales after `w2`: the combine applies the weight itself (an
FP32 x FP32 product, exact in FP64). Either way each routed term is exactly the single-process one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_parallel import DeepEPDispatcher, EplbState, RedundantExpertLayout, dispatch_combine

from ..layers.experts import ExpertWeights, clamped_swiglu, mlp
from ..layers.moe import MoEWeights
from ..layers.router import route_hash, route_topk, router_logits
from ..models.deepseek_v41.config import DeepseekV41Config
from ..numerics import carrier, linear, round_to
from ..quant_sm90 import refuse_with_expert_parallelism


class ExpertParallelMoE:
    """`moe_fn` of `DeepseekV41ForCausalLM` (`(layer, block, y)`) and of the public `DeepseekV4Model`
    (`(layer, layer_weights, y, token_ids)`): the routed experts sharded over the EP `group`.

    `block.moe.experts` of every layer must hold this rank's slots only (`[S, ...]`, slot order), as
    `load_v41_ep` builds them or `shard_experts` cuts them; EPLB shuffles those tensors in place.
    Collective: every EP rank calls it for every MoE layer of a step (`idle_step` when it has no tokens).
    `part="drafter"` is the V4.1 draft blocks' MoE (`draft_moe_fn`; its own layout, one layer per block).
    """

    def __init__(
        self,
        config,
        layout: RedundantExpertLayout,
        group: dist.ProcessGroup | None = None,
        act_dtype: torch.dtype = torch.float32,
        part: str = "backbone",
        deepep: DeepEPDispatcher | None = None,
    ):
        refuse_with_expert_parallelism("ExpertParallelMoE")  # DEEPINFER_FP8_EXPERTS=1: no FP8 EP path
        if part == "backbone":
            n_routed, self.top_k, n_layers = (
                config.n_routed_experts,
                config.num_experts_per_tok,
                config.num_hidden_layers,
            )
        elif part == "drafter" and getattr(config, "dspark", None) is not None:
            ds = config.dspark
            n_routed, self.top_k, n_layers = ds.n_routed_experts, ds.num_experts_per_tok, ds.num_blocks
        else:
            raise ValueError(
                f"part must be 'backbone' or (for a V4.1 config with draft blocks) 'drafter', got {part!r}"
            )
        if layout.num_logical != n_routed:
            raise ValueError(
                f"layout has {layout.num_logical} logical experts, the {part} n_routed_experts = {n_routed}"
            )
        if layout.num_layers != n_layers:
            raise ValueError(f"layout has {layout.num_layers} layers, the {part} has {n_layers} MoE layers")
        if dist.get_world_size(group) != layout.ep_size:
            raise ValueError(f"layout ep_size={layout.ep_size} != EP group size {dist.get_world_size(group)}")
        self.config, self.layout, self.group, self.act_dtype = config, layout, group, act_dtype
        self.weight_before_down = isinstance(config, DeepseekV41Config)  # V4.1 §6.2; public V4: after
        self.ep_rank = dist.get_rank(group)
        self.eplb: EplbState | None = None  # set by attach_eplb: dispatch adds its per-slot counts
        # DeepEP (NVIDIA): BF16 rows, one per destination rank; None = the torch all-to-all backend (exact).
        self.deepep = deepep

    def __call__(
        self, layer: int, blk, y: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg, m = self.config, blk.moe
        if not isinstance(m.experts, ExpertWeights):  # e.g. Fp8Experts of a DEEPINFER_FP8_EXPERTS=1 load
            raise ValueError(
                f"layer {layer}: expert parallelism needs dequantised ExpertWeights, got "
                f"{type(m.experts).__name__} (DEEPINFER_FP8_EXPERTS=1 cannot be combined with expert parallelism)"
            )
        if m.experts.w1.shape[0] != self.layout.slots_per_rank:
            raise ValueError(
                f"layer {layer} holds {m.experts.w1.shape[0]} experts; EP rank needs its "
                f"{self.layout.slots_per_rank} slots (load with load_v41_ep or shard_experts)"
            )
        logits = router_logits(y, m.gate, self.act_dtype)  # router logits stay FP32
        if m.tid2eid is not None:
            weights, ids = route_hash(logits, token_ids, m.tid2eid, cfg.routed_scaling_factor)
        else:
            weights, ids = route_topk(logits, m.bias, self.top_k, cfg.routed_scaling_factor)
        count = self.eplb.expert_count[layer] if self.eplb is not None else None
        if self.deepep is not None:
            routed = self._deepep_routed(layer, m, y, weights, ids, count)
        else:
            routed = (self._weighted_in_expert if self.weight_before_down else self._weighted_in_combine)(
                layer, m, y, weights, ids, count
            )
        if m.shared is not None:
            routed = routed + mlp(y, m.shared, cfg.swiglu_limit, self.act_dtype)
        return round_to(routed, self.act_dtype)

    def _swiglu(self, ex: ExpertWeights, slot: int, x: torch.Tensor) -> torch.Tensor:
        act, limit = self.act_dtype, self.config.swiglu_limit
        return clamped_swiglu(linear(x, ex.w1[slot], act), linear(x, ex.w3[slot], act), limit)

    def _weighted_in_combine(self, layer, m: MoEWeights, y, weights, ids, count) -> torch.Tensor:
        def local_expert(slot: int, x: torch.Tensor) -> torch.Tensor:
            return linear(self._swiglu(m.experts, slot, x), m.experts.w2[slot], self.act_dtype)

        return dispatch_combine(
            y.double(), ids, weights.double(), local_expert, self.layout.layer(layer), self.group, count
        )

    def _weighted_in_expert(self, layer, m: MoEWeights, y, weights, ids, count) -> torch.Tensor:
        h, k = y.shape[1], ids.shape[1]
        rows = torch.cat((y.double(), weights.double(), ids.double()), dim=1)
        slot_base = self.ep_rank * self.layout.slots_per_rank
        # logical expert of each local slot, read once per layer (not one device read per slot)
        p2l = self.layout.phys_to_logical[layer, slot_base : slot_base + self.layout.slots_per_rank].tolist()

        def local_expert(slot: int, x: torch.Tensor) -> torch.Tensor:
            pick = x[:, h + k :] == p2l[slot]  # the one choice naming this expert
            w = x[:, h : h + k][pick].unsqueeze(1)
            out = torch.zeros_like(x)
            out[:, :h] = linear(
                self._swiglu(m.experts, slot, x[:, :h]) * w, m.experts.w2[slot], self.act_dtype
            )
            return out

        ones = torch.ones_like(weights, dtype=torch.float64)
        return dispatch_combine(rows, ids, ones, local_expert, self.layout.layer(layer), self.group, count)[
            :, :h
        ]

    def _deepep_routed(self, layer, m: MoEWeights, y, weights, ids, count) -> torch.Tensor:
        """The routed experts through DeepEP: rows arrive in BF16 with their routing weight, the expert
        applies it (before `w2` for V4.1, after it for the public V4), the combine sums in BF16."""

        def expert(slot: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            x = x.to(y.dtype)
            w = w.to(torch.float32).unsqueeze(1)
            h = self._swiglu(m.experts, slot, x)
            if self.weight_before_down:
                return linear(h * w, m.experts.w2[slot], self.act_dtype)
            return linear(h, m.experts.w2[slot], self.act_dtype) * w

        # (the BF16 combine widened to the carrier: `y` may be held in BF16, see `ShiftedHC`)
        return self.deepep.dispatch_combine(y, ids, weights, expert, self.layout.layer(layer), count).to(
            carrier()
        )

    def idle_step(self, blocks: list, start: int = 0) -> None:
        """Join the dispatch / combine of layers `start`.. with no tokens: what an EP rank without work this
        step (e.g. an idle DP rank), or a forward that stopped before its last MoE layer, must call so the
        other ranks' all-to-alls complete."""
        dev = blocks[0].moe.experts.w1.device if blocks else torch.device("cpu")
        empty = torch.zeros(0, self.config.hidden_size, dtype=torch.float64, device=dev)
        no_ids = torch.zeros(0, dtype=torch.long, device=dev)
        for layer in range(start, len(blocks)):
            self(layer, blocks[layer], empty, no_ids)

    def expert_tensors(self, blocks: list) -> list[list[torch.Tensor]]:
        """Per layer `[w1, w3, w2]` (each `[S, ...]`): what `EplbState` shuffles in place."""
        return [[b.moe.experts.w1, b.moe.experts.w3, b.moe.experts.w2] for b in blocks]

    def attach_eplb(self, eplb: EplbState) -> None:
        if eplb.layout is not self.layout:
            raise ValueError("the EplbState must manage this MoE's layout")
        self.eplb = eplb


def shard_experts(blocks: list, layout: RedundantExpertLayout, ep_rank: int) -> None:
    """Replace every layer's full expert stacks by this rank's slots (a model that was loaded whole,
    e.g. the public V4; `load_v41_ep` reads only the local experts in the first place)."""
    for layer, b in enumerate(blocks):
        ex = b.moe.experts
        ids = torch.tensor(layout.local_logical(layer, ep_rank), device=ex.w1.device)
        b.moe.experts = ExpertWeights(ex.w1[ids].clone(), ex.w3[ids].clone(), ex.w2[ids].clone())

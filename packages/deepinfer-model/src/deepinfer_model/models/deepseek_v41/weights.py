"""Typed, dequantised V4.1 weights built from HF tensor names (spec v41-model §9.3).

`V41Weights.from_tensors(cfg, get)` takes `get(name) -> FP32 tensor` (already dequantised, see
`loader.py`), so the same code serves checkpoints on disk and in-memory test weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...layers.attention import AttentionWeights
from ...layers.compressor import CompressorWeights
from ...layers.experts import ExpertWeights, MLPWeights
from ...layers.indexer import IndexerWeights
from ...layers.mhc import HCParams
from ...layers.moe import MoEWeights
from .config import DeepseekV41Config
from .drafter_heads import MarkovHead
from .engram import EngramWeights
from .vision.weights import VisionWeights

Getter = Callable[[str], torch.Tensor]


@dataclass
class BlockWeights:
    """One decoder block (backbone layer or draft block); optional parts exist only where §9.3 says."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HCParams
    hc_ffn: HCParams
    attn: AttentionWeights
    moe: MoEWeights  # ffn.gate (+ bias for selection only), routed experts, shared expert
    compressor: CompressorWeights | None = None  # KV-source layers
    indexer: IndexerWeights | None = None  # index-source layers (wk/k_norm on index-K sources)
    engram: EngramWeights | None = None


@dataclass
class DrafterWeights:
    main_proj: torch.Tensor  # mtp.0.main_proj [H, n_t·H]
    main_norm: torch.Tensor  # mtp.0.main_norm [H]
    blocks: list[BlockWeights]
    norm: torch.Tensor  # mtp.{last}.norm [H]
    markov: MarkovHead
    confidence_proj: torch.Tensor  # mtp.{last}.confidence_head.proj [1, H + rank]


@dataclass
class V41Weights:
    embed: torch.Tensor
    head: torch.Tensor
    norm: torch.Tensor
    layers: list[BlockWeights]
    drafter: DrafterWeights | None
    # [3, H]: the learned image-start, image-newline and image-end embeddings, in that order
    image_embeds: torch.Tensor | None = None
    vision: VisionWeights | None = None  # encoder + aligner, when the config describes a vision tower

    @classmethod
    def from_tensors(
        cls,
        cfg: DeepseekV41Config,
        get: Getter,
        local_experts: Callable[[int], list[int]] | None = None,
        local_draft_experts: Callable[[int], list[int]] | None = None,
    ) -> V41Weights:
        """`local_experts(layer)` / `local_draft_experts(block)` (expert parallel): the logical expert of
        each local physical slot; the backbone's / draft blocks' routed expert stacks then hold only those,
        in slot order (default: all experts)."""
        layers = [
            _block(cfg, get, f"layers.{i}.", i, cfg.n_routed_experts, local_experts and local_experts(i))
            for i in range(cfg.num_hidden_layers)
        ]
        drafter = None
        if cfg.dspark:
            ds = cfg.dspark
            last = f"mtp.{ds.num_blocks - 1}."
            drafter = DrafterWeights(
                main_proj=get("mtp.0.main_proj.weight"),
                main_norm=get("mtp.0.main_norm.weight"),
                blocks=[
                    _block(
                        cfg,
                        get,
                        f"mtp.{i}.",
                        None,
                        ds.n_routed_experts,
                        local_draft_experts and local_draft_experts(i),
                    )
                    for i in range(ds.num_blocks)
                ],
                norm=get(last + "norm.weight"),
                markov=MarkovHead(
                    get(last + "markov_head.embed.weight"), get(last + "markov_head.head.weight")
                ),
                confidence_proj=get(last + "confidence_head.proj.weight"),
            )
        image_embeds = vision = None
        if cfg.vision:
            image_embeds = torch.stack([get("image_start"), get("image_newline"), get("image_end")])
            vision = VisionWeights.from_tensors(cfg.vision, get)
        return cls(
            get("embed.weight"), get("head.weight"), get("norm.weight"), layers, drafter, image_embeds, vision
        )


def _hc(get: Getter, p: str, side: str) -> HCParams:
    return HCParams(
        fn=get(f"{p}hc_{side}_fn"), base=get(f"{p}hc_{side}_base"), scale=get(f"{p}hc_{side}_scale")
    )


def _block(
    cfg: DeepseekV41Config,
    get: Getter,
    p: str,
    layer: int | None,
    n_experts: int,
    expert_ids: list[int] | None = None,
) -> BlockWeights:
    a, f = p + "attn.", p + "ffn."
    attn = AttentionWeights(
        wq_a=get(a + "wq_a.weight"),
        q_norm=get(a + "q_norm.weight"),
        wq_b=get(a + "wq_b.weight"),
        wkv=get(a + "wkv.weight"),
        kv_norm=get(a + "kv_norm.weight"),
        wo_a=get(a + "wo_a.weight"),
        wo_b=get(a + "wo_b.weight"),
        sinks=get(a + "attn_sink"),
    )
    ids = range(n_experts) if expert_ids is None else expert_ids
    experts = [[get(f"{f}experts.{e}.{n}.weight") for e in ids] for n in ("w1", "w3", "w2")]
    blk = BlockWeights(
        attn_norm=get(p + "attn_norm.weight"),
        ffn_norm=get(p + "ffn_norm.weight"),
        hc_attn=_hc(get, p, "attn"),
        hc_ffn=_hc(get, p, "ffn"),
        attn=attn,
        moe=MoEWeights(
            gate=get(f + "gate.weight"),
            experts=ExpertWeights(*(torch.stack(x) for x in experts)),
            shared=MLPWeights(
                get(f + "shared_experts.w1.weight"),
                get(f + "shared_experts.w3.weight"),
                get(f + "shared_experts.w2.weight"),
            ),
            bias=get(f + "gate.bias"),
        ),
    )
    if layer is None:
        return blk
    topo = cfg.topology
    if cfg.compress_ratios[layer] > 0:
        if topo.is_kv_source(layer):
            wgate = get(a + "compressor.wgate.weight") if cfg.compress_ratios[layer] == 2 else None
            blk.compressor = CompressorWeights(
                get(a + "compressor.wkv.weight"), wgate, get(a + "compressor.norm.weight")
            )
        if topo.is_index_source(layer):
            ik = topo.is_index_k_source(layer)
            blk.indexer = IndexerWeights(
                wq_b=get(a + "indexer.wq_b.weight"),
                weights_proj=get(a + "indexer.weights_proj.weight"),
                wk=get(a + "indexer.wk.weight") if ik else None,
                k_norm=get(a + "indexer.k_norm.weight") if ik else None,
            )
    if cfg.engram and layer in cfg.engram.layer_ids:
        blk.engram = EngramWeights(
            table=get(p + "engram.embed.weight"),
            wkv=get(p + "engram.wkv.weight"),
            q_weight=get(p + "engram.q_weight"),
            k_weight=get(p + "engram.k_weight"),
        )
    return blk

"""Cross-layer values of one paged step and the query row blocks its attention layers run over."""

from __future__ import annotations

import torch

from ....runtime.metadata import StepMetadata
from ....runtime.step_view import StepView
from ...grouped_attention import (
    Group,
    NewEntries,
    row_blocks,
)
from ...grouped_attention import query_block_rows as groups_query_block_rows
from ..model import DeepseekV41ForCausalLM
from ..yoco_step import YocoStep
from .static_attention import _static_groups


def query_block_rows(model: DeepseekV41ForCausalLM, meta: StepMetadata) -> int:
    """Rows per query block of `_attention` for this step (>= every row: one block)."""
    cfg = model.config
    ratios = [r for r in cfg.compress_ratios[: cfg.topology.num_layers] if r]
    return groups_query_block_rows(meta, cfg.num_attention_heads, cfg.head_dim, min(ratios, default=None))


class _StepState:
    """Cross-layer values of this step (the paged counterpart of `CrossLayerState`), packed per token."""

    def __init__(self, meta: StepView, yoco: YocoStep | None = None, block_rows: int | None = None) -> None:
        self.meta, self.yoco, self.block_rows = meta, yoco, block_rows
        self._blocks: dict[bool, list] = {}  # consumer half's metadata or not -> its query blocks
        self.fresh: dict[int, NewEntries | None] = {}  # kv source -> entries completed in this step
        self.selection: dict[int, torch.Tensor] = {}  # index source -> top-k [N, index_topk]
        self.candidates: torch.Tensor | None = None  # [N, candidate_topk_blocks]
        self.shared_hidden: torch.Tensor | None = None
        self.split = None  # runtime.cp_rows.PagedMirrorRows of a context-parallel step (meta: its rows)

    def query_blocks(self, consumer: bool) -> list[tuple[int, int, StepView, list[Group]]]:
        """(first row, end row, metadata, groups) of each query block of the step's rows (the consumer
        half's rows with YOCO truncation, which are the step's unless compact mode drops some): the whole
        step when it has at most `block_rows` rows (always for the graph-safe step), else consecutive
        row blocks as `StepMetadata.row_block` steps. Built once per step: their index tensors are shared
        by every layer."""
        # keyed by which metadata, not by its id: a compiled step would guard on the object's identity and
        # recompile for every (bucket, tier) metadata object
        key = consumer and self.yoco is not None
        qmeta = self.yoco.qmeta if key else self.meta
        if key not in self._blocks:
            if qmeta.graph_safe:
                self._blocks[key] = [(0, qmeta.positions.shape[0], qmeta, _static_groups(qmeta))]
            else:
                self._blocks[key] = row_blocks(qmeta, self.block_rows)
        return self._blocks[key]

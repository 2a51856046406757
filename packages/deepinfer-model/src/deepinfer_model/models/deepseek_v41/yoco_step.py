"""YOCO prefill truncation (spec v41-model §8) for one packed paged step: who computes what, per sequence.

Per sequence with prompt length `L` (the prompt the plan was made for; decode / recompute rows after it
are a continuation) and KEEP: `rect_lo = max(0, L - KEEP)`. Consumer layers (>= n_prefill_layer) see no
SWA key below `rect_lo`; in `compact` mode they also run only the chunk's kept rows (`j >= clip`, the
`yoco.chunk_plan` rule; a chunk wholly before `rect_lo` keeps its last row as a placeholder). Producer
layers, the shared hidden S and every compressed / index key stay computed for every row.

The paged pools keep every consumer SWA key (no ring), so what a resumed step reads is only valid if it
was computed under the same `rect_lo`: each token slot carries a tag (`YOCO_TAG` pool) = the `rect_lo`
its consumer SWA key was computed under, or `INVALID_TAG` when no key was computed there. A step whose
cached reads carry another tag (a prefix-cache hit from a prompt of another length, deep enough to read
keys computed under that prompt's clip) is refused before anything is written: its result would match
no stateless forward. `resume_problem` lets a caller test a block table before scheduling it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...runtime.metadata import StepMetadata
from ...runtime.pools import PagedKVCache, PoolSpec
from ..grouped_attention import ranges
from .yoco import YocoMode, YocoSettings

YOCO_TAG = "yoco_tag"
INVALID_TAG = -1


def tag_spec(block_size: int) -> PoolSpec:
    # host pool: written from host plans, read only by `resume_problem` before the step (no device sync)
    return PoolSpec(YOCO_TAG, block_size, 1, torch.int64, host=True)


@dataclass
class YocoStep:
    """The truncation plan of one step (all sequences), vectorised."""

    mode: YocoMode
    rect_lo: np.ndarray  # int64 [B] first position with a consumer SWA key
    clip: np.ndarray  # int64 [B] leading rows of each chunk the consumer half skips (0 in mask mode)
    kept: torch.Tensor  # long [N'] packed rows the consumer half computes
    qmeta: StepMetadata  # the consumer half's query metadata (== meta unless compact drops rows)
    row_floor: torch.Tensor  # long [N'] rect_lo of each consumer query row's sequence
    tags: torch.Tensor  # long [N] tag written at every packed row's slot

    @classmethod
    def build(cls, meta: StepMetadata, settings: YocoSettings, prompt_lens) -> YocoStep:
        lens = np.asarray(prompt_lens, dtype=np.int64).reshape(-1)
        if len(lens) != meta.num_seqs:
            raise ValueError(
                f"prompt_lens must hold one prompt length per sequence ({meta.num_seqs}), got {len(lens)}"
            )
        if np.any(lens < 1):
            raise ValueError(f"prompt_lens must be >= 1 for every sequence, got {lens.tolist()}")
        rect_lo = np.maximum(lens - settings.keep_tokens, 0)
        qlens = meta.query_lens
        if settings.mode is YocoMode.COMPACT:
            clip = np.clip(rect_lo - meta.starts, 0, np.maximum(qlens - 1, 0))
        else:
            clip = np.zeros_like(qlens)
        n = int(meta.offsets[-1])
        seq_of = np.repeat(np.arange(meta.num_seqs), qlens)
        row_in_seq = np.arange(n) - meta.offsets[:-1][seq_of]
        kept = np.flatnonzero(row_in_seq >= clip[seq_of])
        positions = meta.host_positions
        tags = np.where(positions >= rect_lo[seq_of], rect_lo[seq_of], INVALID_TAG)
        tags[row_in_seq < clip[seq_of]] = INVALID_TAG  # compact: no key is computed for skipped rows
        qmeta = meta
        if len(kept) < n:
            inv = np.full(n, -1, dtype=np.int64)
            inv[kept] = np.arange(len(kept))
            logits_rows = inv[meta.host_logits_rows]
            if np.any(logits_rows < 0):
                seq = int(seq_of[meta.host_logits_rows[int(np.argmax(logits_rows < 0))]])
                raise ValueError(
                    f"batch entry {seq}: logits were asked for a prompt row that YOCO compact truncation does "
                    f"not compute (rows before rect_lo = {int(rect_lo[seq])}); prompt logprobs need "
                    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE = off"
                )
            k = meta.dev(kept)
            new_qlens = qlens - clip
            offsets = np.zeros_like(meta.offsets)
            np.cumsum(new_qlens, out=offsets[1:])
            qmeta = StepMetadata(
                block_size=meta.block_size,
                starts=meta.starts + clip,
                query_lens=new_qlens,
                ends=meta.ends,
                offsets=offsets,
                tables=meta.tables,
                input_ids=meta.input_ids[k],
                positions=meta.positions[k],
                write_slots=meta.write_slots[k],
                logits_rows=meta.dev(logits_rows),
                device=meta.device,
                host_positions=meta.host_positions[kept],
                host_write_slots=meta.host_write_slots[kept],
                host_logits_rows=logits_rows,
            )
        row_floor = meta.dev(rect_lo[seq_of[kept]])
        # tags stay on the host: the tag pool is host memory (only the host-side resume check reads it)
        return cls(
            settings.mode,
            rect_lo,
            clip,
            meta.dev(kept),
            qmeta,
            row_floor,
            torch.as_tensor(tags, device="cpu"),
        )

    @property
    def drops_rows(self) -> bool:
        return len(self.kept) < len(self.tags)


def resume_problem(
    cache: PagedKVCache,
    meta: StepMetadata,
    step: YocoStep,
    window: int,
    seq_ids=None,
) -> str | None:
    """Why this step would read consumer SWA keys computed under another `rect_lo` (None: it would not).

    A sequence's queries start at `starts + clip`; its visible cached keys are the positions
    `[max(first_query - W + 1, rect_lo), start)`; each must carry the tag `rect_lo`.
    """
    lo = np.maximum(step.qmeta.starts - window + 1, step.rect_lo)
    hi = meta.starts
    seq, pos = ranges(lo, hi)
    if len(pos) == 0:
        return None
    slots = torch.as_tensor(meta.token_slots_of(seq, pos), device="cpu")
    tags = cache.read(YOCO_TAG, slots).reshape(-1).numpy()
    bad = np.flatnonzero(tags != step.rect_lo[seq])
    if len(bad) == 0:
        return None
    b = int(bad[0])
    i = int(seq[b])
    sid = i if seq_ids is None else int(seq_ids[i])
    found = int(tags[b])
    what = "no consumer SWA key" if found == INVALID_TAG else f"a key computed under rect_lo = {found}"
    return (
        f"sequence {sid}: YOCO truncation: resuming at position {int(meta.starts[i])} reads the cached consumer "
        f"SWA key of position {int(pos[b])}, which holds {what}, but this sequence's rect_lo is "
        f"{int(step.rect_lo[i])} (prompt length - KEEP). Such a resume (a prefix-cache hit from a prompt of "
        "another length) matches no truncated forward of this sequence: recompute it from position 0 "
        "without the prefix hit"
    )

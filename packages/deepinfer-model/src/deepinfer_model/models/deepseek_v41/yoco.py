"""SWA bounded replay ("YoCo prefill truncation", spec v41-model §8): the plan and its metadata.

Under truncation the YOCO consumer half (layers >= n_prefill_layer) only needs the last KEEP prompt
tokens: their compressed KV / index keys come from the shared hidden `S` of every token, and their SWA
visibility is clipped at `rect_lo = data_len - KEEP`. `mask` computes every row with that clipped
visibility; `compact` runs consumer layers on the kept rows only. Everything here is pure metadata
(plain ints / int64 tensors, no weights), so a paged runtime and the stateless forward can share it and
the L1 harness can check that `compact` and `mask` describe the same attention on the kept rows.

Per chunk `[q_start, q_start + q_len)` of a prompt of `data_len` tokens:
* kept rows: `j >= clip`, `clip = clamp(rect_lo - q_start, 0, q_len - 1)` in compact mode (0 otherwise),
  so a chunk wholly before `rect_lo` keeps its last row as a placeholder (it sees no SWA key);
* SWA pivot (first visible SWA key) of a consumer query at `pos`:
  `max(pos - W + 1, rect_lo, valid_start, 0)`; keys below the chunk come from the ring, the others from
  the chunk's key buffer (all rows in mask mode, kept rows only in compact mode);
* ring store: a consumer SWA key is written at slot `pos % ring_size` iff `pos >= rect_lo` and its row is
  among the last `ring_size` rows of the chunk (earlier rows would be overwritten within the chunk);
* compressed entries are stored for every token (both modes) and a query sees entries `j < (pos+1)//r`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch
from deepinfer_cluster import envs

MODE_ENV = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
KEEP_ENV = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
RECOMMENDED_KEEP = 140  # the reference's V4.1 setting (W = 128, B = 6 -> 134 needed)


class YocoMode(StrEnum):
    OFF = "off"
    MASK = "mask"
    COMPACT = "compact"

    @classmethod
    def parse(cls, value: str | YocoMode, field: str = MODE_ENV) -> YocoMode:
        try:
            return cls(value.strip().lower() if isinstance(value, str) else value)
        except ValueError:
            raise ValueError(f"{field} = {value!r} must be one of 'off', 'mask', 'compact'") from None


@dataclass(frozen=True)
class YocoSettings:
    """Engine-wide truncation settings (`keep_tokens` is 0 when the mode is off)."""

    mode: YocoMode = YocoMode.OFF
    keep_tokens: int = 0

    @property
    def enabled(self) -> bool:
        return self.mode is not YocoMode.OFF

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> YocoSettings:
        mode = YocoMode.parse(envs.get(MODE_ENV, environ))
        keep = envs.get(KEEP_ENV, environ)
        if mode is not YocoMode.OFF and keep <= 0:
            raise ValueError(
                f"{KEEP_ENV} = {keep} must be > 0 when {MODE_ENV} = {mode.value} "
                f"(the reference uses {RECOMMENDED_KEEP} for V4.1)"
            )
        return cls(mode, keep if mode is not YocoMode.OFF else 0)


def max_backtracking(max_backtracking_tokens: int = 0, num_draft_tokens: int = 5) -> int:
    """B: how far a saved state may be resumed before its end (rollback of drafts, prefix back-off)."""
    if max_backtracking_tokens < 0 or num_draft_tokens < 0:
        raise ValueError(
            f"max_backtracking_tokens = {max_backtracking_tokens} and num_draft_tokens = {num_draft_tokens} "
            "must be >= 0"
        )
    return max(max_backtracking_tokens, num_draft_tokens + 1)


def check_keep(keep_tokens: int, sliding_window: int, backtracking: int) -> None:
    """KEEP >= W + B: a resume at `data_len - b` (b <= B) needs consumer SWA keys down to `rect_lo`."""
    need = sliding_window + backtracking
    if keep_tokens < need:
        raise ValueError(
            f"YOCO truncation: KEEP = {KEEP_ENV} = {keep_tokens} must be >= sliding_window W + max "
            f"backtracking B = {sliding_window} + {backtracking} = {need} (the replayed suffix must hold every "
            "consumer SWA key a resume up to B tokens back needs)"
        )


def check_settings(settings: YocoSettings, config, backtracking: int) -> None:
    """Engine start-up check of the truncation settings against a V4.1 config (`DeepseekV41Config`)."""
    if not settings.enabled:
        return
    topo = config.topology
    if not (topo.yoco_enabled and config.n_prefill_layer > 0):
        raise ValueError(
            f"{MODE_ENV} = {settings.mode.value} needs a YOCO model (0 < n_prefill_layer < num_hidden_layers); "
            "set it to 'off' for this checkpoint"
        )
    check_keep(settings.keep_tokens, config.sliding_window, backtracking)


def check_prompt_logprobs(settings: YocoSettings | YocoMode, prompt_logprobs: bool) -> None:
    """Prompt logprobs need every prompt row's final hidden; truncation skips them, so they are refused."""
    mode = settings.mode if isinstance(settings, YocoSettings) else settings
    if prompt_logprobs and mode is not YocoMode.OFF:
        raise ValueError(
            f"prompt_logprobs = True is not available with {MODE_ENV} = {mode.value}: consumer layers do not "
            "compute (compact) or clip (mask) the early prompt rows; set prompt_logprobs = False or the mode to 'off'"
        )


@dataclass(frozen=True)
class ChunkPlan:
    """Truncation plan of one chunk of one sequence (rows are chunk-relative, positions absolute).

    Rows at positions `>= data_len` (the stateless model's decode continuation) are always kept.
    """

    data_len: int
    q_start: int
    q_len: int
    keep: int | None
    mode: YocoMode

    @property
    def rect_lo(self) -> int:
        """First position whose consumer SWA key exists; 0 when truncation is off (may be negative)."""
        return 0 if self.mode is YocoMode.OFF else self.data_len - self.keep

    @property
    def clip(self) -> int:
        if self.mode is not YocoMode.COMPACT:
            return 0
        return min(max(self.rect_lo - self.q_start, 0), self.q_len - 1)

    @property
    def kept_rows(self) -> torch.Tensor:
        """Chunk rows the consumer layers compute (mask / off: all; compact: the suffix from `clip`)."""
        return torch.arange(self.clip, self.q_len, device="cpu")  # host plan; callers move it

    @property
    def kept_positions(self) -> torch.Tensor:
        return self.q_start + self.kept_rows

    @property
    def num_kept(self) -> int:
        return self.q_len - self.clip


def chunk_plan(
    data_len: int, q_start: int, q_len: int, keep: int | None, mode: YocoMode | str = YocoMode.COMPACT
) -> ChunkPlan:
    mode = YocoMode.parse(mode, "mode")
    if data_len < 1 or q_start < 0 or q_len < 1:
        raise ValueError(
            f"chunk (data_len = {data_len}, q_start = {q_start}, q_len = {q_len}) needs data_len >= 1, "
            "q_start >= 0, q_len >= 1"
        )
    if mode is not YocoMode.OFF and (keep is None or keep < 1):
        raise ValueError(f"keep = {keep} must be >= 1 when the truncation mode is {mode.value}")
    return ChunkPlan(data_len, q_start, q_len, keep if mode is not YocoMode.OFF else None, mode)


def chunk_plans(
    data_len: int, chunk_lens: list[int], keep: int | None, mode: YocoMode | str
) -> list[ChunkPlan]:
    """Plans of a chunked prefill whose chunks (lengths summing to `data_len`) cover the prompt in order."""
    if sum(chunk_lens) != data_len:
        raise ValueError(f"chunk_lens sum to {sum(chunk_lens)}, must sum to data_len = {data_len}")
    plans, start = [], 0
    for n in chunk_lens:
        plans.append(chunk_plan(data_len, start, n, keep, mode))
        start += n
    return plans


@dataclass(frozen=True)
class SwaMetadata:
    """Consumer-layer SWA metadata of one chunk, one entry per computed row (`rows`).

    Visible keys of row i: positions `[pivot[i], positions[i]]` (empty if pivot > position): those below
    `q_start` read ring slots `ring_lo[i] .. ring_hi[i]` (positions, slot = pos % ring_size), the others
    read the chunk's key buffer at indices `[buf_lo[i], buf_hi[i]]` (empty ranges: lo > hi). The buffer
    holds one key per computed row, so in compact mode its index 0 is the first kept row. `store_slot[i]`
    is where row i's key is written in the ring (-1: not written).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    pivot: torch.Tensor
    ring_lo: torch.Tensor
    ring_hi: torch.Tensor
    buf_lo: torch.Tensor
    buf_hi: torch.Tensor
    store_slot: torch.Tensor

    def visible_positions(self, i: int) -> list[int]:
        """Absolute positions of row i's visible SWA keys, rebuilt from its ring and buffer ranges."""
        ring = list(range(int(self.ring_lo[i]), int(self.ring_hi[i]) + 1))
        first = int(self.positions[0])  # buffer index 0 = first computed row
        buf = [first + b for b in range(int(self.buf_lo[i]), int(self.buf_hi[i]) + 1)]
        return ring + buf


def swa_metadata(plan: ChunkPlan, window: int, ring_size: int, valid_start: int = 0) -> SwaMetadata:
    """SWA metadata of the consumer layers for the rows the plan computes (see `SwaMetadata`).

    Producer layers use the same with `mode = off` (no clip).
    """
    if window < 1 or ring_size < window:
        raise ValueError(f"window = {window} must be >= 1 and ring_size = {ring_size} >= window")
    rows = plan.kept_rows
    pos = plan.q_start + rows
    pivot = torch.clamp(pos - window + 1, min=max(plan.rect_lo, valid_start, 0))
    # Ring part: visible keys before the chunk; buffer part: keys of computed rows of this chunk.
    ring_lo, ring_hi = pivot, torch.minimum(pos, torch.full_like(pos, plan.q_start - 1))
    first = plan.q_start + plan.clip
    buf_lo = torch.clamp(pivot, min=plan.q_start) - first
    buf_hi = pos - first
    stored = (pos >= plan.rect_lo) & (rows >= plan.q_len - ring_size)
    store_slot = torch.where(stored, pos % ring_size, torch.full_like(pos, -1))
    return SwaMetadata(rows, pos, pivot, ring_lo, ring_hi, buf_lo, buf_hi, store_slot)


def compressed_ranges(plan: ChunkPlan, ratio: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(visible entry count per computed row = (pos+1)//r, the chunk's stored entry range [lo, hi)).

    Compressed KV / index keys are built for every token of the chunk in both modes (from `S` in the
    consumer half), so the stored range does not depend on the mode.
    """
    if ratio < 1:
        raise ValueError(f"ratio = {ratio} must be >= 1 (a compressed layer)")
    visible = torch.div(plan.kept_positions + 1, ratio, rounding_mode="floor")
    q_end = plan.q_start + plan.q_len
    return visible, (plan.q_start // ratio, q_end // ratio)


@dataclass(frozen=True)
class PrefillFlops:
    """FP8-equivalent FLOPs of one prefill chunk (engine spec §2.11 coefficients: one multiply-add costs
    FP4 = 1, FP8 = 2, BF16 = 4, FP32 = 8), split by where the work happens."""

    producer: float
    consumer: float
    attention: float
    logits: float
    consumer_rows: int

    @property
    def total(self) -> float:
        return self.producer + self.consumer + self.logits


FP4, FP8, BF16, FP32 = 1, 2, 4, 8


def _per_row_dense(cfg, layer: int) -> float:
    """Non-attention-pair work of one row in one layer: projections, indexer queries, HC mixes, MoE."""
    H, D, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    m = cfg.hc_mult
    proj = H * cfg.q_lora_rank + cfg.q_lora_rank * nh * D + H * D  # wq_a, wq_b, wkv (SWA latent)
    proj += nh * D * cfg.o_lora_rank + H * cfg.o_groups * cfg.o_lora_rank  # wo_a, wo_b
    f = FP8 * proj
    if cfg.compress_ratios[layer] and cfg.topology.is_index_source(layer):
        ni, di = cfg.index_n_heads, cfg.index_head_dim
        f += FP8 * cfg.q_lora_rank * ni * di + BF16 * H * ni  # index queries, head weights
    f += 2 * FP32 * m * H * (2 * m + m * m)  # HC mixes of the two sub-layers
    f += BF16 * H * cfg.n_routed_experts  # router
    f += FP4 * 3 * H * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    f += FP8 * 3 * H * cfg.moe_intermediate_size * cfg.n_shared_experts
    return float(f)


def _sum_floor(lo: int, hi: int, r: int) -> int:
    """sum_{t=lo}^{hi-1} floor(t / r) in closed form."""

    def prefix(n: int) -> int:  # sum_{t<n} floor(t/r)
        q, rem = divmod(n, r)
        return r * q * (q - 1) // 2 + q * rem

    return prefix(hi) - prefix(lo)


def _sum_min_floor(lo: int, hi: int, r: int, cap: int) -> int:
    """sum_{t=lo}^{hi-1} min(floor(t / r), cap) in closed form."""
    knee = min(max((cap + 1) * r, lo), hi)  # first t with floor(t/r) > cap is (cap+1)*r
    return _sum_floor(lo, knee, r) + cap * (hi - knee)


def prefill_flops(
    cfg,
    q_start: int,
    q_len: int,
    data_len: int,
    keep: int | None = None,
    mode: YocoMode | str = YocoMode.OFF,
    valid_start: int = 0,
) -> PrefillFlops:
    """Estimated FP8-equivalent FLOPs of a prefill chunk of the target model under a truncation plan.

    Producer layers do every row; consumer layers do `plan.num_kept` rows (all under `off` / `mask`),
    but the consumer compressors (from `S`) and index keys run over every row in every mode. Attention
    pairs: SWA keys `[pivot, pos]` per row, top-k capped compressed keys, indexer scores over all visible
    compressed entries. One logits row per chunk (the sampled last row).
    """
    plan = chunk_plan(data_len, q_start, q_len, keep, mode)
    L, W, D, nh = cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim, cfg.num_attention_heads
    n_prefill = min(cfg.n_prefill_layer, L)
    producer = consumer = attention = 0.0
    for layer in range(L):
        is_consumer = layer >= n_prefill
        p = plan if is_consumer else chunk_plan(data_len, q_start, q_len, None, YocoMode.OFF)
        rows = p.num_kept
        lo_pos, hi_pos = p.q_start + p.clip, p.q_start + p.q_len  # computed positions [lo_pos, hi_pos)
        # SWA pairs: sum over rows of (pos - pivot + 1), pivot = max(pos - W + 1, floor_lo).
        floor_lo = max(p.rect_lo, valid_start, 0)
        # rows below floor_lo see nothing, rows in [first, knee) are clipped at floor_lo, the rest see W.
        first = min(max(floor_lo, lo_pos), hi_pos)
        knee = min(max(floor_lo + W - 1, first), hi_pos)
        swa_pairs = sum_range(first, knee) - (knee - first) * (floor_lo - 1) + W * (hi_pos - knee)
        att = BF16 * 2 * nh * D * swa_pairs  # QK and PV over the shared latent
        dense = rows * _per_row_dense(cfg, layer)
        r = cfg.compress_ratios[layer]
        if r:
            # entries visible to the query at pos: floor((pos+1)/r); sparse attention reads top-k of them.
            att += BF16 * 2 * nh * D * _sum_min_floor(lo_pos + 1, hi_pos + 1, r, cfg.index_topk)
            if cfg.topology.is_index_source(layer):
                att += FP4 * cfg.index_n_heads * cfg.index_head_dim * _sum_floor(lo_pos + 1, hi_pos + 1, r)
            if cfg.topology.is_kv_source(layer):  # compressor over every token (consumer: from S)
                entries = (q_start + q_len) // r - q_start // r
                dense_all = FP8 * 2 * cfg.hidden_size * D * q_len
                if cfg.topology.is_index_k_source(layer):
                    dense_all += FP8 * D * cfg.index_head_dim * entries
                dense += dense_all
        attention += att
        if is_consumer:
            consumer += dense + att
        else:
            producer += dense + att
    logits = float(BF16 * cfg.hidden_size * cfg.vocab_size)
    return PrefillFlops(producer, consumer, attention, logits, plan.num_kept)


def sum_range(lo: int, hi: int) -> int:
    """sum_{t=lo}^{hi-1} t."""
    return (hi - lo) * (lo + hi - 1) // 2 if hi > lo else 0

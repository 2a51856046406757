"""DSpark / DFlash drafter (spec v41-model §7.2–§7.4): main-token KV, block-parallel draft forward, heads.

After a target forward, the drafter's blocks get one "main" key per processed token, projected from
the target-layer features. A draft step then embeds `[g, noise, ..., noise]` (g = the token the
target just produced), runs the draft blocks (SWA-only; every row sees the last `W` main keys plus all
draft keys of the block: bidirectional inside the block) and turns the final hidden into per-position
logits with a Markov correction on the previous draft token, plus a confidence per position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ... import batch_invariant
from ...layers.attention import project_latent, project_output, project_query, sink_attention
from ...layers.norm import rms_norm
from ...layers.rope import cos_sin
from ...numerics import carrier, linear, round_to
from ...numerics import logits as head_logits
from ...ops import model_calls
from .blocks import ShiftedHC, moe_ffn
from .config import DeepseekV41Config
from .drafter_heads import confidence, markov_correction
from .kv_quant import EXACT_KV, KVQuant
from .weights import BlockWeights, DrafterWeights

# (fp32 logits [V], draft step) -> token id: an int, or a 0-d long tensor on the logits' device (which
# keeps the draft loop free of host syncs; `greedy` does that)
Sampler = Callable[[torch.Tensor, int], "int | torch.Tensor"]


class RowSampler(Protocol):
    """Draft `step` of every sequence of a draft batch in one call: `pick_rows(logits [N, V], step)`
    -> long [N] on the logits' device, as tensor ops (no per-sequence Python, no host sync). `num_rows`
    is N. The engine's seeded draft sampler is one (`deepinfer.engine.drafting.DraftRowSampler`); it
    also has `static_sampling()`, its rows as the sampled draft graph takes them (a
    `runtime.draft_sampling.DraftSampling`, or None where it cannot: `PagedRunner.draft`)."""

    num_rows: int

    def pick_rows(self, logits: torch.Tensor, step: int) -> torch.Tensor: ...


# (draft block index, its weights, normed input rows [T, H]) -> MoE output rows [T, H]
MoEFn = Callable[[int, BlockWeights, torch.Tensor], torch.Tensor]


@dataclass
class DraftOutput:
    """One drafted block: `tokens` [Bd], `logits` [Bd, V] FP32 (after the Markov correction),
    `confidence` [Bd] in (0, 1), `hidden` [Bd, H] (pre-norm final hidden), `positions` [Bd].
    `logits` and `hidden` are None from a draft CUDA graph (`runtime.draft_graphs`, asked for
    with `PagedRunner.draft(..., tokens_only=True)`); `probs` [Bd, V] float64 is q of a sampled row of
    such a draft (the distribution each draft was drawn from), None everywhere else (an eager draft's
    sampler keeps its q itself)."""

    tokens: torch.Tensor
    logits: torch.Tensor | None
    confidence: torch.Tensor
    hidden: torch.Tensor | None
    positions: torch.Tensor
    probs: torch.Tensor | None = None


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
    # (every processed token, a whole prefill chunk: the norm through the registry, its kernel on the GPU)
    projected = linear(features, w.main_proj, act_dtype, narrow=True)
    m = model_calls.rms_norm(projected, w.main_norm, eps, act_dtype)
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
    moe_fn: MoEFn | None = None,
) -> DraftOutput:
    """Draft `num_draft_tokens` tokens after `next_token` (at `last_position + 1`): `draft_blocks` for
    one sequence.

    `keys_main` [Ld, >= last_position + 1, D] are the main keys of positions 0..last_position (§7.2);
    each block attends to the last `W` of them plus the block's own draft keys.
    """
    a = last_position
    window = keys_main[:, None, max(0, a - cfg.sliding_window + 1) : a + 1]  # [Ld, 1, L, D]
    (out,) = draft_blocks(
        cfg,
        w,
        embed,
        head,
        window,
        [next_token],
        [a],
        num_draft_tokens,
        sampler,
        temperatures,
        act_dtype,
        kvq,
        moe_fn,
    )
    return out


def key_layout(
    last: torch.Tensor, window: int, width: int, bd: int, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns [N, span] into `cat(windows [N, width], draft keys [N, bd])`, visible [N, span]) of each
    sequence's key set, on `last`'s device without a host read: positions lo .. last + bd (lo = last -
    min(last + 1, window) + 1; the window, then the block's own keys, in position order) starting at
    column 0, or, in batch-invariant mode, at column lo mod KEY_TILE of whole key tiles aligned to
    absolute positions (a key's tile column depends on its position only). Other columns re-read window
    column 0 (a real, finite key) and are invisible: their scores are -inf, so they add exact zeros to
    the softmax and P.V. `span` must cover every sequence: the eager draft passes its batch's own
    (`_batch_span`), the graph-safe one a span fixed by the model (`_fixed_span`)."""
    lens = torch.clamp(last + 1, max=window)
    lo, hi = last - lens + 1, last + bd + 1
    start = lo - lo % batch_invariant.KEY_TILE if batch_invariant.enabled() else lo
    pos = start[:, None] + torch.arange(span, device=last.device)[None, :]
    lo, last, hi = lo[:, None], last[:, None], hi[:, None]
    win, own = (pos >= lo) & (pos <= last), (pos > last) & (pos < hi)
    zero = torch.zeros((), dtype=pos.dtype, device=pos.device)
    cols = torch.where(win, pos - lo, torch.where(own, width + pos - last - 1, zero))
    return cols, win | own


def _batch_span(last: np.ndarray, window: int, bd: int) -> int:
    """Key columns `key_layout` needs for these sequences (host positions): the longest key set, or in
    batch-invariant mode the whole aligned tiles that cover every sequence's."""
    lo, hi = last - np.minimum(last + 1, window) + 1, last + bd + 1
    if batch_invariant.enabled():
        return batch_invariant.aligned_span(lo, hi)[1]
    return int((hi - lo).max())


def _fixed_span(window: int, bd: int) -> int:
    """Key columns enough for any sequence (graph-safe: no host positions): window + bd, or in
    batch-invariant mode the whole tiles of window + bd + KEY_TILE - 1 columns (any alignment of lo)."""
    if batch_invariant.enabled():
        return batch_invariant.key_tiles(window + bd + batch_invariant.KEY_TILE - 1)
    return window + bd


def draft_blocks_static(
    cfg: DeepseekV41Config,
    w: DrafterWeights,
    embed: torch.Tensor,
    head: torch.Tensor,
    windows: torch.Tensor,
    next_tokens: torch.Tensor,
    last_positions: torch.Tensor,
    num_draft_tokens: int,
    temperatures: torch.Tensor,
    act_dtype: torch.dtype = torch.float32,
    kvq: KVQuant = EXACT_KV,
    moe_fn: MoEFn | None = None,
    pick: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draft_blocks` with a greedy sampler (or the graph-safe row sampler `pick`), graph-safe: every input a
    device tensor, every shape fixed by N, Bd and the model, no host sync (CUDA-graph capturable). `windows`
    [Ld, N, W, D]: sequence k's main keys of positions `last_k - L_k + 1 .. last_k` in columns `0 .. L_k - 1`
    (L_k = min(last_k + 1, W)), later columns finite (never read); `next_tokens`, `last_positions` long [N];
    `temperatures` [Bd] (device). -> (tokens long [N, Bd], FP32 logits [N, Bd, V], FP32 confidence [N, Bd],
    hidden [N, Bd, H], positions long [N, Bd]), each row bitwise `draft_blocks`' (greedy) for the sequence
    (the layout differs only in masked padding columns, `_fixed_span`; batch-invariant mode computes every key
    tile product instead of a host-planned subset). `pick(logits [N, V], s)` -> [N] (a `RowSampler.pick_rows`
    without host syncs) replaces the argmax of every row."""
    bd, W = num_draft_tokens, cfg.sliding_window
    n = next_tokens.shape[0]
    if windows.dim() != 4 or windows.shape[1] != n or windows.shape[2] != W or last_positions.shape != (n,):
        raise ValueError(
            f"draft_blocks_static: windows [Ld, N, W={W}, D] ({tuple(windows.shape)}) and last_positions "
            f"[N] ({tuple(last_positions.shape)}) must hold one entry per next token (N = {n})"
        )
    cols, visible = key_layout(last_positions, W, W, bd, _fixed_span(W, bd))
    positions = last_positions[:, None] + 1 + torch.arange(bd, device=last_positions.device)[None, :]
    temps = temperatures.to(torch.float32).expand(bd)
    tokens, logits, conf, hidden = draft_rows(
        cfg,
        w,
        embed,
        head,
        windows,
        next_tokens,
        positions.reshape(-1),
        cols,
        visible,
        bd,
        _greedy_rows if pick is None else pick,
        temps,
        act_dtype,
        kvq,
        moe_fn,
        all_tiles=True,
    )
    return tokens, logits, conf, hidden, positions


def draft_blocks(
    cfg: DeepseekV41Config,
    w: DrafterWeights,
    embed: torch.Tensor,
    head: torch.Tensor,
    windows: torch.Tensor,
    next_tokens: Sequence[int] | torch.Tensor,
    last_positions: Sequence[int],
    num_draft_tokens: int,
    sampler: Sampler | Sequence[Sampler] | RowSampler = greedy,
    temperatures: torch.Tensor | float = 1.0,
    act_dtype: torch.dtype = torch.float32,
    kvq: KVQuant = EXACT_KV,
    moe_fn: MoEFn | None = None,
) -> list[DraftOutput]:
    """One drafted block per sequence, every sequence in one forward: `num_draft_tokens` tokens after
    `next_tokens[k]` (at `last_positions[k] + 1`) for each of N sequences.

    `windows` [Ld, N, >= L_k, D]: sequence k's main keys of positions `last_k - L_k + 1 .. last_k` in
    columns `0 .. L_k - 1`, with `L_k = min(last_k + 1, W)` (the last `W` main keys, §7.2); later
    columns (padding to the longest window) must be finite and are never read. `sampler`: one per
    sequence (a list), or one callable for all, then called step by step for every sequence (draft s
    of every sequence before draft s + 1), so it must keep no state across sequences (greedy and
    keyed samplers do not); `sampler(logits, s)` gets one sequence's FP32 logits [V] of draft s.
    `moe_fn(block_index, block, y)` replaces the draft blocks' MoE (e.g. expert parallel).

    Rows are flattened sequence-major ([N * Bd]): every projection, the MoE, the mHC and the heads run
    on all of them at once; only attention mixes rows, and it stays per sequence: each sequence's key
    set (its window and its own block) is laid out in its own row of a padded [N, S, D] tensor, the
    padding masked (`key_layout`). Exact numerics: each row's values are those `draft_block` gets for
    the sequence alone (FP64 accumulation rounded once: only FP64 summation orders depend on the batch);
    batch-invariant mode: bitwise independent of the batch (row-invariant GEMMs, aligned key tiles).
    """
    W = cfg.sliding_window
    n, bd, dev = len(last_positions), num_draft_tokens, embed.device
    last = np.asarray(last_positions, dtype=np.int64).reshape(-1)
    if len(next_tokens) != n or windows.dim() != 4 or windows.shape[1] != n:
        raise ValueError(
            f"draft_blocks: next_tokens ({len(next_tokens)}) and windows [Ld, N, L, D] "
            f"({tuple(windows.shape)}) must hold one entry per last position ({n})"
        )
    rows_sampler = getattr(sampler, "pick_rows", None)
    if rows_sampler is not None and sampler.num_rows != n:
        raise ValueError(f"draft_blocks: the row sampler drafts {sampler.num_rows} rows, not {n} sequences")
    samplers = list(sampler) if isinstance(sampler, Sequence) else None
    if samplers is not None and len(samplers) != n:
        raise ValueError(f"draft_blocks: got {len(samplers)} samplers for {n} sequences (one per sequence)")
    lens = np.minimum(last + 1, W)
    if n == 0:
        return []
    if last.min() < 0 or windows.shape[2] < lens.max():
        raise ValueError(
            f"draft_blocks: last positions must be >= 0 and windows must hold min(last + 1, {W}) keys "
            f"(got last {last.tolist()}, {windows.shape[2]} columns)"
        )
    span = _batch_span(last, W, bd)
    cols, visible = key_layout(torch.as_tensor(last, device=dev), W, windows.shape[2], bd, span)  # [N, S]
    positions = torch.as_tensor(last[:, None] + 1 + np.arange(bd)[None, :], device=dev).reshape(-1)
    first = torch.as_tensor(next_tokens, dtype=torch.long, device=dev)
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=dev).expand(bd)
    if samplers is None and sampler is greedy:
        pick = _greedy_rows
    elif rows_sampler is not None:
        pick = rows_sampler
    else:

        def pick(logits, s):
            # an int sampler (e.g. the engine's seeded one) costs one host-to-device copy per sequence
            # and draft step; a tensor sampler none
            picks = [(samplers[k] if samplers else sampler)(logits[k], s) for k in range(n)]
            return torch.stack([torch.as_tensor(t, dtype=torch.long, device=dev).reshape(()) for t in picks])

    tokens_all, logits_all, conf_all, hidden = draft_rows(
        cfg, w, embed, head, windows, first, positions, cols, visible, bd, pick, temps, act_dtype, kvq, moe_fn
    )
    positions = positions.view(n, bd)
    return [
        DraftOutput(
            tokens=tokens_all[k],
            logits=logits_all[k],
            confidence=conf_all[k],
            hidden=hidden[k],
            positions=positions[k],
        )
        for k in range(n)
    ]


def _greedy_rows(logits: torch.Tensor, step: int) -> torch.Tensor:
    """Every row's `greedy` in one call: [N, V] -> [N] (lowest id on ties)."""
    return torch.argmax(logits, dim=-1)


def draft_rows(
    cfg: DeepseekV41Config,
    w: DrafterWeights,
    embed: torch.Tensor,
    head: torch.Tensor,
    windows: torch.Tensor,
    first: torch.Tensor,
    positions: torch.Tensor,
    cols: torch.Tensor,
    visible: torch.Tensor,
    bd: int,
    pick: Callable[[torch.Tensor, int], torch.Tensor],
    temps: torch.Tensor,
    act_dtype: torch.dtype,
    kvq: KVQuant,
    moe_fn: MoEFn | None,
    all_tiles: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batched draft forward on device inputs (shared by the eager `draft_blocks` and the graph-safe
    `draft_blocks_static`): `first` [N] the next tokens, `positions` [N * Bd], the key layout `cols` /
    `visible` [N, S] into `cat(windows[i] [N, width], draft keys [N, Bd])`, `pick(logits [N, V], s)`
    -> [N] draft s of every row, `temps` [Bd] confidence temperatures. `all_tiles` (batch-invariant
    mode): every key tile product instead of a host-planned subset (the skipped products are exact +0,
    so the bits are the same; `batch_invariant.sink_attention`). -> (tokens [N, Bd], FP32 logits
    [N, Bd, V], FP32 confidence [N, Bd], hidden [N, Bd, H])."""
    ds, eps = cfg.dspark, cfg.rms_norm_eps
    n, dev = first.shape[0], embed.device
    rows_n = torch.arange(n, device=dev)[:, None]
    tokens = torch.full((n, bd), ds.noise_token_id, dtype=torch.long, device=dev)
    tokens[:, 0] = first
    cos, sin = cos_sin(cfg.main_rope(), positions)
    nh, d = cfg.num_attention_heads, cfg.head_dim
    invariant = batch_invariant.enabled()
    plan = None
    if invariant:
        visible = visible[:, None, :].expand(n, bd, -1)
        if not all_tiles:
            plan = batch_invariant.plan_attention(visible, nh)
    hc = ShiftedHC(embed[tokens.reshape(-1)].to(carrier()), cfg)
    for i, blk in enumerate(w.blocks):

        def attention(y, blk=blk, i=i):
            q, _ = project_query(y, blk.attn, nh, cos, sin, eps, False, act_dtype)
            kd = kvq.swa(project_latent(y, blk.attn, cos, sin, eps, act_dtype))  # FP8 ring, like main keys
            own = torch.cat((windows[i].to(kd.dtype), kd.view(n, bd, -1)), dim=1)
            keys = own[rows_n, cols]  # [N, S, D]: each sequence's window and block (bidirectional)
            if invariant:
                o = batch_invariant.sink_attention(
                    q.view(n, bd, nh, d), keys, visible, blk.attn.sinks, d**-0.5, all_tiles, plan=plan
                )
            else:  # a sequence's Bd queries folded into its heads: one key set per sequence
                sinks = blk.attn.sinks.repeat(bd)
                o = sink_attention(q.view(n, bd * nh, d), keys, visible, sinks, d**-0.5, act_dtype)
            o = o.reshape(n * bd, nh, d)
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
    base, hidden = base.view(n, bd, -1), hidden.view(n, bd, -1)
    out_tokens, out_logits, out_conf = [], [], []
    prev = first  # the next tokens, already on the device
    for s in range(bd):  # sequential only through the Markov term: the drafted token feeds the next step
        logits, e = markov_correction(base[:, s], prev, w.markov, act_dtype)  # [N, V]
        out_conf.append(confidence(hidden[:, s], e, w.confidence_proj, temps[s]))
        prev = pick(logits, s)
        out_tokens.append(prev)
        out_logits.append(logits)
    tokens_all = torch.stack(out_tokens, dim=1)  # [N, Bd]
    logits_all = torch.stack(out_logits, dim=1).float()  # [N, Bd, V]
    conf_all = torch.stack(out_conf, dim=1).float()
    return tokens_all, logits_all, conf_all, hidden

"""Batched (padded) views of a step's sequences, so attention runs per group of sequences, not per sequence.

Sequences are bucketed by query length (decodes with decodes, verification blocks with each other,
similar prefill chunks together); a group's queries are padded to its longest, its key sets to its
longest context, and attention is one batched computation per group. Every gather below is one
vectorised numpy / torch indexing operation: the Python work per layer is per group, never per token
or per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import batch_invariant
from ..config import RopeSpec
from ..layers.compressor import CompressorWeights, compress
from ..layers.indexer import selection_mask
from ..layers.rope import apply_rope, cos_sin
from ..numerics import attention_operands, bmm_f32, bmm_operand, carrier, narrow_act, native, round_to
from ..ops.model_calls import fused_kernel
from ..runtime.metadata import StepMetadata
from ..runtime.pools import PagedKVCache
from ..runtime.step_view import StepView

SCORE_BLOCK_ELEMENTS = 1 << 27  # FP64 attention scores held at once by `attend` (1 GiB)
# Query rows per sliding-window block in `attend` (at least this many, at least twice the window): a block
# of B query slots scores B + W - 1 keys, so the band costs (B + W - 1) / W of the ideal W keys per query
# while long chunks take few blocks (each block is a dozen tensor ops of host overhead).
BAND_BLOCK_ROWS = 64


# Elements of one query-shaped tensor (queries and outputs [rows, heads, head_dim], index scores and masks
# [rows, entries]) an attention layer holds at once: a step with more rows runs the query side of attention
# per block of rows (`row_blocks`). A 64k-token prefill chunk of the real head shape (64 x 512) would
# otherwise hold several 8 GiB FP32 query tensors per layer and [T, T] index scores at ratio 1.
QUERY_BLOCK_ELEMENTS = 1 << 28


def query_block_rows(meta: StepMetadata, heads: int, head_dim: int, min_ratio: int | None) -> int:
    """Rows per query block for this step: the query row ([heads, head_dim]) or the entry row a query of
    the longest sequence may score (compressed at `min_ratio`, None: no compressed layer) is the width."""
    widest = heads * head_dim
    if min_ratio and meta.num_seqs:
        widest = max(widest, int(meta.ends.max()) // min_ratio)
    return max(1, QUERY_BLOCK_ELEMENTS // widest)


def row_blocks(meta: StepMetadata, rows: int | None) -> list[tuple[int, int, StepMetadata, list[Group]]]:
    """(first row, end row, metadata, groups) of each query block of `meta`'s packed rows: the whole step
    (its own groups) when it has at most `rows` rows (None: always), else consecutive blocks of `rows`
    rows as `StepMetadata.row_block` steps. The query side of attention runs per block once every row's
    keys are in the pools; build them once per step (their index tensors are shared by every layer)."""
    n = int(meta.offsets[-1])
    step = n if rows is None else max(1, rows)
    spans = [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]
    metas = [meta] if len(spans) == 1 else [meta.row_block(lo, hi) for lo, hi in spans]
    return [(lo, hi, m, make_groups(m)) for (lo, hi), m in zip(spans, metas, strict=True)]


def ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten the integer ranges [lo[k], hi[k]) -> (range index of each element, element value)."""
    n = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(len(lo)), n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return owner, lo[owner] + within


@dataclass
class Group:
    """Sequences attended together, queries padded to the longest: row-major [G, Q] query slots.

    A padding slot repeats its sequence's last real query (same row, same position), so everything
    computed for it is a finite duplicate that is simply never written back.
    """

    seqs: np.ndarray  # sequence indices in the step
    rows: torch.Tensor  # long [G, Q] packed row of each query slot
    qmask: torch.Tensor  # bool [G, Q] real query slots
    q_pos: torch.Tensor  # long [G, Q] absolute positions
    index: int = 0  # the group's number in its step (keys the step's cached index tensors)
    # Integer forms of `qmask`, built on the host: indexing a device tensor with a boolean mask costs a
    # nonzero() and a host sync per call (several per layer); an index tensor sent once per step does not.
    packed_rows: torch.Tensor | None = None  # long [n] packed rows of the real slots, [G, Q] row-major
    real_slots: torch.Tensor | None = None  # long [n] flat [G*Q] index of the real slots; None: no padding
    host_q_pos: np.ndarray | None = None  # int64 [G, Q] `q_pos` on the host (band masks are built there)
    # `packed_rows` is exactly 0 .. N-1 for the step's N rows (one group holding every row, sequences in row
    # order: a prefill chunk of one sequence, or equal chunks; padding slots may still exist, `real_slots`):
    # per-group outputs (`real`) are then the step's rows as they are, no scatter into a step-sized buffer
    # (a 1 GiB index_put per layer in a 16k-token prefill)
    covers_step: bool = False

    @property
    def slot_rows(self) -> torch.Tensor:
        """Packed row of every query slot, padding included: long [G*Q]."""
        return self.rows.reshape(-1)

    def real(self, x: torch.Tensor) -> torch.Tensor:
        """The real query slots of `x` [G*Q, ...] (every slot, row-major), in `packed_rows` order."""
        return x if self.real_slots is None else x[self.real_slots]


def make_groups(meta: StepMetadata) -> list[Group]:
    """Bucket sequences by query length (lengths in (2^(k-1), 2^k] share a bucket), so padding at most
    doubles a group's query slots: decodes batch with decodes, equal prefill chunks with each other."""
    active = np.flatnonzero(meta.query_lens > 0)  # a sequence with no query tokens attends to nothing
    bucket = np.ceil(np.log2(meta.query_lens[active])).astype(np.int64)
    groups = []
    for k in np.unique(bucket):
        seqs = active[bucket == k]
        qlen = meta.query_lens[seqs]
        slot = np.arange(int(qlen.max()))[None, :]
        host_rows = meta.offsets[seqs][:, None] + np.minimum(slot, qlen[:, None] - 1)
        rows = meta.dev(host_rows)
        host_mask = slot < qlen[:, None]
        real = np.flatnonzero(host_mask.reshape(-1))
        padded = len(real) < host_mask.size
        host_q_pos = None if meta.host_positions is None else meta.host_positions[host_rows]
        groups.append(
            Group(
                seqs,
                rows,
                meta.dev(host_mask),
                meta.positions[rows],
                len(groups),
                packed_rows=meta.dev(host_rows.reshape(-1)[real]) if padded else rows.reshape(-1),
                real_slots=meta.dev(real) if padded else None,
                host_q_pos=host_q_pos,
                covers_step=_covers_step(host_rows.reshape(-1)[real], int(meta.offsets[-1])),
            )
        )
    return groups


def _covers_step(packed: np.ndarray, n_rows: int) -> bool:
    """Whether packed rows `packed` are 0 .. n_rows - 1 in order (host arrays: no device work)."""
    return packed.shape[0] == n_rows and bool((packed == np.arange(n_rows)).all())


@dataclass
class WindowKeys:
    """A group's sliding-window keys, as `swa_keys` reads them.

    Default layout (`visible` None): column c of sequence i holds position `base[i] + c`, with
    `base = start - window + 1` the same offset for every sequence, so query slot s (nominal position
    start + s) sees exactly columns s .. s + window - 1 and a block of B query slots sees B + window - 1
    contiguous columns: `attend` scores only that band, O(Q * window) instead of O(Q * (Q + window)).
    Columns outside [max(base, 0), end) re-read a stored key and are never visible.

    Batch-invariant layout (`visible` set): whole aligned key tiles and the full [G*Q, S] mask, for
    `batch_invariant.sink_attention`.
    """

    keys: torch.Tensor  # [G, S, D]
    window: int
    visible: torch.Tensor | None = None  # bool [G*Q, S], batch-invariant layout only
    index_key: tuple = ()  # keys the step's cached band masks (group, window, floor)
    base: np.ndarray | None = None  # int64 [G] position of column 0 (default layout)
    low: np.ndarray | None = None  # int64 [G] lowest visible position: max(0, floor)


def swa_keys(
    cache: PagedKVCache, meta: StepView, g: Group, pool: str, window: int, floor: np.ndarray | None = None
) -> WindowKeys:
    """Each query's sliding window of keys, read from `pool` (see `WindowKeys` for the layout).

    `floor` [G] (YOCO truncation): no key below it is visible; those keys may never have been stored, so
    they are zeroed (a masked key must still be finite: attention multiplies it by a zero probability).
    """
    if window < 1:
        raise ValueError(f"sliding window = {window} must be >= 1")
    # index tensors depend on the group, window and floor only: built and sent once per step, reused by
    # every layer of that window
    key = ("swa", g.index, window, floor is not None)
    slots, visible, below, base, low = meta.cached(key, lambda: _swa_index(meta, g, window, floor))
    keys = cache.read(pool, slots)
    if below is not None:
        # zero by the position actually read: padding columns re-read position hi - 1, which may lie
        # below the floor (never stored) even where the column's nominal position does not
        keys = keys.masked_fill(below, 0.0)
    return WindowKeys(mark_pool_values(cache, pool, keys), window, visible, key, base, low)


def mark_pool_values(cache: PagedKVCache, pool: str, x: torch.Tensor) -> torch.Tensor:
    """`x` (read from `pool`, zeros filled in) marked FP32-valued where the pool holds FP32 or narrower
    floats: batch-invariant mode's exact-product score paths (`batch_invariant.row_scores`) need that and
    checking every key would cost what they save."""
    dtype = cache.pools[pool].dtype
    if batch_invariant.enabled() and dtype.is_floating_point and dtype.itemsize <= 4:
        batch_invariant.mark_fp32_valued(x)
    return x


def _swa_index(meta: StepMetadata, g: Group, window: int, floor: np.ndarray | None):
    lo = np.maximum(meta.starts[g.seqs] - window + 1, 0)
    hi = meta.ends[g.seqs]
    low = lo if floor is None else np.maximum(lo, np.asarray(floor, dtype=np.int64))
    if batch_invariant.enabled():  # whole key tiles aligned to absolute positions (a key's column is fixed)
        start, width = batch_invariant.aligned_span(lo, hi)
    else:  # the band layout: same column offset for every sequence (see `WindowKeys`)
        start, width = meta.starts[g.seqs] - window + 1, g.rows.shape[1] + window - 1
    # columns below lo (alignment, band) or from hi (padding) are invisible; they re-read a stored key
    pos = np.clip(start[:, None] + np.arange(width)[None, :], lo[:, None], hi[:, None] - 1)
    slots = meta.dev(meta.token_slots_of(g.seqs[:, None], pos))
    below = None if floor is None else meta.dev(pos < np.asarray(floor, dtype=np.int64)[:, None])[..., None]
    if not batch_invariant.enabled():
        return slots, None, below, start, low
    k_pos = meta.dev(start[:, None] + np.arange(width)[None, :])[:, None, :]
    q_pos = g.q_pos[:, :, None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # k_pos <= q_pos < hi also drops padding
    if floor is not None:
        visible = visible & (k_pos >= meta.dev(np.asarray(floor, dtype=np.int64)[:, None])[:, :, None])
    return slots, visible.reshape(-1, width), below, start, low


def _band_mask(meta: StepView, g: Group, wk: WindowKeys, a: int, b: int) -> torch.Tensor:
    """bool [G, b, 1, b + W - 1]: which of the band columns a .. a + b + W - 2 query slots a .. a + b - 1
    see (their window, at or above the floor; padding slots sit at their sequence's last position, so
    they may see none: their rows are finite and never written back). Built on the host, once per step."""

    def make():
        kp = wk.base[:, None] + a + np.arange(b + wk.window - 1)[None, :]  # [G, C] key positions
        # (metadata without host copies: read the positions back once)
        host_q = g.host_q_pos if g.host_q_pos is not None else g.q_pos.cpu().numpy()
        qp = host_q[:, a : a + b, None]  # [G, b, 1]
        vis = (kp[:, None, :] <= qp) & (kp[:, None, :] > qp - wk.window) & (kp >= wk.low[:, None])[:, None, :]
        return meta.dev(vis[:, :, None, :])

    return meta.cached(("band", *wk.index_key, a, b), make)


def compressed_entries(cache: PagedKVCache, meta: StepView, g: Group, pool: str, ratio: int):
    """(entries [G, n, d], valid [G*Q, n]): every entry each sequence has after this step; entry j is
    valid for a query at p iff j < (p + 1) // ratio (its block is complete). Padding entries are zero
    (a masked key must still be finite: attention multiplies it by a zero probability)."""
    slots, padding, valid = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))
    return mark_pool_values(cache, pool, cache.read(pool, slots).masked_fill(padding, 0.0)), valid


def _entry_index(meta: StepMetadata, g: Group, ratio: int):
    n = meta.ends[g.seqs] // ratio
    width = batch_invariant.key_tiles(n.max()) if batch_invariant.enabled() else max(int(n.max()), 1)
    j = np.arange(width)[None, :]
    safe_j = np.minimum(j, np.maximum(n[:, None] - 1, 0))
    slots = meta.dev(meta.entry_slots_of(g.seqs[:, None], safe_j, ratio))
    padding = meta.dev(j >= n[:, None])[..., None]
    valid = torch.arange(width, device=meta.device)[None, None, :] < torch.div(
        g.q_pos[:, :, None] + 1, ratio, rounding_mode="floor"
    )
    return slots, padding, valid.reshape(-1, width)


def _own_columns(selected: torch.Tensor, gq: tuple[int, int]):
    """Batch-invariant mode: where each query slot's own keys come from, for a group [G, Q] and its
    top-k selection [G*Q, k] (-1 = none): (entry index [G*Q, Ko] in `own_order`, 0 where none; none
    bool [G*Q, Ko]; each slot's sequence [G*Q, 1])."""
    order = batch_invariant.own_order(selected)
    seq = torch.arange(gq[0], device=selected.device).repeat_interleave(gq[1])[:, None]
    return order.clamp(min=0), order < 0, seq


def own_entries(entries: torch.Tensor, selected: torch.Tensor, gq: tuple[int, int]):
    """Batch-invariant mode: the own keys of each query slot of a group [G, Q] from its entries [G, n, D]
    and top-k selection [G*Q, k] (-1 = none): the selected entries in `own_order`, zero where none ->
    (keys [G*Q, Ko, D], visible bool [G*Q, Ko]), marked FP32-valued where `entries` is."""
    j, none, seq = _own_columns(selected, gq)
    keys = entries[seq, j].masked_fill_(none[..., None], 0.0)  # (a gathered copy)
    if batch_invariant.marked_fp32_valued(entries):
        batch_invariant.mark_fp32_valued(keys)
    return keys, ~none


def selected_entries(cache: PagedKVCache, meta: StepView, g: Group, pool: str, ratio: int, selected):
    """`own_entries` read from `pool` directly (only the selected entries, not every entry of the group):
    the same values, since an entry is read from the same slot. `selected` [G*Q, k] per query slot; the
    graph-safe step (one query per row) maps entries to slots on the device."""
    j, none, seq = _own_columns(selected, g.rows.shape)
    if meta.graph_safe:
        slots = meta.dev_entry_slots(j, ratio)
    else:
        entry_slots = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))[0]  # [G, n]
        slots = entry_slots[seq, j]
    keys = cache.read(pool, slots).masked_fill_(none[..., None], 0.0)  # (read returns a gathered copy)
    return mark_pool_values(cache, pool, keys), ~none


def invariant_selection(
    cache: PagedKVCache, meta: StepView, g: Group, pool: str, ratio: int, selected: torch.Tensor
):
    """Batch-invariant mode: the top-k selected entries of a group's query slots (`selected` [G*Q, k])
    laid out by how many entries each slot can see, a function of the slot alone (so its bits do not
    depend on its neighbours): at most `batch_invariant.SHARED_ENTRY_COLS` -> columns of its sequence's
    first entry tiles, shared by the sequence's queries (`attend`'s bool `extra`); more -> its own keys
    (`selected_entries`, `attend`'s `own`). Why both: a short-context prefill chunk's queries share a few
    entry tiles (one read), where own keys would copy k entries per query (measured on the CPU: +17% per
    64-token prefill step at batch 8 with own keys only, +13% with this layout); a long context's query
    sees hundreds of entries of which it selected k. A query's part in the layout it does not use is all
    invisible: +0 partials and -inf scores, which change no bit. -> (extra or None, own or None), extra =
    (entry tiles, bool selected, bool selectable: a superset `attend` plans the tiles from). The threshold
    depends on the device (`batch_invariant.shared_entry_cols`: off the CPU, own keys only); where it is
    not 0 the graph-safe step always gets both (fixed shapes)."""
    static = meta.graph_safe
    cols = batch_invariant.shared_entry_cols(selected.device)
    if cols == 0:  # every query takes own keys
        return None, selected_entries(cache, meta, g, pool, ratio, selected)
    valid = entry_validity(meta, g, ratio)  # [G*Q, width]
    if static:  # one query per row: its sequence's entries are the ones it sees
        short = valid.sum(dim=-1) <= cols
        any_short = any_long = True
    else:  # decided on the host (no device sync): a slot at p sees (p + 1) // ratio entries

        def make():  # once per step and group (every layer of this ratio shares it)
            host_q = g.host_q_pos if g.host_q_pos is not None else g.q_pos.cpu().numpy()
            host_short = (host_q.reshape(-1) + 1) // ratio <= cols
            return bool(host_short.any()), not bool(host_short.all()), meta.dev(host_short)

        any_short, any_long, short = meta.cached(("bi_short", g.index, ratio, cols), make)
    extra = own = None
    if any_short:
        width = min(valid.shape[1], cols)
        if static:
            j = torch.arange(width, device=valid.device).expand(valid.shape[0], width)
            slots, padding = meta.dev_entry_slots(j, ratio), ~valid[:, :width, None]
        else:
            slots, padding, _ = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))
            slots, padding = slots[:, :width], padding[:, :width]
        keys = mark_pool_values(cache, pool, cache.read(pool, slots).masked_fill_(padding, 0.0))
        seen = selection_mask(torch.where(short[:, None], selected, -1), width)
        # what a short slot may select (known on the host): `attend` plans its tiles from it once per step,
        # so the selection itself is never read back (a device sync per layer on the GPU)
        if static:  # (computes every tile: no plan)
            extra = (keys, seen)
        else:
            may = meta.cached(("bi_may", g.index, ratio, cols), lambda: valid[:, :width] & short[:, None])
            extra = (keys, seen, may)
    if any_long:
        keys, visible = selected_entries(cache, meta, g, pool, ratio, selected)
        own = (keys, visible & ~short[:, None])
    return extra, own


def entry_validity(meta: StepView, g: Group, ratio: int) -> torch.Tensor:
    """The `valid` [G*Q, n] of `compressed_entries` without reading the entries."""
    return meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))[2]


def attend(
    q: torch.Tensor,
    swa: WindowKeys,
    g: Group,
    sinks,
    scale,
    meta: StepView,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    act_dtype: torch.dtype = torch.float32,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sink attention (as `layers.attention.sink_attention`, batched over the group's sequences) over each
    query's sliding window `swa` plus, if given, `extra` = (entries [G, n, D] shared by a sequence's
    queries, which of them each query sees): either a bool mask [G*Q, n] (every visible entry is scored)
    or a long top-k selection [G*Q, k] of entry indices, -1 = none (only the k selected entries are
    gathered and scored). Packed `q` [N, nh, D] -> FP64 [rows, nh, D] for `g.packed_rows`.

    Default path: query blocks of b slots score only the b + W - 1 band columns they can see, plus the
    entries (or their selection). Invisible keys got exactly zero probability before, so each row's
    softmax and weighted sum hold the same nonzero terms as a score over every key (summed in another
    order: FP64 rounding only).

    Batch-invariant mode: `batch_invariant.sink_attention` over the window's aligned key tiles and, for a
    bool `extra`, the entry tiles; a top-k `extra` becomes each query slot's own keys (`own_entries`), or
    `own` (keys [G*Q, Ko, D], visible bool [G*Q, Ko], from `invariant_selection`) gives them directly
    (with or without a bool `extra`: `invariant_selection` lays short contexts out as entry tiles).

    Native mode: FP32 [rows, nh, D]; the score and P.V products take `attention_operands(act_dtype)`
    operands (BF16 for BF16 activations: q and the keys already hold BF16 values, P is rounded to BF16)
    with FP32 accumulation, the softmax and sink stay FP32 (as `layers.attention.sink_attention`).
    """
    gq = g.rows.shape
    if extra is not None and extra[1].dtype != torch.bool and extra[1].dtype != torch.long:
        raise ValueError(
            f"attend: extra visibility must be a bool mask or long indices, got {extra[1].dtype}"
        )
    if own is not None and not batch_invariant.enabled():
        raise ValueError("attend: own keys are the batch-invariant layout of a top-k selection")
    if batch_invariant.enabled():  # keys laid out in aligned tiles by swa_keys / compressed_entries
        keys, visible = swa.keys, swa.visible
        if extra is not None and extra[1].dtype == torch.long:  # a top-k selection: each slot's own keys
            own, extra = own_entries(extra[0], extra[1], gq), None
        plan_source = None  # (a superset of `visible` the tile plan is built from, its cache id)
        if extra is not None:
            fp32 = batch_invariant.marked_fp32_valued(keys) and batch_invariant.marked_fp32_valued(extra[0])
            keys = torch.cat((keys, extra[0]), dim=1)
            if fp32:
                batch_invariant.mark_fp32_valued(keys)
            if len(extra) == 3:  # (entries, selected, selectable): plan from the selectable superset
                window_vis = visible
                plan_source = (lambda: torch.cat((window_vis, extra[2]), dim=1).view(*gq, -1), extra[2])
            visible = torch.cat((visible, extra[1]), dim=1)
        visible = visible.view(*gq, -1)
        plan = None
        all_tiles = False
        q_rows = q[g.rows]
        if batch_invariant.marked_fp32_valued(q):  # (rounded to FP32 / BF16: no test of every value)
            batch_invariant.mark_fp32_valued(q_rows)
        if gq[1] == 1 and batch_invariant.exact_scores_apply(q_rows, keys):
            pass  # decode: `sink_attention` takes its one-query path, which needs no tile plan
        elif meta.graph_safe:
            # the graph-safe step plans nothing on the host: every tile product is computed (the
            # skipped ones of a plan are exact +0 partials, so the bits are the eager step's)
            all_tiles = True
        else:
            # which key tiles each row tile sees: the same for every layer with this window and these
            # entries, so planned once per step (the entry mask is kept in the entry, so its id is not
            # reused by another tensor while the entry lives)
            if plan_source is not None:
                make_vis, held_by = plan_source
            else:
                make_vis, held_by = (lambda: visible), (None if extra is None else extra[1])
            held, plan = meta.cached(
                ("bi_plan", *swa.index_key, None if held_by is None else id(held_by), q.shape[1]),
                lambda: (held_by, batch_invariant.plan_attention(make_vis(), q.shape[1])),
            )
            if held is not held_by:
                plan = None
            elif plan_source is not None:
                plan = plan.for_visible(visible)
        if own is not None:
            own_keys = own[0].view(*gq, *own[0].shape[1:])
            if batch_invariant.marked_fp32_valued(own[0]):
                batch_invariant.mark_fp32_valued(own_keys)
            own = (own_keys, own[1].view(*gq, -1))
        out = batch_invariant.sink_attention(
            q_rows, keys, visible, sinks, scale, plan=plan, all_tiles=all_tiles, own=own
        )
        return g.real(out.reshape(-1, *out.shape[2:]))
    if swa.visible is not None:
        raise ValueError("attend: window keys in the batch-invariant layout outside batch-invariant mode")
    kernel = _listed_kernel(q, swa, meta, extra, act_dtype)
    if kernel is not None:
        return g.real(listed_attention(kernel, q, swa, g, sinks, scale, meta, extra))
    c = carrier()
    op = attention_operands(act_dtype)
    if native():  # operands converted once per call (CPU: BF16-rounded values held in FP32, `bmm_operand`)
        operand = lambda x: bmm_operand(x, op)  # noqa: E731
        scores_of = lambda x, m: _shared_keys(x, m.transpose(1, 2))  # noqa: E731  x [G,b,h,D], m [G,S,D]
        own_scores_of = lambda x, m: _own_keys(x, m.transpose(2, 3))  # noqa: E731  m [G,b,k,D]
        # P rounded to the operand dtype, as a BF16 attention kernel feeds its P.V product
        weigh = lambda p, m: _shared_keys(operand(p), m)  # noqa: E731
        own_weigh = lambda p, m: _own_keys(operand(p), m)  # noqa: E731
    else:
        operand = lambda x: x.to(c)  # noqa: E731
        scores_of = lambda x, m: torch.einsum("gqhd,gsd->gqhs", x, m)  # noqa: E731
        own_scores_of = lambda x, m: torch.einsum("gqhd,gqkd->gqhk", x, m)  # noqa: E731
        weigh = lambda p, m: torch.einsum("gqhs,gsd->gqhd", p, m)  # noqa: E731
        own_weigh = lambda p, m: torch.einsum("gqhk,gqkd->gqhd", p, m)  # noqa: E731
    keys = operand(swa.keys)
    w = swa.window
    entries = vis_e = sel = None
    n = 0
    n_heads, dim = q.shape[1], swa.keys.shape[2]
    per_row = n_heads * (2 * w - 1)  # band scores of one query row (blocks of >= W rows)
    if extra is not None:
        entries = operand(extra[0])
        if extra[1].dtype == torch.bool:
            vis_e = extra[1].view(*gq, 1, -1)
            n = entries.shape[1]
            per_row += n_heads * n
        else:  # a top-k selection: each row gathers its k entries (k * D values) and scores them
            sel = extra[1].view(*gq, -1)
            n = sel.shape[2]
            per_row += n * (n_heads + dim)
            g_idx = torch.arange(gq[0], device=sel.device)[:, None, None]
    # block rows: at least 2W (band overhead <= 1.5x) and BAND_BLOCK_ROWS, scores within SCORE_BLOCK_ELEMENTS
    block = min(gq[1], max(BAND_BLOCK_ROWS, 2 * w))
    block = max(1, min(block, SCORE_BLOCK_ELEMENTS // max(gq[0] * per_row, 1)))
    sink = sinks.to(c)[None, None, :, None]
    outs = []
    for a in range(0, gq[1], block):
        b = min(block, gq[1] - a)
        band = keys[:, a : a + b + w - 1]  # [G, b + W - 1, D], a view
        qs = operand(q[g.rows[:, a : a + b]])  # [G, b, nh, D]
        parts = [(scores_of(qs, band) * scale).masked_fill(~_band_mask(meta, g, swa, a, b), float("-inf"))]
        if vis_e is not None:
            parts.append((scores_of(qs, entries) * scale).masked_fill(~vis_e[:, a : a + b], float("-inf")))
        elif sel is not None:
            idx = sel[:, a : a + b]  # [G, b, k]
            picked = entries[g_idx, idx.clamp(min=0)]  # [G, b, k, D]; -1 re-reads entry 0, masked below
            parts.append(
                (own_scores_of(qs, picked) * scale).masked_fill((idx < 0)[:, :, None, :], float("-inf"))
            )
        parts.append(sink.expand(gq[0], b, -1, 1))
        logits = torch.cat(parts, dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)
        cb = band.shape[1]
        o = weigh(probs[..., :cb], band)
        if vis_e is not None:
            o = o + weigh(probs[..., cb : cb + n], entries)
        elif sel is not None:
            o = o + own_weigh(probs[..., cb : cb + n], picked)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return g.real(out.reshape(-1, *out.shape[2:]))


def _listed_kernel(q, swa: WindowKeys, meta: StepView, extra, act_dtype: torch.dtype):
    """The backend's fused sparse attention for this call, or None (then the band path below runs): native
    BF16 numerics (the kernel's products), an eager step (the graph-safe step keeps its own fixed-shape
    path) and top-k selected entries or none (a visibility mask over every entry has no index list)."""
    if not native() or act_dtype != torch.bfloat16 or meta.graph_safe:
        return None
    if extra is not None and extra[1].dtype != torch.long:
        return None
    return fused_kernel("sparse_prefill_attention", q, q.shape[1], swa.keys.shape[2])


def listed_attention(
    kernel, q, swa: WindowKeys, g: Group, sinks, scale, meta: StepMetadata, extra=None
) -> torch.Tensor:
    """`attend` (default layout) as one `sparse_prefill_attention` call: the group's window keys and entries
    stacked into one key list, each query slot's visible window columns and selected entries listed as
    indices into it (-1 = none). Same scores, softmax and sink as the band path; one kernel per group
    instead of a dozen tensor ops per block of 2W rows. -> BF16 [G*Q, nh, D], every slot."""
    gs, qn = g.rows.shape
    width = swa.keys.shape[1]
    window = meta.cached(("listed_window", *swa.index_key), lambda: _window_lists(meta, g, swa))
    keys, lists = [swa.keys.reshape(gs * width, -1)], [window]
    if extra is not None:
        entries, selected = extra
        n = entries.shape[1]
        keys.append(entries.reshape(gs * n, -1))
        first = gs * width + n * torch.arange(gs, device=selected.device)  # entry 0 of each sequence
        sel = selected.view(gs, qn, -1)
        lists.append(torch.where(sel >= 0, sel + first[:, None, None], -1).view(gs * qn, -1))
    kv = torch.cat(keys).to(torch.bfloat16)
    indices = torch.cat(lists, dim=1).to(torch.int32)
    # [G*Q, nh, D]: this group's slots (a step has several groups); a group whose slots are the step's rows
    # in order (no padding) takes q as it is (the gather was a 512 MB copy per layer and row block of a
    # 16k-token chunk)
    whole = g.covers_step and g.real_slots is None
    rows = (q if whole else q[g.slot_rows]).to(torch.bfloat16)
    return kernel(
        rows, kv, indices, sinks, scale
    )  # BF16: the attention output's own rounding (callers store it)


def _window_lists(meta: StepMetadata, g: Group, wk: WindowKeys) -> torch.Tensor:
    """int32 [G*Q, W]: for each query slot the flat window-key rows (sequence i's column c at i * S + c) of
    positions p - W + 1 .. p it sees (at or above its sequence's lowest visible position), -1 elsewhere."""
    gs, width = wk.keys.shape[0], wk.keys.shape[1]
    kp = g.q_pos[:, :, None] - torch.arange(wk.window, device=g.q_pos.device)  # [G, Q, W] key positions
    base, low = meta.dev(wk.base)[:, None, None], meta.dev(wk.low)[:, None, None]
    flat = (kp - base) + width * torch.arange(gs, device=kp.device)[:, None, None]
    return torch.where(kp >= low, flat, -1).to(torch.int32).reshape(-1, wk.window)


def _shared_keys(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Native products against one matrix per sequence: x [G, b, h, i] @ m [G, i, j] -> FP32 [G, b, h, j]
    (one batched GEMM of b*h rows per sequence)."""
    gs, b, h, i = x.shape
    return bmm_f32(x.reshape(gs, b * h, i), m).view(gs, b, h, -1)


def _own_keys(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Native products against one matrix per query slot: x [G, b, h, i] @ m [G, b, i, j] -> FP32 [G, b, h, j]."""
    gs, b, h, i = x.shape
    return bmm_f32(x.reshape(gs * b, h, i), m.reshape(gs * b, i, -1)).view(gs, b, h, -1)


def grouped_index_scores(
    qi: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    g: Group,
    scaled: bool,
    act_dtype: torch.dtype = torch.float32,
    ratio: int | None = None,
):
    """Index scores [G*Q, n] (as `layers.indexer.index_scores`, batched over the group's sequences):
    packed `qi` [N, n_i, d_i] and `head_w` [N, n_i] against each sequence's index keys [G, n, d_i].
    Native mode: `q . k` on `attention_operands(act_dtype)` operands with FP32 accumulation.

    `ratio` (the keys are the layer's compressed entries, entry j at column j): entries a query slot at
    position p cannot see (j >= (p + 1) // ratio, `compressed_entries`' `valid`) may come back 0 instead of
    their score (the fused kernel skips them): callers mask them. Where the fused kernel serves and
    `narrow_act(act_dtype)`, the scores come back in `act_dtype` (rounded in the kernel: the values
    `round_narrow` gives), else in FP32 / the carrier."""
    n_heads, head_dim = qi.shape[1], qi.shape[2]

    def weighted(s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Relu'd scores s [G, q, n_i, n] of query slots `rows` -> head-weighted sums [G, q, n]."""
        w = head_w[rows].to(carrier())
        if scaled:
            s = s * head_dim**-0.5
            w = w * n_heads**-0.5
        return (s * w.unsqueeze(-1)).sum(dim=2)

    if batch_invariant.enabled():  # fixed-shape dot products (entries padded to whole tiles)
        gq = g.rows.shape
        flat = qi[g.rows].reshape(gq[0], -1, head_dim)
        if batch_invariant.marked_fp32_valued(qi):
            batch_invariant.mark_fp32_valued(flat)
        exact = batch_invariant.exact_scores_apply(flat, keys)  # the same bits, without padded tiles
        score = batch_invariant.row_scores if exact else batch_invariant.tiled_scores
        s = torch.relu(score(flat, keys).view(*gq, n_heads, -1))
        return weighted(s, g.rows).reshape(-1, keys.shape[1])
    # query blocks, as in `attend`: a long chunk's [G, Q, n_i, n] scores would not fit
    nat = native()
    op = attention_operands(act_dtype)
    keys = bmm_operand(keys, op) if nat else keys.to(carrier())
    kernel = None
    if nat and not scaled and op == torch.bfloat16:  # the backend's fused kernel: no [G, Q, n_i, n] scores
        kernel = fused_kernel("index_scores", qi, n_heads, head_dim)
    if kernel is not None:
        w = head_w[g.rows].to(carrier())
        limit = None if ratio is None else torch.div(g.q_pos + 1, ratio, rounding_mode="floor")
        out_dtype = act_dtype if narrow_act(act_dtype) else None
        return kernel(bmm_operand(qi[g.rows], op), keys, w, limit, out_dtype).reshape(-1, keys.shape[1])
    per_query = g.rows.shape[0] * n_heads * keys.shape[1]
    if g.rows.shape[1] * per_query <= SCORE_BLOCK_ELEMENTS:
        # one block (every decode step) without computing a block size: under torch.compile a size computed
        # from the symbolic row count is specialised, which recompiled the compiled decode step per bucket
        row_blocks = [g.rows]
    else:
        block = max(1, SCORE_BLOCK_ELEMENTS // max(per_query, 1))
        row_blocks = [g.rows[:, lo : lo + block] for lo in range(0, g.rows.shape[1], block)]
    out = []
    for rows in row_blocks:
        if nat:
            s = torch.relu(_shared_keys(bmm_operand(qi[rows], op), keys.transpose(1, 2)))
        else:
            s = torch.relu(torch.einsum("gqhd,gnd->gqhn", qi[rows].to(carrier()), keys))
        out.append(weighted(s, rows))
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).reshape(-1, keys.shape[1])


@dataclass
class NewEntries:
    """Compressed entries completed in this step, over all sequences."""

    slots: torch.Tensor  # long [n] entry-pool slots
    pre_rope: torch.Tensor  # [n, D] normed latent (index keys are projected from it)
    keys: torch.Tensor  # [n, D] with RoPE at the entry position
    positions: torch.Tensor  # long [n] entry position j * ratio


def compress_new(
    cache: PagedKVCache,
    meta: StepView,
    hidden_pool: str | None,
    x: torch.Tensor,
    w: CompressorWeights,
    ratio: int,
    rope: RopeSpec,
    eps: float,
    act_dtype: torch.dtype,
) -> NewEntries | None:
    """Entries of every block (non-overlapping compressor) that completes in this step, in one call.

    Block j pools tokens j*r .. j*r+r-1; those before this step come from `hidden_pool`, which must
    already hold this step's inputs too (ratio 1 needs no pool: every token is its own block).
    """
    index = meta.cached(("new", ratio), lambda: _new_entry_index(meta, ratio))
    if index is None:
        return None
    gather, positions, slots = index
    blocks_x = x[gather] if ratio == 1 else cache.read(hidden_pool, gather)
    pre_rope = compress(blocks_x, w, ratio, False, rope, eps, 0, act_dtype).pre_rope
    cos, sin = cos_sin(rope, positions)
    keys = round_to(apply_rope(pre_rope, cos, sin), act_dtype)  # the compressor's own rotation step
    return NewEntries(slots, pre_rope, keys, positions)


def _new_entry_index(meta: StepMetadata, ratio: int):
    """(rows of x (ratio 1) or token slots of the pooled blocks, entry positions, entry slots) on the
    step's device; None when no block completes in this step."""
    first, last = meta.starts // ratio, meta.ends // ratio
    seq, j = ranges(first, last)
    if len(j) == 0:
        return None
    if ratio == 1:
        gather = meta.dev(meta.offsets[seq] + j - meta.starts[seq])
    else:
        tok_seq, pos = ranges(first * ratio, last * ratio)
        gather = meta.dev(meta.token_slots_of(tok_seq, pos))
    return gather, meta.dev(j * ratio), meta.dev(meta.entry_slots_of(seq, j, ratio))

"""The two-level YOCO truncation equivalence checks (used by `eval/yoco/` and the package tests).

L1 (no weights): for one prompt, chunking and KEEP, rebuild every consumer-layer SWA / compressed
metadata fact of `yoco.py` from first principles (brute-force sets, a simulated SWA ring) and compare
`compact` with `mask` on the kept rows. L2 (weights): teacher-forced logprobs of a continuation after a
truncated prefill, `mask` vs `compact` (must be bit-identical) and vs `off` (reported: truncation is
approximate by design, spec v41-model §8 "Note on exactness").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .yoco import YocoMode, chunk_plan, chunk_plans, compressed_ranges, swa_metadata

RATIOS = (1, 2, 4, 128)


def _naive_kept_rows(data_len: int, q_start: int, q_len: int, keep: int, mode: YocoMode) -> torch.Tensor:
    rows = torch.arange(q_len)
    if mode is not YocoMode.COMPACT:
        return rows
    rows = rows[q_start + rows >= data_len - keep]
    return rows if rows.numel() else torch.tensor([q_len - 1])  # placeholder: the chunk's last row


def _rebuilt(md) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first, last, count, contiguous) of each row's visible SWA keys, rebuilt from its ring part and
    its buffer part (buffer index -> position through the first computed row)."""
    first_row = md.positions[0]
    n_ring = (md.ring_hi - md.ring_lo + 1).clamp(min=0)
    n_buf = (md.buf_hi - md.buf_lo + 1).clamp(min=0)
    b_lo, b_hi = first_row + md.buf_lo, first_row + md.buf_hi
    first = torch.where(n_ring > 0, md.ring_lo, b_lo)
    last = torch.where(n_buf > 0, b_hi, md.ring_hi)
    contiguous = (n_ring == 0) | (n_buf == 0) | (md.ring_hi + 1 == b_lo)
    return first, last, n_ring + n_buf, contiguous


class _Ring:
    """A simulated consumer SWA ring: the position and the writer (prompt tag) of each slot."""

    def __init__(self, size: int):
        self.pos = torch.full((size,), -1)
        self.owner = torch.full((size,), -1)

    def missing(self, ks: torch.Tensor, tag: int, fresh_from: int) -> torch.Tensor:
        """Keys not in the ring, or (at positions >= fresh_from) written by another prompt."""
        slot = ks % self.pos.numel()
        return (self.pos[slot] != ks) | ((ks >= fresh_from) & (self.owner[slot] != tag))


def _walk(plans, ring: _Ring, tag: int, fresh_from: int, window: int, valid_start: int, problems: list[str]):
    """Check every chunk of one prompt against the brute-force rule and the ring, then store its keys."""
    R = ring.pos.numel()
    steps = torch.arange(window)
    for plan in plans:
        mode, keep, data_len = plan.mode, plan.keep, plan.data_len
        where = f"{mode.value} chunk [{plan.q_start}, {plan.q_start + plan.q_len}) of {data_len}"
        naive = _naive_kept_rows(data_len, plan.q_start, plan.q_len, keep, mode)
        if not torch.equal(plan.kept_rows, naive):
            problems.append(f"{where}: kept rows differ from the rule's suffix (from row {int(naive[0])})")
        md = swa_metadata(plan, window, R, valid_start)
        pos = md.positions
        # Brute force: keys k with pos - W < k <= pos, k >= rect_lo, k >= valid_start, k >= 0.
        lo = torch.maximum(pos - window + 1, torch.full_like(pos, max(plan.rect_lo, valid_start, 0)))
        want = (pos - lo + 1).clamp(min=0)
        first, last, count, contiguous = _rebuilt(md)
        bad = (count != want) | ~contiguous | ((want > 0) & ((first != lo) | (last != pos)))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            problems.append(
                f"{where} pos {int(pos[i])}: visible SWA keys are not [{int(lo[i])}, {int(pos[i])}]"
            )
        # Buffer keys must be rows this chunk computed; ring keys must be in the ring right now.
        n_buf = (md.buf_hi - md.buf_lo + 1).clamp(min=0)
        outside = (n_buf > 0) & ((md.buf_lo < 0) | (md.buf_hi >= pos.numel()))
        if bool(outside.any()):
            problems.append(f"{where} pos {int(pos[int(outside.nonzero()[0])])}: key from a row not computed")
        has_ring = md.ring_hi >= md.ring_lo
        if bool(has_ring.any()):
            ks = md.ring_lo[has_ring, None] + steps[None, :]
            missing = (ks <= md.ring_hi[has_ring, None]) & ring.missing(ks, tag, fresh_from)
            if bool(missing.any()):
                r, c = (int(x) for x in missing.nonzero()[0])
                problems.append(f"{where}: key {int(ks[r, c])} not in the ring (or stale)")
        stored = md.store_slot >= 0
        ring.pos[md.store_slot[stored]] = pos[stored]
        ring.owner[md.store_slot[stored]] = tag
        if mode is YocoMode.COMPACT:
            _compare_on_kept(plan, window, R, valid_start, md, where, problems)


def _check_resumes(
    ring: _Ring, tag: int, data_len: int, window: int, backtracking: int, label: str, problems
):
    """After a prefill, a resume b <= B tokens back finds every SWA key below it in the ring."""
    for b in range(min(backtracking, data_len - 1) + 1):
        r = data_len - b
        ks = torch.arange(max(r - window + 1, 0), r)
        miss = ring.missing(ks, tag, 0) if tag == 0 else (ring.pos[ks % ring.pos.numel()] != ks)
        if bool(miss.any()):
            problems.append(
                f"{label}: resume at data_len - {b} = {r} needs SWA key {int(ks[miss][0])}, not in the ring"
            )


def l1_check(
    data_len: int, chunk_lens: list[int], keep: int, window: int, backtracking: int, valid_start: int = 0
) -> list[str]:
    """Problems found (empty = pass) for one prompt; the ring holds `window + backtracking` slots."""
    problems: list[str] = []
    rings = {}
    for mode in (YocoMode.MASK, YocoMode.COMPACT):
        ring = _Ring(window + backtracking)
        _walk(chunk_plans(data_len, chunk_lens, keep, mode), ring, 0, 0, window, valid_start, problems)
        _check_resumes(ring, 0, data_len, window, backtracking, mode.value, problems)
        rings[mode] = ring.pos
    if not torch.equal(rings[YocoMode.MASK], rings[YocoMode.COMPACT]):
        problems.append("the final SWA rings of mask and compact differ")
    return problems


def l1_prefix_hit_check(
    len_a: int,
    chunks_a: list[int],
    hit: int,
    len_b: int,
    chunks_b: list[int],
    keep: int,
    window: int,
    backtracking: int,
) -> list[str]:
    """Prompt A is prefilled (truncated), then prompt B, sharing A's first `hit` tokens, resumes from A's
    saved state at `hit` (a prefix-cache hit, or a rollback) and prefills `[hit, len_b)` in `chunks_b`.
    Every consumer SWA key B reads must be in the ring, and keys at positions >= hit must be B's own."""
    if not 0 < hit <= len_a or sum(chunks_b) != len_b - hit:
        raise ValueError(f"need 0 < hit = {hit} <= len_a = {len_a} and chunks_b summing to len_b - hit")
    problems: list[str] = []
    for mode in (YocoMode.MASK, YocoMode.COMPACT):
        ring = _Ring(window + backtracking)
        _walk(chunk_plans(len_a, chunks_a, keep, mode), ring, 0, 0, window, 0, problems)
        starts = [hit + sum(chunks_b[:i]) for i in range(len(chunks_b))]
        plans_b = [chunk_plan(len_b, s, n, keep, mode) for s, n in zip(starts, chunks_b, strict=True)]
        _walk(plans_b, ring, 1, hit, window, 0, problems)
        _check_resumes(ring, 1, len_b, window, backtracking, f"{mode.value} prompt B", problems)
    return problems


def _compare_on_kept(plan, window, ring_size, valid_start, md_c, where, problems) -> None:
    """compact metadata == mask metadata of the same chunk, restricted to the kept rows."""
    mask = chunk_plan(plan.data_len, plan.q_start, plan.q_len, plan.keep, YocoMode.MASK)
    md_m = swa_metadata(mask, window, ring_size, valid_start)
    rows = plan.kept_rows
    for name in ("positions", "pivot", "ring_lo", "ring_hi", "store_slot"):
        if not torch.equal(getattr(md_c, name), getattr(md_m, name)[rows]):
            problems.append(f"{where}: compact {name} differs from mask on the kept rows")
    # Visible key sets, rebuilt from each mode's own buffer indexing (compact's buffer starts at the clip).
    for a, b in zip(_rebuilt(md_c), _rebuilt(md_m), strict=True):
        if not torch.equal(a, b[rows]):
            problems.append(f"{where}: compact visible SWA keys differ from mask on the kept rows")
            break
    # Rows mask computes but compact skips must never be stored (compact has no key for them).
    if bool((md_m.store_slot[: plan.clip] >= 0).any()):
        problems.append(f"{where}: mask stores a key of a row compact skips")
    for r in RATIOS:
        vis_c, stored_c = compressed_ranges(plan, r)
        vis_m, stored_m = compressed_ranges(mask, r)
        if not torch.equal(vis_c, vis_m[rows]) or stored_c != stored_m:
            problems.append(f"{where}: compressed ranges (ratio {r}) differ between compact and mask")


@dataclass
class L2Report:
    """Element-wise comparison of teacher-forced continuation logprobs after a truncated prefill."""

    prompt_len: int
    keep: int
    kept_rows: int
    mask_vs_compact_bitwise: bool  # every kept row's logits
    continuation_bitwise: bool  # the continuation logprobs (subset of the above)
    max_abs_diff_vs_off: float  # continuation logprobs, truncated vs full prefill
    mean_abs_diff_vs_off: float
    argmax_agree_vs_off: float
    draft_confidence_bitwise: bool | None = None
    draft_tokens_equal: bool | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.mask_vs_compact_bitwise
            and self.continuation_bitwise
            and self.draft_confidence_bitwise is not False
        )


def _logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None])[:, 0]


def l2_compare(
    model, prompt, continuation, keep: int, backtracking: int = 6, num_draft_tokens: int = 0
) -> L2Report:
    """Run `prompt + continuation` with the plan of a `len(prompt)`-token truncated prefill in mask,
    compact and off modes and compare the logprobs of the continuation tokens element by element."""
    dev = model.device  # a measurement tool over the model: its index tensors live where the logits do
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=dev)
    cont = torch.as_tensor(continuation, dtype=torch.long, device=dev)
    if cont.numel() < 1:
        raise ValueError("continuation must hold at least one token")
    ids = torch.cat((prompt, cont))
    P = prompt.numel()
    kw = dict(yoco_keep_tokens=keep, backtracking_tokens=backtracking, yoco_prompt_len=P)
    mask = model.forward(ids, yoco_mode="mask", **kw)
    comp = model.forward(ids, yoco_mode="compact", **kw)
    off = model.forward(ids)
    kept = comp.kept_positions
    rows = torch.arange(P - 1, ids.numel() - 1, device=dev)  # positions whose logits predict the continuation
    lp_m, lp_o = _logprobs(mask.logits[rows], cont), _logprobs(off.logits[rows], cont)
    lp_c = _logprobs(comp.logits[rows - int(kept[0])], cont)
    diff = (lp_m - lp_o).abs()
    agree = (mask.logits[rows].argmax(-1) == off.logits[rows].argmax(-1)).double().mean()
    rep = L2Report(
        prompt_len=P,
        keep=keep,
        kept_rows=int(kept.numel()),
        mask_vs_compact_bitwise=torch.equal(mask.logits[kept], comp.logits),
        continuation_bitwise=torch.equal(lp_m, lp_c),
        max_abs_diff_vs_off=float(diff.max()),
        mean_abs_diff_vs_off=float(diff.mean()),
        argmax_agree_vs_off=float(agree),
    )
    if num_draft_tokens and model.weights.drafter is not None:
        # The drafter after the truncated prefill itself (the draft uses the last W main keys).
        dm = model.forward(prompt, yoco_mode="mask", num_draft_tokens=num_draft_tokens, **kw).draft
        dc = model.forward(prompt, yoco_mode="compact", num_draft_tokens=num_draft_tokens, **kw).draft
        rep.draft_confidence_bitwise = torch.equal(dm.confidence, dc.confidence)
        rep.draft_tokens_equal = torch.equal(dm.tokens, dc.tokens)
    elif num_draft_tokens:
        rep.notes.append("checkpoint has no draft blocks: DSpark confidences not compared")
    return rep

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


def _naive_kept_rows(data_len: int, q_start: int, q_len: int, keep: int, mode: YocoMode) -> list[int]:
    if mode is not YocoMode.COMPACT:
        return list(range(q_len))
    rows = [j for j in range(q_len) if q_start + j >= data_len - keep]
    return rows or [q_len - 1]  # a chunk before rect_lo keeps its last row as a placeholder


def l1_check(
    data_len: int, chunk_lens: list[int], keep: int, window: int, backtracking: int, valid_start: int = 0
) -> list[str]:
    """Problems found (empty = pass) for one prompt; the ring holds `window + backtracking` slots."""
    ring_size = window + backtracking
    problems: list[str] = []
    rect_lo = data_len - keep
    rings = {}
    for mode in (YocoMode.MASK, YocoMode.COMPACT):
        ring = [-1] * ring_size
        for plan in chunk_plans(data_len, chunk_lens, keep, mode):
            where = f"{mode.value} chunk [{plan.q_start}, {plan.q_start + plan.q_len})"
            naive = _naive_kept_rows(data_len, plan.q_start, plan.q_len, keep, mode)
            if plan.kept_rows.tolist() != naive:
                problems.append(f"{where}: kept rows {plan.kept_rows.tolist()} != rule {naive}")
            md = swa_metadata(plan, window, ring_size, valid_start)
            computed = set(md.positions.tolist())
            for i, pos in enumerate(md.positions.tolist()):
                want = [k for k in range(pos - window + 1, pos + 1) if k >= max(rect_lo, valid_start, 0)]
                got = md.visible_positions(i)
                if got != want:
                    problems.append(f"{where} pos {pos}: visible SWA keys {got} != {want}")
                for k in got:
                    if k < plan.q_start and ring[k % ring_size] != k:
                        problems.append(
                            f"{where} pos {pos}: key {k} not in the ring (slot holds {ring[k % ring_size]})"
                        )
                    if k >= plan.q_start and k not in computed:
                        problems.append(f"{where} pos {pos}: key {k} comes from a row that was not computed")
            for pos, slot in zip(md.positions.tolist(), md.store_slot.tolist(), strict=True):
                if slot >= 0:
                    ring[slot] = pos
            if mode is YocoMode.COMPACT:
                _compare_on_kept(plan, window, ring_size, valid_start, md, where, problems)
        rings[mode] = ring
        for b in range(backtracking + 1):  # resume after rolling back b tokens: keys below it from the ring
            r = data_len - b
            if r < 1:
                break
            for k in range(max(r - window + 1, 0), r):
                if ring[k % ring_size] != k:
                    problems.append(
                        f"{mode.value}: resume at data_len - {b} = {r} needs SWA key {k}, not in the ring"
                    )
                    break
    if rings[YocoMode.MASK] != rings[YocoMode.COMPACT]:
        problems.append(
            f"final SWA rings differ: mask {rings[YocoMode.MASK]} compact {rings[YocoMode.COMPACT]}"
        )
    return problems


def _compare_on_kept(plan, window, ring_size, valid_start, md_c, where, problems) -> None:
    """compact metadata == mask metadata of the same chunk, restricted to the kept rows."""
    mask = chunk_plan(plan.data_len, plan.q_start, plan.q_len, plan.keep, YocoMode.MASK)
    md_m = swa_metadata(mask, window, ring_size, valid_start)
    rows = plan.kept_rows
    for name in ("positions", "pivot", "ring_lo", "ring_hi", "store_slot"):
        if not torch.equal(getattr(md_c, name), getattr(md_m, name)[rows]):
            problems.append(f"{where}: compact {name} differs from mask on the kept rows")
    for i, row in enumerate(rows.tolist()):
        if md_c.visible_positions(i) != md_m.visible_positions(row):
            problems.append(f"{where} row {row}: compact visible keys differ from mask")
    # Rows mask computes but compact skips must never be stored (compact has no key for them).
    skipped = md_m.store_slot[: plan.clip]
    if bool((skipped >= 0).any()):
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
    prompt = torch.as_tensor(prompt, dtype=torch.long)
    cont = torch.as_tensor(continuation, dtype=torch.long)
    if cont.numel() < 1:
        raise ValueError("continuation must hold at least one token")
    ids = torch.cat((prompt, cont))
    P = prompt.numel()
    kw = dict(yoco_keep_tokens=keep, backtracking_tokens=backtracking, yoco_prompt_len=P)
    mask = model.forward(ids, yoco_mode="mask", **kw)
    comp = model.forward(ids, yoco_mode="compact", **kw)
    off = model.forward(ids)
    kept = comp.kept_positions
    rows = torch.arange(P - 1, ids.numel() - 1)  # positions whose logits predict the continuation
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

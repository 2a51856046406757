"""Attention of a group as one fused `sparse_prefill_attention` call over listed key indices."""

from __future__ import annotations

import torch

from ...numerics import native
from ...ops.model_calls import fused_kernel
from ...runtime.metadata import StepMetadata
from ...runtime.step_view import StepView
from .groups import Group
from .window_keys import WindowKeys


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

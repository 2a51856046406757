"""Joining per-request blocks of distribution rows without copying what is already joined."""

from __future__ import annotations

import torch


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` of [rows, V] blocks, without the copy when the blocks that have rows already lie
    one after the other in one storage: a view of those rows then. The q rows of a draft batch are such
    blocks (the drafter keeps every request's q in one tensor, request after request), and the next step
    verifies the requests in the order they drafted, so the verifier reads them where they are."""
    filled = [part for part in parts if part.shape[0]]
    if not filled:
        return torch.cat(parts)
    first = filled[0]
    offset, width = first.storage_offset(), first.shape[-1]
    for part in filled:
        if (
            part.dim() != 2
            or not part.is_contiguous()
            or part.dtype != first.dtype
            or part.device != first.device
            or part.shape[1] != width
            or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or part.storage_offset() != offset
        ):
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(part.shape[0] for part in filled)
    return first.as_strided((rows, width), (width, 1), first.storage_offset())

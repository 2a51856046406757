"""Token embedding: a plain row gather (no scaling)."""

from __future__ import annotations

import torch

from ..numerics import carrier


def embed(token_ids: torch.Tensor, table: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Rows of `table` [vocab, H] for `token_ids` [T] -> FP64 [T, H]; ids outside the table raise ValueError.

    `checked=True`: the caller already validated the ids on the host (the paged runtime does it in
    `StepMetadata.build`), so the device-side range check - two device->host reads per call - is skipped.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=table.device)
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D (one sequence), got shape {tuple(token_ids.shape)}")
    if (
        not checked
        and token_ids.numel()
        and (int(token_ids.min()) < 0 or int(token_ids.max()) >= table.shape[0])
    ):
        raise ValueError(
            f"token_ids must lie in [0, vocab_size={table.shape[0]}), got range "
            f"[{int(token_ids.min())}, {int(token_ids.max())}]"
        )
    return table[token_ids].to(carrier())

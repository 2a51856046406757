"""`StepView`: what a model's forward reads of one step, whichever way the step runs.

Two implementations: `metadata.StepMetadata`, the eager step (host arrays per sequence, index tensors
planned on the host once per step), and `static_metadata.StaticDecodeMetadata`, the graph-safe decode /
verification step (views of fixed device buffers, index tensors computed on the device with shapes
fixed by the graph's bucket and context tier). A forward reads the common members below; where the two
need different algorithms (a host-side plan vs computing every tile, ragged groups vs one query per
row) it asks `graph_safe`, never the class.
"""

from __future__ import annotations

from typing import Protocol

import torch


class StepView(Protocol):
    graph_safe: bool  # True: nothing may be read back or planned on the host; every shape is fixed
    block_size: int
    device: torch.device  # where the tensors live
    input_ids: torch.Tensor  # long [N]
    positions: torch.Tensor  # long [N] absolute position of every packed token
    write_slots: torch.Tensor  # long [N] flat token slot (block * block_size + offset) of every token
    logits_rows: torch.Tensor  # long [R] packed rows whose logits are returned, in batch order
    ids_checked: bool  # every input id is known to be in the vocabulary (no device-side check)

    @property
    def num_seqs(self) -> int: ...

    def cached(self, key, make):
        """The step's index tensor for `key` (built once per step, shared by every layer)."""
        ...


def entries_per_block(block_size: int, ratio: int) -> int:
    if block_size % ratio and ratio % block_size:
        raise ValueError(
            f"block_size {block_size} and compress ratio {ratio} must divide one another "
            "(a compressed entry must map to exactly one block)"
        )
    return max(1, block_size // ratio)

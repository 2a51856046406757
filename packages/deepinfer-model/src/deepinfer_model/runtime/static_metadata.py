"""`StaticDecodeMetadata`: the graph-safe `StepView` of a decode or verification step."""

from __future__ import annotations

from typing import ClassVar

import torch

from .step_view import entries_per_block


class StaticDecodeMetadata:
    """Device-only metadata of a decode or verification step for the graph-safe forward: one row per
    query token (its id, position, write slot and its sequence's block table), every row attending as a
    one-query sequence. The rows of a sequence that feeds 1 + k tokens (verification) are consecutive
    rows with consecutive positions and the same table: a row at p reads keys <= p from the pools after
    every row has written its own, which is what the eager step's query at p sees.

    Every tensor is a view of a static device buffer (`cuda_graphs.DecodeGraphRunner` fills it before a
    replay), so a CUDA graph captured over this metadata reads each step's values at fixed addresses.
    Nothing is planned on the host: the index tensors the paged attention asks `cached` for (window-key
    slots, band masks, compressed-entry validity and slots, the entries completed in the step) are
    computed on the device from `positions` and `dev_tables`, with shapes fixed by the bucket size, the
    window and `max_entries` instead of the step's context lengths. The block-table width is the
    (bucket, context tier)'s: ceil(tier / block_size) columns, the tier being at least every row's
    context, so `max_entries` and with it the index-key scoring follow the tier, not max_context. The
    step has no host arrays.

    Rows may be placeholders (bucket padding): position 0, a block table of `dummy_block` only. A
    placeholder writes only the reserved dummy block and reads only what it wrote in the step.
    """

    graph_safe: ClassVar[bool] = True

    def __init__(
        self,
        block_size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        tables: torch.Tensor,
        dummy_block: int,
        index_builders: dict,
    ) -> None:
        n = positions.shape[0]
        self.block_size = block_size
        self.device = positions.device
        self.input_ids, self.positions, self.write_slots = input_ids, positions, write_slots
        self.logits_rows = torch.arange(n, device=self.device)  # every row (the runner gathers its rows)
        self.ids_checked = True  # `StepMetadata.build` checked the real ids; placeholders use id 0
        self._cache: dict = {}  # key -> index tensor of this forward (`cached`)
        self.dev_tables = tables  # long [N, max_blocks]: every entry a real block id (dummy padded)
        self.dummy_block = int(dummy_block)
        self.rows_index = torch.arange(n, device=self.device)
        # key kind -> builder(meta, *key[1:]): the model family's device-side index tensors
        self.index_builders = index_builders

    @property
    def num_seqs(self) -> int:
        return self.positions.shape[0]

    def reset(self) -> None:
        """Forget the index tensors of the last forward (they depend on the buffers' contents)."""
        self._cache.clear()

    def cached(self, key, make):
        """The device-side counterpart of the model's host planners, by key kind (`index_builders`, from the
        model family); any other key raises (a new host-side planner must get a device form before the
        graph-safe step uses it)."""
        if key not in self._cache:
            builder = self.index_builders.get(key[0])
            if builder is None:
                raise ValueError(f"the graph-safe decode step has no device-side index for {key[0]!r}")
            self._cache[key] = builder(self, *key[1:])
        return self._cache[key]

    def dev_token_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Flat token slots of positions `pos` [N, ...] (row i: row i's sequence); blocks past the table read
        the table's last column (only ever for values that are masked or written to the dummy slot)."""
        blk = torch.clamp(
            torch.div(pos, self.block_size, rounding_mode="floor"), max=self.dev_tables.shape[1] - 1
        )
        rows = self.rows_index.view(-1, *([1] * (pos.dim() - 1)))
        return self.dev_tables[rows, blk] * self.block_size + pos % self.block_size

    def dev_entry_slots(self, j: torch.Tensor, ratio: int) -> torch.Tensor:
        """Flat entry-pool slots of entries `j` [N, ...] (row i: row i's sequence), as `entry_slots_of`."""
        first = j * ratio
        per = entries_per_block(self.block_size, ratio)
        blk = torch.clamp(
            torch.div(first, self.block_size, rounding_mode="floor"), max=self.dev_tables.shape[1] - 1
        )
        rows = self.rows_index.view(-1, *([1] * (j.dim() - 1)))
        return self.dev_tables[rows, blk] * per + torch.div(
            first % self.block_size, ratio, rounding_mode="floor"
        )

    def max_entries(self, ratio: int) -> int:
        """Entry columns every step reads for `ratio`: all this block table (the context tier's width)
        can hold (>= 1)."""
        return max(1, self.dev_tables.shape[1] * self.block_size // ratio)

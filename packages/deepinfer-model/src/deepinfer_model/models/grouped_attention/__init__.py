"""Batched (padded) views of a step's sequences, so attention runs per group of sequences, not per sequence.

Sequences are bucketed by query length (decodes with decodes, verification blocks with each other,
similar prefill chunks together); a group's queries are padded to its longest, its key sets to its
longest context, and attention is one batched computation per group. Every gather below is one
vectorised numpy / torch indexing operation: the Python work per layer is per group, never per token
or per sequence.

- `groups`: `Group`, `make_groups`, query row blocks (`row_blocks`, `query_block_rows`)
- `window_keys`, `entries`, `selected_entries`: the keys a group attends to, read from the pools
- `attend` (band path, batch-invariant tiles), `listed` (one fused kernel call), `products` (native GEMMs)
- `index_scores`: the indexer's scores per group; `compress`: entries completed in a step
- `sizes`: the block limits (monkeypatch `sizes`, not this package: its names are read there)
"""

from .attend import attend
from .compress import NewEntries, compress_new
from .entries import compressed_entries, entry_validity
from .groups import Group, make_groups, query_block_rows, row_blocks
from .index_scores import grouped_index_scores
from .listed import listed_attention
from .pool_values import mark_pool_values
from .ranges import ranges
from .selected_entries import invariant_selection, own_entries, selected_entries
from .window_keys import WindowKeys, swa_keys

__all__ = [
    "Group",
    "NewEntries",
    "WindowKeys",
    "attend",
    "compress_new",
    "compressed_entries",
    "entry_validity",
    "grouped_index_scores",
    "invariant_selection",
    "listed_attention",
    "make_groups",
    "mark_pool_values",
    "own_entries",
    "query_block_rows",
    "ranges",
    "row_blocks",
    "selected_entries",
    "swa_keys",
]

"""How much one attention layer holds at once: the limits that cut a long step into blocks of query
rows. Read as `sizes.NAME` where they apply, so one assignment here (a test's monkeypatch) reaches
every reader."""

from __future__ import annotations

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

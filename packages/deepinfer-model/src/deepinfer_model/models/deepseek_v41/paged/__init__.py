"""DeepSeek-V4.1 run incrementally over a packed batch with paged caches (spec v41-model §4.9-4.11).

Per-token blocks (Engram injection, shifted mHC, projections, MoE) run once over the packed tokens of
all sequences; attention is the only place that needs the past, and reads it from paged pools:

- `swa.L`      every layer: the token's sliding-window latent (FP8-rounded with `quantize_kv`).
- `comp.L`     KV-source layers (C2 ratio 2, C1 ratio 1): one compressed key per entry; consumer
               layers read their source's pool (`topology.kv_source`), never a copy.
- `hidden.L`   KV sources with ratio > 1: the compressor input of every token (the producer half's own
               attention input, the consumer half's YOCO shared hidden S), i.e. the state of blocks not
               complete yet.
- `index_k.L`  index-K source layers: one index key per entry; index sources read their index-K
               source's pool.
- `token_ids`  with Engram: raw token ids, for the n-gram context of the first tokens of a step.

Selections and candidate blocks are per query, so they are passed between layers within the step
(per sequence), exactly as the stateless forward's `CrossLayerState`. The drafter is not run here
(the runner contract returns logits only, like the recompute runner).

Modules: `cache_specs` (the pools), `forward` (the eager step) with `step_state`, `attention` and
`engram_rows`; `static_forward` (the graph-safe step) with `static_attention` and `static_moe`; `draft`
and `static_draft` (the drafter over the `draft_main.*` pools).
"""

from .cache_specs import v41_cache_specs
from .draft import draft_last_positions, draft_window_slots, v41_paged_draft
from .forward import v41_paged_forward
from .static_draft import static_draft_problem, v41_static_draft
from .static_forward import static_batch_invariant_problem, static_decode_problem, v41_static_decode_forward
from .static_moe import static_moe
from .step_state import query_block_rows

__all__ = [
    "draft_last_positions",
    "draft_window_slots",
    "query_block_rows",
    "static_batch_invariant_problem",
    "static_decode_problem",
    "static_draft_problem",
    "static_moe",
    "v41_cache_specs",
    "v41_paged_draft",
    "v41_paged_forward",
    "v41_static_decode_forward",
    "v41_static_draft",
]

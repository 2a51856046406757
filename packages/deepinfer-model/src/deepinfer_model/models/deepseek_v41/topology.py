"""Cross-layer topology of V4.1 (spec v41-model §1.5, §4.10, §4.11).

Each compressed layer (ratio 1 or 2) takes three things from a *source* layer: the main compressed KV,
the index keys and the top-k selection. A source list `S` maps layer `l` to the nearest source at or
before it (`max{s in S : s <= l}`); layers before `min S` are their own source. The YOCO split puts
layers `>= n_prefill_layer` (the first C1 layer) in the consumer half, whose compressed KV is projected
from one shared hidden. `build_topology` derives all of it and enforces the reference's rules so that
exactly the configs the reference accepts are accepted.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

# Runtime limits of the reference's candidate-block path (index_attn.py); the GPU-only byte alignment
# rule (topk_blocks * block_size * 2 % 1024) is deliberately not enforced on the CPU (§11).
_CANDIDATE_BLOCK_SIZES = (8, 16)
_CANDIDATE_MAX_BLOCKS = 4096
_CANDIDATE_MAX_INDEX_HEADS = 32
_CANDIDATE_INDEX_HEAD_DIM = 128


def _bad(key: str, value, rule: str) -> ValueError:
    return ValueError(f"config key {key!r} = {value!r}: {rule}")


@dataclass(frozen=True)
class Topology:
    ratios: tuple[int, ...]  # per backbone layer: 0 SWA-only, 1 C1, 2 C2
    n_prefill_layer: int  # first C1 layer = first YOCO consumer (may be >= L: YOCO off)
    kv_source: tuple[int | None, ...]  # per layer: the layer owning its compressed KV (None: SWA-only)
    index_k_source: tuple[int | None, ...]
    index_source: tuple[int | None, ...]
    candidate_source: int | None
    candidate_topk_blocks: int
    candidate_block_size: int

    @property
    def num_layers(self) -> int:
        return len(self.ratios)

    @property
    def yoco_enabled(self) -> bool:
        return self.n_prefill_layer < self.num_layers

    def is_consumer_half(self, layer: int) -> bool:
        return self.n_prefill_layer <= layer < self.num_layers

    def is_kv_source(self, layer: int) -> bool:
        return self.kv_source[layer] == layer

    def is_index_k_source(self, layer: int) -> bool:
        return self.index_k_source[layer] == layer

    def is_index_source(self, layer: int) -> bool:
        return self.index_source[layer] == layer

    def restricted_to_candidates(self, layer: int) -> bool:
        """Index-source layers after the candidate source score only tokens of its candidate blocks."""
        c = self.candidate_source
        return c is not None and layer > c and self.is_index_source(layer)


def _source_map(key: str, sources: list[int], ratios: list[int]) -> tuple[int | None, ...]:
    L = len(ratios)
    if len(set(sources)) != len(sources):
        raise _bad(key, sources, "layer ids must be distinct")
    for s in sources:
        if not 0 <= s < L:
            raise _bad(key, sources, f"layer ids must lie in [0, {L}) (draft/MTP layers never share)")
        if ratios[s] == 0:
            raise _bad(key, sources, f"layer {s} is SWA-only (ratio 0); a source must be a compressed layer")
    srt = sorted(sources)
    out: list[int | None] = []
    for layer in range(L):
        if ratios[layer] == 0 and (not srt or layer < srt[0]):
            out.append(None)
            continue
        i = bisect_right(srt, layer)
        out.append(srt[i - 1] if i else layer)  # before min(S): self-sourced
    return tuple(out)


def _check_consumers(key: str, smap: tuple[int | None, ...], ratios: list[int]) -> None:
    for layer, src in enumerate(smap):
        if src is None or src == layer:
            continue
        if ratios[layer] == 0:
            raise _bad(
                key,
                f"layer {layer} -> source {src}",
                f"layer {layer} is SWA-only but falls in the segment of source {src}: "
                "a consumer must be a compressed layer",
            )
        if ratios[layer] != ratios[src]:
            raise _bad(
                key,
                f"layer {layer} -> source {src}",
                f"a consumer must have its source's compression ratio ({ratios[layer]} != {ratios[src]})",
            )


def _ids(t: dict, key: str, default=None, required: bool = True) -> list[int]:
    if key not in t and default is None and required:
        raise ValueError(f"config key 'text_config.{key}' is missing: it is required for deepseek_v41")
    v = t.get(key, default)
    if not isinstance(v, list) or not v or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise _bad("text_config." + key, v, "must be a non-empty list of integer layer ids")
    return list(v)


def build_topology(
    t: dict,
    ratios: list[int],
    *,
    engram_layer_ids: tuple[int, ...] = (),
    dspark_target_layer_ids: tuple[int, ...] = (),
    yoco_compaction: bool = True,
) -> Topology:
    """Derive and validate the shared-layer topology from a `text_config` dict and backbone ratios."""
    ratios = list(ratios)
    L = len(ratios)
    full = t.get("compress_ratios", ratios)
    if 1 not in full:
        raise _bad(
            "text_config.compress_ratios",
            full,
            "must contain a 1 (C1 layer): its first position is n_prefill_layer, the YOCO boundary",
        )
    n_prefill = full.index(1)

    kv_ids = _ids(t, "kv_source_layer_ids")
    index_ids = _ids(t, "index_source_layer_ids")
    ik_ids = _ids(t, "index_k_source_layer_ids", default=kv_ids, required=False)
    kv = _source_map("text_config.kv_source_layer_ids", kv_ids, ratios)
    ik = _source_map("text_config.index_k_source_layer_ids", ik_ids, ratios)
    ix = _source_map("text_config.index_source_layer_ids", index_ids, ratios)
    if n_prefill < L and kv[n_prefill] != n_prefill:
        raise _bad(
            "text_config.kv_source_layer_ids",
            kv_ids,
            f"the first YOCO consumer layer n_prefill_layer = {n_prefill} must own its KV "
            "(KV sharing never crosses the YOCO boundary)",
        )

    for key, smap in (
        ("kv_source_layer_ids", kv),
        ("index_k_source_layer_ids", ik),
        ("index_source_layer_ids", ix),
    ):
        _check_consumers("text_config." + key, smap, ratios)

    # Refinement chain: each top-k segment inside one index-K segment inside one KV segment, so that a
    # layer's selection always indexes the compressed KV it attends to.
    for layer in range(L):
        if ratios[layer] == 0:
            continue
        if ik[ix[layer]] != ik[layer]:
            raise _bad(
                "text_config.index_source_layer_ids",
                index_ids,
                f"layer {layer} takes top-k from layer {ix[layer]} whose index keys come from layer "
                f"{ik[ix[layer]]}, but its own index keys come from layer {ik[layer]} "
                "(every top-k segment must lie inside one index-K segment)",
            )
        if kv[ik[layer]] != kv[layer]:
            raise _bad(
                "text_config.index_k_source_layer_ids",
                ik_ids,
                f"layer {layer} takes index keys from layer {ik[layer]} whose KV comes from layer "
                f"{kv[ik[layer]]}, but its own KV comes from layer {kv[layer]} "
                "(every index-K segment must lie inside one KV segment)",
            )

    cand, blocks, bsize = _candidate(t, ratios, ix)

    if yoco_compaction and n_prefill < L:
        late = [e for e in engram_layer_ids if e >= n_prefill]
        if late:
            raise _bad(
                "text_config.engram_layer_ids",
                list(engram_layer_ids),
                f"Engram layers must lie in the YOCO producer half (< n_prefill_layer = {n_prefill})",
            )
        sides = {x >= n_prefill for x in dspark_target_layer_ids}
        if len(sides) > 1:
            raise _bad(
                "text_config.dspark_target_layer_ids",
                list(dspark_target_layer_ids),
                f"all drafter target layers must lie on one side of n_prefill_layer = {n_prefill}",
            )

    return Topology(tuple(ratios), n_prefill, kv, ik, ix, cand, blocks, bsize)


def _candidate(t: dict, ratios: list[int], ix: tuple[int | None, ...]) -> tuple[int | None, int, int]:
    if "candidate_source_layer_id" not in t:
        raise ValueError(
            "config key 'text_config.candidate_source_layer_id' is missing: "
            "it must exist (null disables candidate blocks)"
        )
    c = t["candidate_source_layer_id"]
    if c is None:
        return None, 0, 0
    key = "text_config.candidate_source_layer_id"
    L = len(ratios)
    if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < L:
        raise _bad(key, c, f"must be null or a layer id in [0, {L})")
    if ratios[c] == 0 or ix[c] != c:
        raise _bad(key, c, "the candidate source must be a compressed index-source layer")
    if t.get("index_topk", 0) <= 0:
        raise _bad(
            "text_config.index_topk", t.get("index_topk"), "must be > 0 when candidate blocks are used"
        )
    blocks = t.get("candidate_topk_blocks")
    bsize = t.get("candidate_block_size")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0 or blocks % 8:
        raise _bad("text_config.candidate_topk_blocks", blocks, "must be a positive multiple of 8")
    if blocks > _CANDIDATE_MAX_BLOCKS:
        raise _bad("text_config.candidate_topk_blocks", blocks, f"must be <= {_CANDIDATE_MAX_BLOCKS}")
    if bsize not in _CANDIDATE_BLOCK_SIZES:
        raise _bad("text_config.candidate_block_size", bsize, f"must be one of {_CANDIDATE_BLOCK_SIZES}")
    for layer in range(c, L):
        if ratios[layer] != ratios[c]:
            raise _bad(
                key,
                c,
                f"every layer from the candidate source on must have its ratio {ratios[c]}; "
                f"layer {layer} has {ratios[layer]}",
            )
    if blocks * bsize < t["index_topk"]:
        raise _bad(
            "text_config.candidate_topk_blocks",
            blocks,
            f"candidate capacity {blocks} x {bsize} must be >= index_topk = {t['index_topk']}",
        )
    n_heads = t.get("index_n_heads", 0)
    if n_heads > _CANDIDATE_MAX_INDEX_HEADS:
        raise _bad(
            "text_config.index_n_heads",
            n_heads,
            f"must be <= {_CANDIDATE_MAX_INDEX_HEADS} when candidate blocks are used",
        )
    if t.get("index_head_dim") != _CANDIDATE_INDEX_HEAD_DIM:
        raise _bad(
            "text_config.index_head_dim",
            t.get("index_head_dim"),
            f"must be {_CANDIDATE_INDEX_HEAD_DIM} when candidate blocks are used",
        )
    return c, blocks, bsize

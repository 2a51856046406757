"""DeepSeek-V4.1 stateless forward (spec v41-model §2.1 and Appendix A): one sequence, no cache.

`DeepseekV41ForCausalLM.forward(token_ids)` runs the backbone (shifted mHC, Engram, SWA / C2 / C1
attention with cross-layer sharing, candidate blocks, YOCO shared hidden, MoE), returns the logits of
every position, the drafter's target features and main keys, and optionally one drafted block after
the last position. It is the reference a paged / cached runtime must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ...layers.embedding import embed
from ...numerics import logits as head_logits
from ...numerics import mode as numerics_mode
from ...numerics import pinned
from ...ops.model_calls import hc_read, rms_norm
from .attention import AttentionTrace, CrossLayerState, layer_attention
from .blocks import ShiftedHC, moe_ffn
from .config import DeepseekV41Config
from .drafter import DraftOutput, Sampler, draft_block, greedy, main_keys
from .drafter_heads import confidence_temperatures, target_features
from .engram import EngramHasher, engram_inject
from .engram_vocab import CompressedVocabulary
from .kv_quant import KVQuant
from .vision import VisionTower
from .vision.embed import image_input_embeddings
from .weights import BlockWeights, V41Weights
from .yoco import YocoMode, check_keep, chunk_plan

# moe_fn(layer, block_weights, y [T, H]) -> [T, H]: the backbone MoE of one layer (default: `moe_ffn`
# on all experts; deepinfer_model.parallel.ExpertParallelMoE runs it expert-parallel).
MoEFn = Callable[[int, BlockWeights, torch.Tensor], torch.Tensor]


class RowSplit(Protocol):
    """Context-parallel prefill: this rank keeps some rows of the sequence between attention layers.

    `local(full [T, ...])` -> this rank's rows; `gather(local)` -> all rows in sequence order (collective);
    `query_rows` -> the sequence row of each local row (attention computes queries only for those).
    deepinfer_model.parallel.MirrorRows implements it with the balanced mirror split.
    """

    query_rows: torch.Tensor | None

    def local(self, full: torch.Tensor) -> torch.Tensor: ...

    def gather(self, local: torch.Tensor) -> torch.Tensor: ...


@dataclass
class V41Output:
    """`logits` [T, V] FP32; `features` [T, n_t·H] drafter inputs; `main_keys` [Ld, T, D] drafter KV;
    `draft` = one drafted block after the last position (if asked); `trace` per-layer attention views.

    Under YOCO `compact` the consumer layers run only the kept rows: `hidden` / `logits` (and `features` /
    `main_keys` when the drafter targets are consumer layers) then cover the positions `kept_positions`
    (None = every position)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    features: torch.Tensor | None = None
    main_keys: torch.Tensor | None = None
    draft: DraftOutput | None = None
    trace: list[AttentionTrace] | None = None
    kept_positions: torch.Tensor | None = None


class DeepseekV41ForCausalLM:
    """The V4.1 text model on the CPU reference path (FP32 math, rounding through `act_dtype`)."""

    def __init__(
        self,
        config: DeepseekV41Config,
        weights: V41Weights,
        vocab: CompressedVocabulary | None = None,
        act_dtype: torch.dtype = torch.float32,
        quantize_kv: bool = False,
        moe_fn: MoEFn | None = None,
        draft_moe_fn: MoEFn | None = None,
    ):
        """`act_dtype` sets the activation rounding points (FP32: none; BF16: the engine's); `quantize_kv`
        also rounds every cached KV value to its cache format (FP8 SWA, FP4 main KV, FP4 index Q/K);
        `moe_fn` / `draft_moe_fn` replace the backbone / draft-block MoE (e.g. expert parallel; called with
        the layer / draft-block index), default: all experts in-process."""
        if config.engram is not None and vocab is None:
            raise ValueError(
                "this config has Engram layers: pass the compressed vocabulary of its tokenizer.json"
            )
        numerics_mode()  # a bad DEEPINFER_NUMERICS (or native + batch-invariant) fails at load
        self.config = config
        self.weights = weights
        self.act_dtype = act_dtype
        self.kvq = KVQuant(enabled=quantize_kv, fp4_main_kv=config.use_fp4_sparse_kv)
        self.engram = (
            EngramHasher(config.engram, vocab, self.device, config.vocab_size) if config.engram else None
        )
        self.moe_fn: MoEFn = moe_fn or self.local_moe
        self.draft_moe_fn: MoEFn | None = draft_moe_fn
        self.vision = VisionTower(config.vision, weights.vision) if weights.vision is not None else None

    @property
    def device(self) -> torch.device:
        """Where the weights are; every tensor of a forward is allocated there."""
        return self.weights.embed.device

    def local_moe(self, layer: int, blk: BlockWeights, y: torch.Tensor) -> torch.Tensor:
        """The backbone MoE of `layer` with every routed expert in this process."""
        return moe_ffn(self.config, blk, y, self.config.num_experts_per_tok, self.act_dtype)

    @torch.no_grad()
    @pinned  # the numerics settings read once per forward, not at every layer and op
    def forward(
        self,
        token_ids,
        *,
        num_draft_tokens: int = 0,
        next_token: int | None = None,
        sampler: Sampler = greedy,
        return_trace: bool = False,
        yoco_keep_tokens: int | None = None,
        backtracking_tokens: int = 6,
        yoco_mode: YocoMode | str = YocoMode.MASK,
        yoco_prompt_len: int | None = None,
        logit_rows: torch.Tensor | list[int] | None = None,
        row_split: RowSplit | None = None,
        image_features: list[torch.Tensor] | None = None,
    ) -> V41Output:
        """Logits for every position of one sequence; with `num_draft_tokens > 0` also draft that many
        tokens after `next_token` (default: the greedy next token of the last position).

        `yoco_keep_tokens` = KEEP applies YOCO bounded replay in `mask` mode (§8): consumer-half layers see
        no SWA key before `len - KEEP` (explicitly approximate; needs KEEP >= sliding_window +
        `backtracking_tokens`). Producer layers, the shared hidden and consumer compressed KV are unchanged.
        `yoco_mode = "compact"` runs the consumer layers on the kept rows `[len - KEEP, len)` only (bitwise
        equal to `mask` there; see `V41Output.kept_positions`). `yoco_prompt_len` = the prompt length the
        plan was made for (default: every token is prompt): tokens after it are a decode continuation,
        so `rect_lo = yoco_prompt_len - KEEP` stays where the truncated prefill put it (a resume after a
        rollback may be shorter than `yoco_prompt_len`).

        `logit_rows` computes logits only for those positions (e.g. `[-1]` for a prefill that samples the
        last token; `out.logits` is then `[len(logit_rows), V]`); the draft always uses the last position.

        `row_split` (context parallel): per-token work (mHC, Engram, MoE) runs on this rank's rows only;
        each attention layer computes queries and outputs for this rank's rows only and all-gathers the
        keys (SWA latents; the layer input on KV sources, S once); the final hidden state is gathered,
        so every rank returns the full output.

        `image_features`: the aligned embeddings [cells, H] of each image whose sentinel block
        (`vision/tokens.py`) `token_ids` holds, in order (`self.vision.embed_image` makes them); needs a
        checkpoint with a vision tower.
        """
        cfg, w, act = self.config, self.weights, self.act_dtype
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if image_features is None:
            x0 = embed(ids, w.embed)
        elif w.image_embeds is None:
            raise ValueError("image_features given, but this checkpoint has no vision tower")
        else:
            pad = int(cfg.extra.get("pad_token_id", 2))
            x0 = image_input_embeddings(ids, w.embed, w.image_embeds, pad, image_features, act)
        if x0.shape[0] == 0:
            raise ValueError("token_ids must hold at least one token")
        split = row_split or _NO_SPLIT
        x0 = split.local(x0)
        positions = torch.arange(ids.shape[0], device=ids.device)
        kept = self._yoco_kept(
            ids.shape[0], yoco_keep_tokens, backtracking_tokens, yoco_mode, yoco_prompt_len
        )
        if kept is not None and row_split is not None:
            raise ValueError("yoco_mode = compact cannot be combined with row_split (context parallel)")
        prompt_len = ids.shape[0] if yoco_prompt_len is None else yoco_prompt_len
        rect_lo = 0 if yoco_keep_tokens is None else max(0, prompt_len - yoco_keep_tokens)
        rows = self.engram.rows(ids) if self.engram else {}
        targets = cfg.dspark.target_layer_ids if cfg.dspark else ()
        feats: dict[int, torch.Tensor] = {}
        traces: list[AttentionTrace] = []
        state = CrossLayerState()
        hc = ShiftedHC(x0, cfg)
        for layer, blk in enumerate(w.layers):
            if kept is not None and layer == cfg.n_prefill_layer:
                # Compact boundary: S for every row (consumer compressed KV / index keys need all of them),
                # then only the kept rows of the trunk, pending pre mix and producer selections go on.
                state.shared_hidden = rms_norm(  # (held as the sub-layer inputs are: `ShiftedHC`)
                    hc_read(hc.trunk, hc.prev_pre, act, narrow=True),
                    blk.attn_norm,
                    cfg.rms_norm_eps,
                    act,
                    narrow=True,
                )
                hc.trunk, hc.prev_pre, positions = hc.trunk[kept], hc.prev_pre[kept], positions[kept]
                if state.selection is not None:
                    state.selection = state.selection[kept]
                if state.candidates is not None:
                    state.candidates = state.candidates[kept]
            if blk.engram is not None:
                hc.trunk = engram_inject(
                    hc.trunk, split.local(rows[layer]), blk.engram, cfg.rms_norm_eps, act
                )
            if layer in targets:
                feats[layer] = target_features(hc.trunk, act)

            def attention(y, layer=layer, blk=blk, positions=positions):
                if layer == cfg.n_prefill_layer and kept is None:
                    # YOCO: consumer-half compressed KV is projected from S (every row; CP gathers it once)
                    state.shared_hidden = split.gather(y)
                out, tr = layer_attention(
                    cfg,
                    layer,
                    blk,
                    y,
                    positions,
                    state,
                    act,
                    self.kvq,
                    rect_lo if cfg.topology.is_consumer_half(layer) else 0,
                    split.query_rows,
                    None if split.query_rows is None else split.gather,
                )
                traces.append(tr)
                return out

            hc.sublayer(blk.hc_attn, blk.attn_norm, attention, act)
            hc.sublayer(
                blk.hc_ffn,
                blk.ffn_norm,
                lambda y, layer=layer, blk=blk: self.moe_fn(layer, blk, y),
                act,
            )
        hidden = rms_norm(split.gather(hc.final(act)), w.norm, cfg.rms_norm_eps, act)
        rows = (
            hidden
            if logit_rows is None
            else hidden[self._rows(logit_rows, hidden.shape[0]).to(hidden.device)]
        )
        logits = head_logits(rows, w.head, act)  # FP32 logits (§2.1)
        out = V41Output(logits=logits, hidden=hidden, trace=traces if return_trace else None)
        out.kept_positions = None if kept is None else positions
        if w.drafter is not None:
            out.features = split.gather(torch.cat([feats[t] for t in targets], dim=1))
            feat_pos = (
                positions
                if out.features.shape[0] == positions.shape[0]
                else torch.arange(ids.shape[0], device=ids.device)
            )
            out.main_keys = main_keys(cfg, w.drafter, out.features, feat_pos, act, self.kvq)
            if num_draft_tokens:
                if not 1 <= num_draft_tokens <= 32:
                    raise ValueError(f"num_draft_tokens = {num_draft_tokens} must lie in [1, 32]")
                if next_token is None:
                    last = out.logits[-1] if logit_rows is None else head_logits(hidden[-1], w.head, act)
                    next_token = int(last.argmax())
                g = int(next_token)
                if not 0 <= g < cfg.vocab_size:
                    raise ValueError(f"next_token = {g} must lie in [0, vocab_size={cfg.vocab_size})")
                keys_by_pos = out.main_keys
                if feat_pos.shape[0] != ids.shape[0]:  # compact, consumer-side targets: NaN where skipped
                    keys_by_pos = out.main_keys.new_full(
                        (out.main_keys.shape[0], ids.shape[0], out.main_keys.shape[2]), float("nan")
                    )
                    keys_by_pos[:, feat_pos] = out.main_keys
                out.draft = draft_block(
                    cfg,
                    w.drafter,
                    w.embed,
                    w.head,
                    keys_by_pos,
                    g,
                    int(positions[-1]),
                    num_draft_tokens,
                    sampler,
                    confidence_temperatures(num_draft_tokens),
                    act,
                    self.kvq,
                    self.draft_moe_fn,
                )
        elif num_draft_tokens:
            raise ValueError(
                "num_draft_tokens > 0 needs a checkpoint with draft blocks (num_nextn_predict_layers > 0)"
            )
        return out

    @staticmethod
    def _rows(logit_rows, n: int) -> torch.Tensor:
        idx = torch.as_tensor(logit_rows, dtype=torch.long, device="cpu")  # validated on the host
        if idx.dim() != 1 or (idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n)):
            raise ValueError(f"logit_rows must be a 1-D list of positions in [-{n}, {n}), got {logit_rows!r}")
        return idx

    def _yoco_kept(
        self, n: int, keep: int | None, backtracking: int, mode: YocoMode | str, prompt_len: int | None
    ) -> torch.Tensor | None:
        """Validate the truncation arguments; the kept positions in compact mode, else None."""
        mode = YocoMode.parse(mode, "yoco_mode")
        if keep is None:
            if prompt_len is not None:
                raise ValueError("yoco_prompt_len needs yoco_keep_tokens")
            return None
        if mode is YocoMode.OFF:
            raise ValueError(
                "yoco_keep_tokens was given with yoco_mode = off: pass mask or compact, or no KEEP"
            )
        cfg = self.config
        if not (cfg.topology.yoco_enabled and cfg.n_prefill_layer > 0):
            raise ValueError("yoco_keep_tokens needs a YOCO config (0 < n_prefill_layer < num_hidden_layers)")
        try:
            check_keep(keep, cfg.sliding_window, backtracking)
        except ValueError as e:
            raise ValueError(f"yoco_keep_tokens: {e}") from None
        if prompt_len is not None and prompt_len < 1:
            raise ValueError(f"yoco_prompt_len = {prompt_len} must be >= 1")
        plan = chunk_plan(n if prompt_len is None else prompt_len, 0, n, keep, mode)
        return plan.kept_positions.to(self.device) if mode is YocoMode.COMPACT else None

    __call__ = forward


class _WholeSequence:
    """The default `RowSplit`: one process holds every row."""

    query_rows = None

    def local(self, full: torch.Tensor) -> torch.Tensor:
        return full

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return local


_NO_SPLIT = _WholeSequence()

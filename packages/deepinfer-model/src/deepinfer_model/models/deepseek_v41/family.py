"""DeepSeek-V4.1's step contract (`family.ModelFamily`): paged pools, eager and graph-safe steps, drafts,
YOCO truncation as its per-step extras."""

from __future__ import annotations

import numpy as np
import torch

from ...family import ModelFamily, register_family
from ...numerics import pinned
from .config import MODEL_TYPE
from .drafter import DraftOutput, greedy
from .drafter_heads import confidence_temperatures
from .paged import (
    draft_last_positions,
    draft_window_slots,
    static_batch_invariant_problem,
    static_decode_problem,
    static_draft_problem,
    v41_cache_specs,
    v41_paged_draft,
    v41_paged_forward,
    v41_static_decode_forward,
    v41_static_draft,
)
from .static_index import STATIC_INDEX
from .yoco import check_settings
from .yoco_step import YOCO_TAG, YocoStep, resume_problem, tag_spec

_forward = pinned(v41_paged_forward)  # the numerics settings read once per step


class DeepseekV41Family(ModelFamily):
    model_type = MODEL_TYPE
    static_index = STATIC_INDEX
    greedy = staticmethod(greedy)
    context_parallel = True

    def cache_specs(self, model, block_size: int) -> list:
        return v41_cache_specs(model, block_size)

    def forward(self, model, meta, cache, extras=None, row_split=None, images=None) -> torch.Tensor:
        return _forward(model, meta, cache, extras, row_split=row_split, images=images)

    def moe_blocks(self, model, part: str = "backbone") -> list:
        return model.weights.drafter.blocks if part == "drafter" else model.weights.layers

    # YOCO prefill truncation (spec v41-model §8): the step's plan, and the tag of every written slot
    def check_extras(self, model, settings, backtracking: int):
        if settings is None or not settings.enabled:
            return None
        check_settings(settings, model.config, backtracking)
        return settings

    def extras_specs(self, settings, block_size: int) -> list:
        return [] if settings is None else [tag_spec(block_size)]

    def step_extras(self, model, meta, cache, settings, seq_ids, prompt_lens) -> YocoStep:
        if prompt_lens is None:
            raise ValueError(
                "a step under YOCO truncation needs each sequence's original prompt length "
                "(StepBatch.prompt_lens): build it from the scheduler's output, or pass "
                "StepBatch.of(..., prompt_lens=...)"
            )
        step = YocoStep.build(meta, settings, prompt_lens)
        problem = resume_problem(cache, meta, step, model.config.sliding_window, seq_ids)
        if problem:
            raise ValueError(problem)
        cache.write(YOCO_TAG, torch.as_tensor(meta.host_write_slots, device="cpu"), step.tags)
        return step

    def resume_problem(self, model, cache, meta, settings, prompt_len: int) -> str | None:
        step = YocoStep.build(meta, settings, [prompt_len])
        return resume_problem(cache, meta, step, model.config.sliding_window)

    # graph-safe decode / verification step
    def static_problem(self, model) -> str | None:
        return static_decode_problem(model)

    # the function itself, not a wrapper: `runtime.compiled` compiles it and its tests check identity
    static_forward = staticmethod(v41_static_decode_forward)

    def static_batch_invariant_problem(self, model, drafter: bool = False) -> str | None:
        return static_batch_invariant_problem(model, drafter)

    # DSpark drafts
    def has_drafter(self, model) -> bool:
        return model.weights.drafter is not None

    def draft(self, model, meta, cache, seqs, tokens, num_draft_tokens, sampler, last_positions) -> list:
        return v41_paged_draft(
            model, meta, cache, seqs, tokens, num_draft_tokens, sampler or greedy, last_positions
        )

    def draft_last_positions(self, model, meta, seqs, tokens, last_positions) -> np.ndarray:
        return draft_last_positions(model, meta, seqs, tokens, last_positions)

    def static_draft_problem(self, model) -> str | None:
        return static_draft_problem(model)

    def draft_window(self, model) -> int:
        return int(model.config.sliding_window)

    def draft_pools(self, model) -> list[str]:
        return [f"draft_main.{i}" for i in range(len(model.weights.drafter.blocks))]

    def draft_window_slots(self, meta, seqs, last, width: int) -> np.ndarray:
        return draft_window_slots(meta, seqs, last, width, width)

    def draft_temperatures(self, num_draft_tokens: int) -> torch.Tensor:
        return confidence_temperatures(num_draft_tokens)

    def static_draft(
        self, model, cache, tokens, last, window_slots, num_draft_tokens, temperatures, pick=None
    ):
        return v41_static_draft(
            model, cache, tokens, last, window_slots, num_draft_tokens, temperatures, pick
        )

    def draft_output(self, tokens, confidence, positions, probs=None) -> DraftOutput:
        return DraftOutput(tokens, None, confidence, None, positions, probs)


FAMILY = register_family(DeepseekV41Family())

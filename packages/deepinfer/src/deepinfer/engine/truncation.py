"""YoCo prefill truncation (spec v41-model §8) as the engine sees it: settings, start-up check and
the prefill FLOP estimate.

The model package does the work (`deepinfer_model`'s YoCo helpers, the paged runner), and the
runner reads each sequence's ORIGINAL prompt length from the step itself (the scheduler's
`prompt_lens`, unchanged by chunked prefill, decode, draft rollback and the recompute after a
preemption, so `rect_lo = prompt_len - KEEP` stays put). The engine only has to (1) read and check
the settings once and (2) keep the scheduler from handing out prefix-cache hits whose consumer SWA
keys were computed under another `rect_lo`: under truncation every request's prefix-cache namespace
(`cache_salt`) is its prompt length, so hits only come from prompts of the same length (same
`rect_lo`, which the paged runner accepts), including a preempted sequence's own blocks.
"""

from __future__ import annotations

import numpy as np
from deepinfer_model import (
    YocoSettings,
    check_prompt_logprobs,
    check_settings,
    max_backtracking,
    prefill_flops,
)

from .. import envs


def settings_from_env() -> YocoSettings:
    """The env pair, validated (invalid mode / non-integer or missing KEEP raise ValueError)."""
    return YocoSettings.from_env(
        {
            "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": str(envs.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")),
            "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": str(envs.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")),
        }
    )


class Truncation:
    """Engine-wide truncation state; `enabled` False makes every method a no-op."""

    def __init__(self, settings: YocoSettings, model, num_speculative_tokens: int) -> None:
        self.settings = settings
        self.backtracking = max_backtracking(
            int(envs.DEEPINFER_MAX_BACKTRACKING_TOKENS), num_speculative_tokens
        )
        cfg = model.config
        # Only V4.1 configs (YoCo topology) have a FLOP model; other models report 0.
        self._flops_cfg = cfg if hasattr(cfg, "topology") and hasattr(cfg, "n_prefill_layer") else None
        if settings.enabled:
            if self._flops_cfg is None:
                raise ValueError(
                    f"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE = {settings.mode.value} needs a DeepSeek-V4.1 "
                    "model with a YoCo split; this model has none (set it to 'off')"
                )
            check_settings(settings, cfg, self.backtracking)  # KEEP >= W + B, the error names both sides

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def check_request(self, prompt_logprobs: bool) -> None:
        check_prompt_logprobs(self.settings, prompt_logprobs)

    def cache_salt(self, prompt_len: int) -> int:
        """The scheduler's prefix-cache namespace for a request: its prompt length under truncation
        (a hit from another length would read consumer SWA keys clipped at another `rect_lo`), the
        shared namespace 0 otherwise."""
        return prompt_len if self.enabled else 0

    def step_flops(self, batch, is_prefill: np.ndarray, prompt_len_of: dict[int, int]) -> float:
        """Estimated FP8-equivalent FLOPs of the step's prefill chunks (skipped consumer rows excluded)."""
        if self._flops_cfg is None:
            return 0.0
        keep, mode = self.settings.keep_tokens or None, self.settings.mode
        total = 0.0
        for i in np.flatnonzero(is_prefill):
            q_len = int(batch.query_lens[i])
            if q_len > 0:
                start = int(batch.start_positions[i])
                data_len = prompt_len_of[int(batch.seq_ids[i])]
                total += prefill_flops(self._flops_cfg, start, q_len, data_len, keep, mode).total
        return total

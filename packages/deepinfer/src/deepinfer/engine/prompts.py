"""Prompt encoding and checks shared by the single-process engine and the data-parallel front (which
answers them from its ranks' model facts, without a model of its own)."""

from __future__ import annotations

from ..tokenizer import encode_prompt


class PromptChecks:
    """Needs `tokenizer`, `bos_token_id`, `vocab_size` and `max_model_len` on the engine."""

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, self.bos_token_id, prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; it must be shorter than max_model_len={self.max_model_len}"
            )

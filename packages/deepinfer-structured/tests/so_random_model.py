"""A seeded random "model" for tests: logits depend only on (seed, prefix), so a drafter and a
verifier that look at the same prefix see the same logits. A growing bias towards closing
punctuation and EOS makes constrained outputs end in a reasonable number of tokens."""

from __future__ import annotations

import zlib

import torch

CLOSING_TEXT = ['"', "}", "]", ")", ".", "@", "-", ":"]


def closing_ids(tokenizer) -> list[int]:
    ids = []
    for text in CLOSING_TEXT:
        enc = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(enc) == 1, (text, enc)
        ids.append(enc[0])
    return ids


class RandomModel:
    def __init__(self, vocab_size: int, eos_id: int, closing: list[int], ramp: float = 0.35):
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.closing = torch.tensor(closing)
        self.ramp = ramp

    def logits(self, seed: int, prefix: list[int]) -> torch.Tensor:
        key = zlib.crc32(torch.tensor([seed, *prefix], dtype=torch.int64).numpy().tobytes())
        gen = torch.Generator().manual_seed(key)
        out = torch.randn(self.vocab_size, generator=gen)
        step = len(prefix)
        out[self.closing] += self.ramp * step
        out[self.eos_id] += 2 * self.ramp * step
        return out

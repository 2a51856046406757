"""`SamplingParams.bad_words` as the token sequences the sampler bans.

A word reads as other tokens at the start of a text than after a space ("word" vs " word" with a
byte-level BPE), so each word is banned in both spellings, as vLLM does: the spaced one is kept when
it is a different single spelling of the word (a different first token, as many tokens), not the
bare one behind a separate space token.
"""

from __future__ import annotations

from tokenizers import Tokenizer


def bad_words_token_ids(
    tokenizer: Tokenizer, words: list[str] | None, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, without duplicates. A sequence holding an id outside the model's
    vocabulary is dropped: the model can never produce it."""
    out: list[tuple[int, ...]] = []
    for word in words or ():
        bare = word.lstrip()
        plain = tuple(tokenizer.encode(bare, add_special_tokens=False).ids)
        spaced = tuple(tokenizer.encode(" " + bare, add_special_tokens=False).ids)
        candidates = [plain]
        if plain and len(spaced) == len(plain) and spaced[0] != plain[0]:
            candidates.append(spaced)
        for seq in candidates:
            if seq and max(seq) < vocab_size and seq not in out:
                out.append(seq)
    return tuple(out)

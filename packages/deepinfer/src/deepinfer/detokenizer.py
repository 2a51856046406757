"""Incremental detokenization and stop-string handling.

Decoding token by token is wrong for byte-level BPE: one character (CJK, emoji) may span several
tokens, and a partial one decodes to U+FFFD. So we decode a short window twice — the tokens already
emitted as text ("prefix") and the prefix plus the new tokens — and emit the difference only once it
no longer ends in an incomplete character. The window restarts after every emission, so each step
costs O(window), not O(output length).
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before this are already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_one(self, token_id: int) -> str:
        """One token's text on its own, special tokens included (a logprob's `decoded_token`)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # special token skipped, or a character still incomplete
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request, emit whatever is pending (an incomplete character shows as U+FFFD)."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters of `text`.

    Returns (index where it starts, the stop string) or None. Only the tail needs searching: earlier
    text was checked when it arrived.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best

"""Engram tokenizer compression (spec v41-model §5.1): raw token id -> compressed id.

Tokens whose decoded text normalises to the same key ("The", " the", "THE" ...) share one compressed
id, so the n-gram tables are indexed by a smaller, case/accent/space-insensitive vocabulary. The
normaliser is built from HF `tokenizers` normalizers (the checkpoint's own tokenizer library).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from deepinfer_cluster import envs
from tokenizers import Regex, Tokenizer, normalizers

PAD_TOKEN = "<｜▁pad▁｜>"
DEFAULT_PAD_ID = 2
IMAGE_SENTINEL = -1  # compressed id of tokens without a mapping (>= tokenizer size, image placeholders)
_SPACE_SENTINEL = "\ue000"  # private-use char protecting a lone space from the trim


def engram_normalizer() -> normalizers.Normalizer:
    """NFKC -> NFD -> strip accents -> lowercase -> collapse whitespace runs -> trim (a lone space survives)."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def pad_token_id_from_env() -> int:
    """Raw pad id the engine uses for Engram context (`DEEPINFER_ENGRAM_PAD_TOKEN`, default 2)."""
    return envs.get("DEEPINFER_ENGRAM_PAD_TOKEN")


@dataclass(frozen=True)
class CompressedVocabulary:
    """`table[raw_id]` = compressed id (int64, -1 for unmapped); `size` = number of distinct keys."""

    table: torch.Tensor
    size: int
    pad_id: int  # compressed id of the raw pad token

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, pad_token_id: int | None = None) -> CompressedVocabulary:
        if tokenizer.id_to_token(DEFAULT_PAD_ID) != PAD_TOKEN:
            raise ValueError(
                f"tokenizer id {DEFAULT_PAD_ID} is {tokenizer.id_to_token(DEFAULT_PAD_ID)!r}; "
                f"Engram requires it to be {PAD_TOKEN!r}"
            )
        pad_raw = pad_token_id_from_env() if pad_token_id is None else pad_token_id
        n = tokenizer.get_vocab_size()
        if not 0 <= pad_raw < n:
            raise ValueError(f"Engram pad token id {pad_raw} must lie in [0, {n})")
        norm = engram_normalizer()
        texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        key_to_id: dict[str, int] = {}
        table = torch.empty(n, dtype=torch.long)
        for i, text in enumerate(texts):
            if "\ufffd" in text:  # an incomplete UTF-8 piece: keep the raw vocabulary string
                key = tokenizer.id_to_token(i)
            else:
                key = norm.normalize_str(text) or text
            table[i] = key_to_id.setdefault(key, len(key_to_id))
        return cls(table=table, size=len(key_to_id), pad_id=int(table[pad_raw]))

    @classmethod
    def from_file(cls, path: str | Path, pad_token_id: int | None = None) -> CompressedVocabulary:
        """From a `tokenizer.json` (or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"Engram needs the checkpoint's tokenizer.json; {str(path)!r} does not exist")
        return cls.from_tokenizer(Tokenizer.from_file(str(path)), pad_token_id)

    def compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Compressed ids of raw `token_ids` (any shape); ids outside the tokenizer map to -1."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.table.device)
        known = (ids >= 0) & (ids < self.table.shape[0])
        return torch.where(known, self.table[ids.clamp(0, self.table.shape[0] - 1)], IMAGE_SENTINEL)

"""Build xgrammar's TokenizerInfo from a checkpoint's tokenizer.json (HF `tokenizers`).

We do not go through transformers: the engine only has the `tokenizers` object. The mask width is
the model's LM-head width (`vocab_size`), which may exceed the tokenizer's length (padding rows);
ids with no token are never allowed. Tokens flagged "special" in tokenizer.json are given to
xgrammar as empty strings, which makes xgrammar treat them as special (never allowed by a grammar)
instead of as literal text such as "<｜begin▁of▁sentence｜>" inside a JSON string.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import xgrammar as xg


def _decoder_types(decoder: dict | None) -> list[str]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders", []) for t in _decoder_types(d)]
    return [decoder.get("type", "")]


def _vocab_kind(spec: dict) -> tuple[xg.VocabType, bool]:
    """(vocab type, add_prefix_space) from the tokenizer's decoder description."""
    decoders = _decoder_types(spec.get("decoder"))
    if "ByteLevel" in decoders:
        return xg.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in decoders:
        # SentencePiece-style (Llama-2 family): "▁" marks spaces and a leading space is prepended.
        return xg.VocabType.BYTE_FALLBACK, True
    return xg.VocabType.RAW, False


def _eos_from_config(tokenizer_json: Path, tok: tokenizers.Tokenizer) -> list[int] | None:
    config = tokenizer_json.with_name("tokenizer_config.json")
    if not config.exists():
        return None
    eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    token_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    return None if token_id is None else [token_id]


def tokenizer_info_from_file(
    tokenizer_json: str | Path,
    vocab_size: int,
    stop_token_ids: list[int] | None = None,
) -> xg.TokenizerInfo:
    """TokenizerInfo for `tokenizer_json`, with masks `vocab_size` wide (the model's LM-head width).

    `stop_token_ids` default to the eos_token of a tokenizer_config.json next to the file.
    """
    path = Path(tokenizer_json)
    spec = json.loads(path.read_text(encoding="utf-8"))
    tok = tokenizers.Tokenizer.from_file(str(path))
    if stop_token_ids is None:
        stop_token_ids = _eos_from_config(path, tok)
        if stop_token_ids is None:
            raise ValueError(f"stop_token_ids: none given and no eos_token found next to {path}")
    return tokenizer_info_from_tokenizer(tok, vocab_size, stop_token_ids, spec=spec)


def tokenizer_info_from_tokenizer(
    tok: tokenizers.Tokenizer,
    vocab_size: int,
    stop_token_ids: list[int],
    *,
    spec: dict | None = None,
) -> xg.TokenizerInfo:
    """TokenizerInfo for an already loaded `tokenizers.Tokenizer` (see tokenizer_info_from_file)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size: must be a positive int (the LM-head width), got {vocab_size!r}")
    if not stop_token_ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in stop_token_ids):
        raise ValueError(
            f"stop_token_ids: must be a non-empty list of ids in [0, {vocab_size}), got {stop_token_ids!r}"
        )
    spec = spec if spec is not None else json.loads(tok.to_str())
    special = {entry["id"] for entry in spec.get("added_tokens", []) if entry.get("special")}
    special -= set(stop_token_ids)  # stop tokens must stay visible so the grammar can end with them
    # Ids past the LM-head width can never be produced; ids past the tokenizer are padding rows.
    encoded = [""] * vocab_size
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = token
    vocab_type, add_prefix_space = _vocab_kind(spec)
    return xg.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=add_prefix_space,
    )
